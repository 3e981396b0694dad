"""eop.Worker inside a host's event loop: exactly once, a clean stop, a cancelled host."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from structlog.testing import capture_logs

import eop
from eop import faults
from eop.pg import migrate

from .bed import (
    STREAM,
    SUBJECT,
    bed_settings,
    create_effects_table,
    drained,
    effects_by_body,
    publish,
    record_effect,
    running,
    scalar,
    wait_for,
)

DEAD = "SELECT count(*) FROM eop.dead_letters"


def make_app(database_url: str, nats_url: str, delay_s: float = 0.0, **changes: Any) -> eop.App:
    """An app whose handler writes one effect per message, after ``delay_s``."""
    app = eop.App(settings=bed_settings(database_url, nats_url, **changes))
    app.stream(STREAM, subjects=["ORDERS.>"])
    app.started = asyncio.Event()  # type: ignore[attr-defined]  # the test's own flag

    @app.handler(stream=STREAM, subject=SUBJECT, name="embedded")
    async def handle(msg: eop.Message, session: AsyncSession) -> None:
        app.started.set()  # type: ignore[attr-defined]
        await asyncio.sleep(delay_s)
        await record_effect(session, "embedded", msg)

    return app


def other_tasks() -> set[asyncio.Task[Any]]:
    return asyncio.all_tasks() - {asyncio.current_task()}  # type: ignore[operator]


async def baseline(js: Any) -> set[asyncio.Task[Any]]:
    """The tasks before the worker, the test's own NATS reply subscription's included."""
    await js.account_info()
    return other_tasks()


async def test_a_worker_in_the_host_loop_processes_each_message_once_and_installs_no_signal_handler(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """`async with eop.Worker(app).running()`: ready on entry, every message once, no dead
    letter, the host's SIGTERM handler untouched, and no task left behind on exit."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url)
    before = await baseline(js)
    sigterm = signal.getsignal(signal.SIGTERM)
    async with eop.Worker(app).running() as worker:
        assert worker.ready.is_set()
        assert signal.getsignal(signal.SIGTERM) == sigterm
        for i in range(50):
            await publish(js, f"m{i}", msg_id=f"id-{i}")
        await wait_for(lambda: drained(js, "eop-embedded"), what="50 messages")
    assert await effects_by_body(engine) == {f"m{i}": 1 for i in range(50)}
    assert await scalar(engine, DEAD) == 0
    assert other_tasks() <= before


async def test_a_hosted_workers_readiness_tells_of_a_nats_outage_and_of_its_stop(
    database_url: str, nats_server: Any, engine: AsyncEngine
) -> None:
    """`await worker.readiness()` answers what `/readyz` checks, without a metrics port:
    all true while running; NATS connected false while the server is down, true again once
    back; not draining false after a stop is asked for."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_server.url)
    async with eop.Worker(app).running() as worker:
        checks = await worker.readiness()
        assert checks == {
            "subscriptions_bound": True,
            "not_draining": True,
            "nats_connected": True,
            "database_reachable": True,
        }
        nats_server.stop()

        async def nats_down() -> bool:
            return not (await worker.readiness())["nats_connected"]

        await wait_for(nats_down, what="readiness to see NATS gone")
        nats_server.start()

        async def all_ready() -> bool:
            return all((await worker.readiness()).values())

        await wait_for(all_ready, what="readiness once NATS is back")
        worker.stop()
        assert not (await worker.readiness())["not_draining"]


async def test_a_hosted_workers_metrics_go_into_the_hosts_registry(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """`eop.Worker(app, metrics_registry=r)`: the host's own /metrics (rendering r) counts
    the worker's messages; a second worker on the same registry is refused in one line."""
    import prometheus_client  # the metrics extra, part of the test install

    await create_effects_table(engine)
    app = make_app(database_url, nats_url)
    registry = prometheus_client.CollectorRegistry()
    async with eop.Worker(app, metrics_registry=registry).running():
        for i in range(5):
            await publish(js, f"m{i}", msg_id=f"id-{i}")
        await wait_for(lambda: drained(js, "eop-embedded"), what="5 messages")
        labels = {"handler": "embedded", "stream": STREAM}
        processed = registry.get_sample_value("eop_messages_processed_total", labels)
        assert processed == 5
        with pytest.raises(eop.ConfigurationError, match="its own registry"):
            eop.Worker(app, metrics_registry=registry)
    assert b"eop_messages_processed_total" in prometheus_client.generate_latest(registry)


async def test_leaving_the_host_finishes_the_message_in_flight_and_acks_it(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """shutdown() while a handler runs: the handler finishes, commits and acks; nothing is
    redelivered; no task is left."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url, delay_s=1.0)
    before = await baseline(js)
    worker = eop.Worker(app)
    await worker.start()
    await publish(js, "slow")
    await asyncio.wait_for(app.started.wait(), 20)  # type: ignore[attr-defined]
    await worker.shutdown()
    assert worker.cancelled == 0
    assert await effects_by_body(engine) == {"slow": 1}
    assert await drained(js, "eop-embedded")
    assert other_tasks() <= before


async def test_a_cancelled_host_stops_the_worker_gracefully_then_is_cancelled(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The host's task is cancelled while a handler runs: the worker finishes the message
    (commit and ack), then the host's CancelledError goes on; no task is left."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url, delay_s=1.0)
    before = await baseline(js)

    serving = asyncio.Event()

    async def host() -> None:
        async with eop.Worker(app).running():
            serving.set()
            await asyncio.Event().wait()  # serve until cancelled

    task = asyncio.create_task(host())
    await asyncio.wait_for(serving.wait(), 30)
    await publish(js, "slow")
    await asyncio.wait_for(app.started.wait(), 20)  # type: ignore[attr-defined]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)
    assert await effects_by_body(engine) == {"slow": 1}
    assert await drained(js, "eop-embedded")
    assert await scalar(engine, DEAD) == 0
    assert other_tasks() <= before


async def test_a_host_cancelled_twice_cancels_the_handler_and_the_message_comes_back_once(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A second cancellation during the stop cancels the handler at once (its transaction
    rolls back): the message is redelivered to the next worker and takes effect once."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url, delay_s=60.0, ack_wait_s=2.0)
    before = await baseline(js)

    serving = asyncio.Event()

    async def host() -> None:
        async with eop.Worker(app).running():
            serving.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(host())
    await asyncio.wait_for(serving.wait(), 30)
    await publish(js, "stuck")
    await asyncio.wait_for(app.started.wait(), 20)  # type: ignore[attr-defined]
    task.cancel()
    await asyncio.sleep(0.5)  # the stop has begun and waits for the handler
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)
    assert other_tasks() <= before
    assert await effects_by_body(engine) == {}
    again = make_app(database_url, nats_url, ack_wait_s=2.0)
    async with eop.Worker(again).running():
        await wait_for(lambda: drained(js, "eop-embedded"), what="the redelivery")
    assert await effects_by_body(engine) == {"stuck": 1}
    assert await scalar(engine, DEAD) == 0


LOCK_WAITS = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
)


async def test_the_grace_holds_while_a_compaction_round_waits_for_the_handler_in_flight(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A compaction round's watermark raise waits for the claims in flight (they read the
    watermark FOR SHARE). A stop must not wait for that round: the handler still running
    after shutdown_grace_s is cancelled, and the next worker applies its message once."""
    await create_effects_table(engine)
    changes = {"shutdown_grace_s": 1.0, "compaction_interval_s": 0.2, "ack_wait_s": 2.0}
    app = eop.App(settings=bed_settings(database_url, nats_url, **changes))
    app.stream(STREAM, subjects=["ORDERS.>"])
    started = asyncio.Event()

    @app.handler(stream=STREAM, subject=SUBJECT, name="embedded")
    async def handle(msg: eop.Message, session: AsyncSession) -> None:
        if msg.data == b"stuck":
            started.set()
            await asyncio.Event().wait()  # until cancelled
        await record_effect(session, "embedded", msg)

    worker = eop.Worker(app)
    await worker.start()
    # A message acked first puts the ack floor above 0, so that rounds raise the watermark.
    await publish(js, "first")
    await wait_for(lambda: _has_effect(engine, "first"), what="the first message")
    await publish(js, "stuck")
    await asyncio.wait_for(started.wait(), 20)
    await wait_for(lambda: _lock_waits(engine), what="a compaction round waiting on the claim")
    # Far above the stop's own bound (1 s of grace + the acks); without the fix it never ends.
    await asyncio.wait_for(worker.shutdown(), 60)
    assert worker.cancelled == 1
    again = make_app(database_url, nats_url, **changes)
    async with eop.Worker(again).running():
        await wait_for(lambda: drained(js, "eop-embedded"), what="the redelivery")
    assert await effects_by_body(engine) == {"first": 1, "stuck": 1}
    assert await scalar(engine, DEAD) == 0


async def _has_effect(engine: AsyncEngine, body: str) -> bool:
    return body in await effects_by_body(engine)


async def _lock_waits(engine: AsyncEngine) -> bool:
    return bool(await scalar(engine, LOCK_WAITS))


async def test_start_raises_what_kept_the_worker_from_starting(
    database_url: str, js: Any, engine: AsyncEngine
) -> None:
    """NATS unreachable: start() raises eop.NatsUnavailable after its attempts; no task left."""
    from eop.tools import embedded

    before = await baseline(js)
    url = f"nats://127.0.0.1:{embedded.free_port()}"
    app = make_app(database_url, url, startup_attempts=1)
    with pytest.raises(eop.NatsUnavailable):
        await eop.Worker(app).start()
    assert other_tasks() <= before


async def test_a_host_cancelled_while_the_worker_starts_leaves_no_worker_behind(
    database_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Cancelled during start() (NATS unreachable, the worker retrying): the cancellation
    goes on, not the worker's error, and no task of the worker is left."""
    from eop.tools import embedded

    before = await baseline(js)
    url = f"nats://127.0.0.1:{embedded.free_port()}"
    app = make_app(database_url, url, startup_attempts=3)
    starting = asyncio.create_task(eop.Worker(app).start())
    await asyncio.sleep(0.5)  # into the start-up's retries
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(starting, 60)
    assert other_tasks() <= before


async def test_a_hosted_worker_that_stops_by_itself_is_no_longer_ready_nor_alive(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The worker stops by itself while its host runs (here its handler's table is dropped:
    a misconfiguration): `ready` is cleared and `alive` false, so that the host's
    readiness and liveness checks go red; `error` and `shutdown()` say why, and one
    `worker.failed` line is logged. Nothing is dead-lettered."""
    from structlog.testing import capture_logs

    await create_effects_table(engine)
    app = make_app(database_url, nats_url, batch=1, backoff_max_s=0.2)
    worker = eop.Worker(app)
    with capture_logs() as logs:
        await worker.start()
        assert worker.ready.is_set()
        assert worker.alive
        assert worker.error is None
        await publish(js, "m0", msg_id="id-0")
        await wait_for(lambda: equals_effects(engine, {"m0": 1}), what="the first effect")
        async with engine.begin() as conn:
            await conn.execute(sa.text("DROP TABLE effects"))
        for i in range(1, 10):
            await publish(js, f"m{i}", msg_id=f"id-{i}")
        await wait_for(lambda: stopped(worker), timeout_s=60, what="the worker's own stop")
        assert not worker.ready.is_set()
        assert isinstance(worker.error, eop.ConfigurationError)
        with pytest.raises(eop.ConfigurationError, match="does not exist"):
            await worker.shutdown()
    assert [e["event"] for e in logs if e["event"] == "worker.failed"] == ["worker.failed"]
    assert await scalar(engine, DEAD) == 0


async def test_start_without_waiting_returns_at_once_and_is_stopped_during_an_outage(
    database_url: str, js: Any, engine: AsyncEngine
) -> None:
    """`start(wait=False)` (for a host such as uvicorn, which reads no stop signal until
    its start-up returns): it returns while NATS is unreachable, the worker not ready but
    alive; `shutdown()` then ends its start-up wait at once, and no task is left."""
    from eop.tools import embedded

    before = await baseline(js)
    url = f"nats://127.0.0.1:{embedded.free_port()}"
    worker = eop.Worker(make_app(database_url, url))  # waits for NATS for ever
    await asyncio.wait_for(worker.start(wait=False), 5)
    await asyncio.sleep(1.0)  # into the start-up's retries
    assert worker.alive
    assert not worker.ready.is_set()
    await asyncio.wait_for(worker.shutdown(), 30)
    assert not worker.alive
    assert worker.error is None
    assert other_tasks() <= before


async def equals_effects(engine: AsyncEngine, expected: dict[str, int]) -> bool:
    return await effects_by_body(engine) == expected


async def stopped(worker: eop.Worker) -> bool:
    return not worker.alive


async def test_leaving_running_does_not_raise_again_what_the_worker_stopped_with(
    database_url: str, js: Any, engine: AsyncEngine
) -> None:
    """`running(wait=False)` with NATS unreachable and one start-up attempt: the worker
    ends by itself in the background (`worker.failed`, `error`); leaving the block does
    not raise it again, which would fail the host's own shutdown."""
    from structlog.testing import capture_logs

    from eop.tools import embedded

    url = f"nats://127.0.0.1:{embedded.free_port()}"
    with capture_logs() as logs:
        async with eop.Worker(make_app(database_url, url, startup_attempts=1)).running(
            wait=False
        ) as worker:
            await wait_for(lambda: stopped(worker), timeout_s=60, what="the failed start")
    assert isinstance(worker.error, eop.NatsUnavailable)
    assert [e["event"] for e in logs if e["event"] == "worker.failed"] == ["worker.failed"]


def frozen_app(database_url: str, nats_url: str, *, ordered: bool, **changes: Any) -> eop.App:
    """An app whose handler writes one effect per message after 0.05 s, over 10 keys,
    ordered by key or not."""
    app = eop.App(settings=bed_settings(database_url, nats_url, **changes))
    app.stream(STREAM, subjects=["ORDERS.>"])

    @app.handler(
        stream=STREAM,
        subject="ORDERS.*",
        name="embedded",
        order_by="subject:1" if ordered else None,
    )
    async def handle(msg: eop.Message, session: AsyncSession) -> None:
        await asyncio.sleep(0.05)
        await record_effect(session, "embedded", msg)

    return app


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
async def test_a_hosted_worker_stops_while_postgresql_is_frozen_and_loses_nothing(
    ordered: bool, make_postgres_server: Any, nats_url: str, js: Any
) -> None:
    """PostgreSQL frozen (SIGSTOP: its sockets accept, nothing answers) under a hosted
    worker at work, its relay on: the host's stop still ends with PostgreSQL frozen (the
    messages in flight are cancelled after the grace, the relay's round is abandoned, an
    ordered handler's partitions are left to their lease, the parked retries' poll is
    cancelled at the grace's end). Thawed, a new worker applies every message once, none
    dead-lettered."""
    pg = make_postgres_server()
    migrate.upgrade(pg.url)
    engine = create_async_engine(pg.url)
    await create_effects_table(engine)
    before, after = 30, 10
    # Leases renewed every third of a second, parked retries polled every tenth: a
    # renewal and a poll are under way at the freeze.
    app = frozen_app(
        pg.url,
        nats_url,
        ordered=ordered,
        shutdown_grace_s=1.0,
        publish_timeout_s=1.0,
        relay_lease_s=1.0,
        partition_lease_s=1.0,
        retry_poll_s=0.1,
        concurrency=16,
    )
    worker = eop.Worker(app)
    await worker.start()
    for i in range(before):
        await publish(js, f"m{i}", subject=f"ORDERS.k{i % 10}")
    await wait_for(lambda: _effects_at_least(engine, before), what="the worker at work")
    frozen = _server_processes(pg.pid)
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    # Taken in by the idle worker, whose slots are mostly free: the parked retries' poll
    # takes them and waits on PostgreSQL too.
    for i in range(before, before + after):
        await publish(js, f"m{i}", subject=f"ORDERS.k{i % 10}")
    await asyncio.sleep(0.5)
    stopping = asyncio.ensure_future(worker.shutdown())
    # A liveness bound, far above the stop's (grace, ack give-up, relay): without them,
    # the stop waits for PostgreSQL, which answers only once thawed below.
    await asyncio.wait({stopping}, timeout=60)
    stopped_frozen = stopping.done()
    for pid in frozen:
        os.kill(pid, signal.SIGCONT)
    await stopping
    assert stopped_frozen
    assert worker.cancelled > 0  # the freeze caught messages in flight
    async with running(frozen_app(pg.url, nats_url, ordered=ordered)):
        await wait_for(
            lambda: _effects_at_least(engine, before + after), timeout_s=60, what="the rest"
        )
    assert await effects_by_body(engine) == {f"m{i}": 1 for i in range(before + after)}
    assert await scalar(engine, DEAD) == 0
    await engine.dispose()


async def test_a_hosted_workers_commit_caught_by_a_frozen_postgresql_does_not_hold_its_stop(
    make_postgres_server: Any, nats_url: str, js: Any
) -> None:
    """PostgreSQL frozen just before a batch's COMMIT goes out (a stall at before_commit):
    the COMMIT, which a stop never cuts, waits on it for ever. The stop still ends,
    ack_give_up_s + 5 s after the grace, the COMMIT left to end by itself; thawed, a new
    worker applies every message once."""
    pg = make_postgres_server()
    migrate.upgrade(pg.url)
    engine = create_async_engine(pg.url)
    await create_effects_table(engine)
    count = 200
    settings = dict(shutdown_grace_s=1.0, ack_give_up_s=1.0, publish_timeout_s=1.0)
    worker = eop.Worker(frozen_app(pg.url, nats_url, ordered=False, **settings))
    await worker.start()
    for i in range(count):
        await publish(js, f"m{i}", subject=f"ORDERS.k{i % 10}")
    await wait_for(lambda: _effects_at_least(engine, 10), what="the worker at work")
    faults.arm([faults.Rule("before_commit", "stall", seconds=1.0, nth=1)], seed=1)
    try:
        with capture_logs() as logs:
            await wait_for(lambda: _logged(logs, "fault.hit"), what="a COMMIT about to go out")
        frozen = _server_processes(pg.pid)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
    finally:
        faults.disarm()
    stopping = asyncio.ensure_future(worker.shutdown())
    await asyncio.wait({stopping}, timeout=60)  # a liveness bound, as above
    stopped_frozen = stopping.done()
    for pid in frozen:
        os.kill(pid, signal.SIGCONT)
    await stopping
    assert stopped_frozen
    assert worker.abandoned_commits >= 1
    async with running(frozen_app(pg.url, nats_url, ordered=False)):
        await wait_for(
            lambda: drained(js, "eop-embedded"), timeout_s=60, what="the messages redelivered"
        )
    assert await effects_by_body(engine) == {f"m{i}": 1 for i in range(count)}
    assert await scalar(engine, DEAD) == 0
    await engine.dispose()


async def _logged(logs: list[Any], event: str) -> bool:
    return any(entry.get("event") == event for entry in logs)


async def _effects_at_least(engine: AsyncEngine, n: int) -> bool:
    return int(await scalar(engine, "SELECT count(*) FROM effects")) >= n


def _server_processes(root: int) -> list[int]:
    """``root`` and its descendants: PostgreSQL's backends each lead a process group of
    their own, so a signal to the postmaster's group does not reach them."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += frontier
    return found
