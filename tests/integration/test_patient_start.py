"""A worker started while PostgreSQL or NATS is down or restarting waits for them, unready,
for as long as it takes; SIGTERM ends the wait with status 0; ``--startup-attempts N``
and configuration errors still end it at once with one line."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import nats
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import eop
from eop.broker import consumers, jetstream
from eop.handler import StreamSpec
from eop.pg import migrate
from eop.runtime import startup
from eop.tools import embedded

from .bed import (
    STREAM,
    bed_settings,
    create_effects_table,
    drained,
    effects_by_body,
    equals,
    error_lines,
    publish,
    record_effect,
    wait_for,
)
from .test_bad_input import assert_clear_error
from .test_cli import APP, ROOT, Workers, consumer_exists, eop_env
from .test_cli import eop as run_eop
from .test_embedding import make_app
from .test_telemetry import get

# Retries logged before a server comes back: 0.5 + 1 + 2 + 4 s of backoff at least, past
# the whole budget of the old default (4 attempts, 3.5 s), after which a worker exited 1.
_RETRIES_PAST_THE_OLD_BUDGET = 5


def _retries(log_text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for line in log_text.splitlines()
        if line.startswith("{") and '"worker.startup_retry"' in line
    ]


async def _status(port: int, path: str) -> int:
    try:
        return (await get(port, path))[0]
    except OSError:
        return 0  # not serving yet


async def _status_is(port: int, path: str, expected: int) -> bool:
    return await _status(port, path) == expected


async def _waits_unready(proc: subprocess.Popen[bytes], pool: Workers, port: int) -> str:
    """Until the worker has logged :data:`_RETRIES_PAST_THE_OLD_BUDGET` retries: it keeps
    running, alive (/healthz 200) and not ready (/readyz 503). The last retry's error."""
    deadline = time.monotonic() + 90  # a stall guard
    while True:
        retries = _retries(pool.logs())
        health = (await _status(port, "/healthz"), await _status(port, "/readyz"))
        assert proc.poll() is None, f"the worker exited ({proc.returncode}):\n{pool.logs()[-3000:]}"
        if retries:
            assert health == (200, 503)
        if retries and max(r["attempt"] for r in retries) >= _RETRIES_PAST_THE_OLD_BUDGET:
            return str(retries[-1]["error"])
        assert time.monotonic() < deadline, "no start-up retries logged"
        await asyncio.sleep(0.2)


async def test_a_worker_started_while_postgres_is_down_waits_unready_then_works(
    make_postgres_server: Any, nats_url: str, js: Any, tmp_path: Path
) -> None:
    """PostgreSQL down for longer than the old start-up budget: the worker (default settings)
    keeps retrying, alive and unready; once PostgreSQL is up it becomes ready, processes
    messages, and stops with status 0."""
    pg = make_postgres_server()
    migrate.upgrade(pg.url)
    engine = create_async_engine(pg.url)
    await create_effects_table(engine)
    await engine.dispose()
    await asyncio.to_thread(pg.stop)
    port = embedded.free_port()
    env = eop_env(pg.url, nats_url, EOP_METRICS_PORT=str(port), EOP_METRICS_HOST="127.0.0.1")
    pool = Workers(env, tmp_path)
    try:
        proc = pool.start()
        error = await _waits_unready(proc, pool, port)
        assert "cannot use PostgreSQL" in error
        await asyncio.to_thread(pg.start)
        await wait_for(lambda: _status_is(port, "/readyz", 200), timeout_s=60, what="ready")
        await publish(js, "after-outage")
        await wait_for(lambda: drained(js, "eop-cli"), what="the message")
        assert await effects_by_body(engine) == {"after-outage": 1}
    finally:
        codes = await asyncio.to_thread(pool.stop_all)
        await engine.dispose()
    assert codes == [0]


async def test_a_worker_of_two_processes_started_while_nats_is_down_waits_unready_then_works(
    database_url: str, nats_server: embedded.NatsServer, engine: AsyncEngine, tmp_path: Path
) -> None:
    """NATS down for longer than the old start-up budget under `eop worker --processes 2`:
    both processes keep retrying; the supervisor's /healthz holds and its /readyz fails;
    once NATS is up the worker becomes ready, processes messages, and stops with 0."""
    await create_effects_table(engine)
    await asyncio.to_thread(nats_server.stop)
    port = embedded.free_port()
    pool = Workers(eop_env(database_url, nats_server.url, EOP_METRICS_HOST="127.0.0.1"), tmp_path)
    try:
        proc = pool.start("--processes", "2", "--metrics-port", str(port))
        error = await _waits_unready(proc, pool, port)
        assert "NATS is unreachable" in error
        await asyncio.to_thread(nats_server.start)
        await wait_for(lambda: _status_is(port, "/readyz", 200), timeout_s=60, what="ready")
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            await publish(js, "after-outage")
            await wait_for(lambda: drained(js, "eop-cli"), what="the message")
        finally:
            await nc.close()
        assert await effects_by_body(engine) == {"after-outage": 1}
    finally:
        codes = await asyncio.to_thread(pool.stop_all)
    assert codes == [0]


def _ordered_app(database_url: str, nats_url: str) -> eop.App:
    """An app with one ordered handler of two partitions, one effect per message."""
    app = eop.App(settings=bed_settings(database_url, nats_url))
    app.stream(STREAM, subjects=["ORDERS.>"])

    @app.handler(
        stream=STREAM, subject="ORDERS.*", name="ordered", order_by="subject:1", partitions=2
    )
    async def handle(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, "ordered", msg)

    return app


@pytest.mark.parametrize(
    ("call", "when", "outage_s", "app_of", "durable"),
    [
        ("connect", "after", 7, make_app, "eop-embedded"),
        # Longer: the consumer's creation first asks for the stream's subjects (5 s at
        # most, a failure shrugged off), then for the consumer (5 s more).
        ("ensure_consumer", "before", 12, make_app, "eop-embedded"),
        ("ensure_stream", "after", 7, _ordered_app, "eop-ordered"),
    ],
    ids=["stream-after-connect", "consumer", "ordered-prepare-after-stream"],
)
async def test_nats_restarting_during_provisioning_is_waited_for(
    call: str,
    when: str,
    outage_s: float,
    app_of: Callable[[str, str], eop.App],
    durable: str,
    database_url: str,
    nats_server: embedded.NatsServer,
    engine: AsyncEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NATS restarts between two JetStream calls of the start (after connecting, before the
    consumer's creation, after the stream's) and stays down longer than a JetStream request
    waits (5 s): the call that finds it down (the stream's lookup, the consumer's, an
    ordered handler's stream check) is retried like the connection; it used to end the
    start with "stream 'ORDERS': NATS did not answer". The worker is not ready meanwhile,
    then starts and processes messages."""
    await create_effects_table(engine)
    module = consumers if call == "ensure_consumer" else jetstream
    real = getattr(module, call)
    restarts: list[asyncio.Task[None]] = []

    async def restart() -> None:
        await asyncio.sleep(outage_s)
        await asyncio.to_thread(nats_server.start)

    async def outage() -> None:
        if not restarts:
            await asyncio.to_thread(nats_server.stop)
            restarts.append(asyncio.create_task(restart()))

    async def then_restart(*args: Any, **kwargs: Any) -> Any:
        if when == "before":
            await outage()
        result = await real(*args, **kwargs)
        if when == "after":
            await outage()
        return result

    monkeypatch.setattr(module, call, then_restart)
    worker = eop.Worker(app_of(database_url, nats_server.url))
    starting = asyncio.create_task(worker.start())
    # Not ready while NATS is down (checked during the outage: once NATS is back, the
    # start may finish at any moment).
    await wait_for(lambda: _began(restarts), timeout_s=60, what="NATS stopped")
    assert not worker.ready.is_set()
    await wait_for(lambda: _restarted(restarts), timeout_s=60, what="NATS restarted")
    await asyncio.wait_for(starting, 60)  # raises what ended the start
    try:
        nc = await nats.connect(nats_server.url)
        try:
            await publish(nc.jetstream(), "after-restart")
            # The effect, not the consumers: an ordered handler's take their partitions
            # after it is ready.
            done = {"after-restart": 1}
            await wait_for(lambda: equals(effects_by_body(engine), done), what="the effect")
            await wait_for(lambda: drained(nc.jetstream(), durable), what="the ack")
        finally:
            await nc.close()
    finally:
        await worker.shutdown()


async def _restarted(restarts: list[asyncio.Task[None]]) -> bool:
    return bool(restarts) and restarts[0].done()


@pytest.mark.parametrize("command", ["worker", "relay"])
async def test_sigterm_while_waiting_for_nats_stops_at_once_with_status_0(
    command: str, database_url: str, tmp_path: Path
) -> None:
    """SIGTERM while `eop worker` (or `eop relay`) waits for NATS at start: the connection
    attempt under way is cancelled and the process exits 0, a stop, not an error, without
    waiting for the backoff or the stop deadline (the watchdog would exit 3)."""
    url = f"nats://127.0.0.1:{embedded.free_port()}"
    env = eop_env(database_url, url, EOP_SHUTDOWN_GRACE_S="60")
    argv = ["worker", APP] if command == "worker" else ["relay", "--app", APP]
    log = tmp_path / f"{command}.log"
    proc = _start(argv, env, log)
    try:
        await wait_for(
            lambda: _logged(log, "worker.startup_retry"),
            timeout_s=60,
            what="a start-up retry",
        )
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = _text(log)
    assert code == 0, output[-3000:]
    assert '"event": "worker.startup_stopped"' in output
    assert error_lines(output) == []


class _StalledAfterTheHandlers(startup.Patience):
    """Start-up patience that never gets past the outbox-only streams: NATS stopped
    answering after the handler was bound and its loop had started fetching."""

    async def streams(
        self, js: Any, streams: Iterable[StreamSpec], transforms: Mapping[str, tuple[str, str]]
    ) -> None:
        streams = list(streams)
        if any(stream.name == _LATER for stream in streams):
            await self.stopping.wait()
            raise startup.Stopped
        await super().streams(js, streams, transforms)


_LATER = "LATER"


def _set(event: threading.Event) -> Callable[[], Awaitable[bool]]:
    async def is_set() -> bool:
        return event.is_set()

    return is_set


async def test_a_stop_during_start_up_finishes_the_messages_already_fetched(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A stop while start-up still waits on a server, after a handler's loop began to fetch:
    the message its sync handler is running finishes, commits and is acked, as on any
    stop; its thread is not left without an executor and nothing fails."""
    await create_effects_table(engine)
    app = eop.App(settings=bed_settings(database_url, nats_url))
    app.stream(STREAM, subjects=["ORDERS.>"])
    app.stream(_LATER, subjects=["later.>"])
    running = threading.Event()

    @app.handler(stream=STREAM, subject="ORDERS.created", name="embedded")
    def handle(msg: eop.Message, session: Session) -> None:
        running.set()
        time.sleep(1.0)
        session.execute(
            sa.text("INSERT INTO effects (handler, msg_key, body) VALUES ('s', :k, :b)"),
            {"k": msg.idempotency_key, "b": msg.data.decode()},
        )

    worker = eop.Worker(app)
    worker._startup = _StalledAfterTheHandlers(app.settings, worker._startup.stopping)
    run = asyncio.create_task(worker.run())
    try:
        await wait_for(lambda: consumer_exists(js, "eop-embedded"), what="the consumer")
        await publish(js, "early")
        await wait_for(_set(running), what="the handler running")
        worker.stop()
        await asyncio.wait_for(run, 60)
    finally:
        run.cancel()
    assert not worker.ready.is_set()
    assert worker.processed == 1
    assert await effects_by_body(engine) == {"early": 1}
    assert await drained(js, "eop-embedded")


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "eop", *argv], env=env, cwd=ROOT, stdout=out, stderr=out
        )


def _text(path: Path) -> str:
    return path.read_text()


async def _logged(path: Path, event: str) -> bool:
    return f'"event": "{event}"' in _text(path)


def test_the_startup_attempts_flag_still_fails_fast_with_one_line(database_url: str) -> None:
    """`--startup-attempts 2`: NATS down, one retry, then exit 1 and one `eop: error:` line."""
    url = f"nats://127.0.0.1:{embedded.free_port()}"
    result = run_eop("worker", APP, "--startup-attempts", "2", env=eop_env(database_url, url))
    assert_clear_error(result, "NATS is unreachable at nats://127.0.0.1")
    assert len(_retries(result.stderr)) == 1


@pytest.mark.parametrize(
    ("change", "needle"),
    [({"database": "eop_nosuchdb"}, "does not exist"), ({"username": "nobody"}, "nobody")],
    ids=["no-such-database", "no-such-role"],
)
def test_postgres_refusing_the_login_fails_at_once_under_the_default(
    database_url: str, nats_url: str, change: dict[str, str], needle: str
) -> None:
    """Patience is for servers that are down, not for a wrong database_url: a missing
    database or a refused role exits 1 at once, with one line naming the fix."""
    url = sa.make_url(database_url).set(**change).render_as_string(hide_password=False)
    result = run_eop("worker", APP, env=eop_env(url, nats_url))
    line = assert_clear_error(result, "PostgreSQL at", "refused the connection", needle)
    assert "EOP_DATABASE_URL" in line
    assert _retries(result.stderr) == []


async def _began(restarts: list[asyncio.Task[None]]) -> bool:
    return bool(restarts)
