"""Stuck deliveries: a message left unacknowledged for 3 AckWaits while others are acked.

JetStream's ``ack_floor.last_active`` moves with every ack, not only the
floor's: a message held behind a stream of acked ones must still be found
stuck, by ``eop audit`` and ``eop status`` (exit 1, with its sequence and how
long it waited), by the workers' metric and by their log, whether its
worker holds it alive (a held row) or is frozen with it (SIGSTOP).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

import eop
from eop.ops import audit, status

from . import heldapp
from .bed import STREAM, SUBJECT, bed_settings, drained, publish, running, scalar, wait_for
from .test_cli import Workers, consumer_exists
from .test_cli import eop as run_eop

HELD_APP = "tests.integration.heldapp:app"
DURABLE = "eop-ledger"
ACK_WAIT_S = 2.0
STUCK_AFTER_S = 3 * ACK_WAIT_S
"""The default bound: ``stuck_after_ack_waits`` (3) AckWaits."""


def make_app(database_url: str, nats_url: str, **changes: Any) -> eop.App:
    """The ledger handler of :mod:`heldapp`, in this process."""
    app = eop.App(settings=bed_settings(database_url, nats_url, ack_wait_s=ACK_WAIT_S, **changes))
    app.stream(STREAM, subjects=["ORDERS.>"], storage="file")
    app.handler(stream=STREAM, subject=SUBJECT, name="ledger")(heldapp.post)
    return app


@contextlib.asynccontextmanager
async def held_row(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """An outside transaction holding the hot account's row until the block ends."""
    async with engine.connect() as conn:
        await conn.begin()
        await conn.execute(
            sa.text("SELECT n FROM accounts WHERE id = :id FOR UPDATE"), {"id": "hot"}
        )
        try:
            yield conn
        finally:
            await conn.rollback()


@contextlib.asynccontextmanager
async def acking(js: Any) -> AsyncIterator[None]:
    """Other accounts' messages, published and acked all along the block: the floor's
    ``last_active`` stays recent."""

    async def publish_forever() -> None:
        i = 0
        while True:
            await publish(js, f"k{i}")
            i += 1
            await asyncio.sleep(0.2)

    task = asyncio.create_task(publish_forever())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def ack_pending(js: Any) -> int:
    """The durable's unacknowledged deliveries."""
    return int((await js.consumer_info(STREAM, DURABLE)).num_ack_pending or 0)


def waited(detail: str) -> float:
    """The ``at least N s`` of an anomaly's detail."""
    found = re.search(r"at least (\d+) s", detail)
    assert found is not None, detail
    return float(found.group(1))


async def test_held_row_keeps_a_delivery_unacked_behind_acked_ones_and_it_is_stuck(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The handler of message 1 waits on a row an outside transaction holds; its worker
    renews the lease, and later messages are acked all along. Past 3 AckWaits the audit
    and the status report a stuck delivery at seq 1 that waited at least that long; the
    worker's gauge and its ``delivery.stuck`` log say so too, and clear once the row is
    let go."""
    import prometheus_client
    from structlog.testing import capture_logs

    await heldapp.create_accounts(engine)
    app = make_app(database_url, nats_url)
    registry = prometheus_client.CollectorRegistry()
    labels = {"handler": "ledger", "stream": STREAM}
    with capture_logs() as logs:
        async with running(app, metrics_registry=registry), held_row(engine):
            await publish(js, "hot")
            await wait_for(lambda: _positive(ack_pending(js)), what="message 1 delivered")
            async with acking(js):
                found = await stuck_in_audit(app)
                assert [a.seq for a in found] == [1]
                assert waited(found[0].detail) >= STUCK_AFTER_S
                # The worker's own reading comes within half an AckWait.
                await wait_for(
                    lambda: _true(registry.get_sample_value("eop_stuck_deliveries", labels)),
                    what="the worker's stuck gauge",
                )
                copy = app.with_settings()
                try:
                    [s] = await status.collect(copy)
                finally:
                    await copy.dispose()
            assert s.oldest_unacked_seq == 1
            assert (s.oldest_unacked_s or 0) >= STUCK_AFTER_S  # rounded to 0.1 s
            assert s.stuck_after_s == STUCK_AFTER_S
            [anomaly] = s.anomalies
            assert "seq 1 " in anomaly
            oldest = registry.get_sample_value("eop_oldest_unacked_seconds", labels)
            assert (oldest or 0) > STUCK_AFTER_S
        # The row let go: the message is processed, acked, and the worker says so.
        [event] = [e for e in logs if e["event"] == "delivery.stuck"]
        assert (event["seq"], event["consumer"]) == (1, DURABLE)
        # Past the bound, logged to a tenth of a second: 6.04 s shows as 6.0.
        assert event["waited_s"] >= STUCK_AFTER_S
    assert await scalar(engine, "SELECT n FROM accounts WHERE id = 'hot'") == 1


async def stuck_in_audit(app: eop.App) -> list[audit.Anomaly]:
    """Audit until a stuck delivery shows (a liveness bound, not a timing assertion)."""
    found: list[audit.Anomaly] = []

    async def stuck() -> bool:
        h = (await audit.run(app.with_settings(), ["ledger"])).handlers[0]
        found[:] = [a for a in h.anomalies if a.kind == audit.STUCK_DELIVERY]
        return bool(found)

    await wait_for(stuck, timeout_s=STUCK_AFTER_S + 60, what="a stuck delivery in the audit")
    return found


async def accounts_past(engine: AsyncEngine, count: int) -> bool:
    """Whether the handler has created ``count`` account rows (acked their messages)."""
    return int(await scalar(engine, "SELECT count(*) FROM accounts")) >= count


async def _positive(value: Any) -> bool:
    return bool(await value > 0)


async def _true(value: float | None) -> bool:
    return bool(value)


async def test_held_row_clears_once_let_go(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Once the outside transaction ends, the stuck delivery is acked: the gauge falls to
    0, ``delivery.unstuck`` is logged, and the audit finds nothing stuck."""
    import prometheus_client
    from structlog.testing import capture_logs

    await heldapp.create_accounts(engine)
    app = make_app(database_url, nats_url)
    registry = prometheus_client.CollectorRegistry()
    labels = {"handler": "ledger", "stream": STREAM}
    with capture_logs() as logs:
        async with running(app, metrics_registry=registry):
            async with held_row(engine):
                await publish(js, "hot")
                await wait_for(lambda: _positive(ack_pending(js)), what="message 1 delivered")
                await wait_for(
                    lambda: _true(registry.get_sample_value("eop_stuck_deliveries", labels)),
                    timeout_s=STUCK_AFTER_S + 30,
                    what="the worker's stuck gauge",
                )
            await wait_for(lambda: drained(js, DURABLE), what="message 1 acked")
            await wait_for(
                lambda: _true(registry.get_sample_value("eop_stuck_deliveries", labels) == 0),
                what="the gauge back at 0",
            )
    assert [e["event"] for e in logs if e["event"].startswith("delivery.")] == [
        "delivery.stuck",
        "delivery.unstuck",
    ]
    h = (await audit.run(app.with_settings(), ["ledger"])).handlers[0]
    assert h.clean, h.anomalies
    assert h.settled


async def _locked_out(engine: AsyncEngine) -> bool:
    """Whether some session waits on a row lock (the handler, on the held row)."""
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND datname = current_database()"
    )
    return int(await scalar(engine, query)) > 0


@pytest.mark.timeout(180)
async def test_sigstopped_worker_holding_a_delivery_is_reported_by_the_others(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine, workers: Workers
) -> None:
    """A worker frozen (SIGSTOP) inside message 1's transaction, holding its claim: the
    server redelivers the message to the other worker, which cannot settle it while the
    frozen transaction holds its claim, and acks the later messages. The frozen worker
    reports nothing; the other's watch logs ``delivery.stuck`` with seq 1, and `eop
    audit` and `eop status` exit 1 naming seq 1. Woken (SIGCONT), it drains, message 1
    once."""
    await heldapp.create_accounts(engine)
    env = {"EOP_ACK_WAIT_S": str(ACK_WAIT_S)}
    # Its statement still waits on the held row when it is frozen (and the row let go).
    frozen = workers.start(app=HELD_APP, env={**env, "EOP_LOCK_TIMEOUT_S": "10"})
    await wait_for(lambda: consumer_exists(js, DURABLE), timeout_s=60, what="the consumer")
    async with held_row(engine):
        await publish(js, "hot")
        await wait_for(lambda: _locked_out(engine), what="message 1's handler on the held row")
        frozen.send_signal(signal.SIGSTOP)
    # Let go of the row: the frozen worker's statement takes it, and its transaction,
    # holding the row and message 1's claim, stays open for as long as it is frozen.
    try:
        # Its claim of message 1 gives up soon, so that the batches it came in go on.
        workers.start(app=HELD_APP, env={**env, "EOP_LOCK_TIMEOUT_S": "0.5"})
        async with acking(js):
            # The other worker is up and acks the later messages, all along.
            await wait_for(lambda: accounts_past(engine, 5), timeout_s=60, what="acks flowing")
            found = await stuck_in_audit(make_app(database_url, nats_url))
            assert [a.seq for a in found] == [1]
            acked = int(await scalar(engine, "SELECT count(*) FROM accounts"))
            await wait_for(lambda: accounts_past(engine, acked + 5), what="later messages acked")
            await wait_for(
                lambda: _true("delivery.stuck" in workers.logs()), what="delivery.stuck logged"
            )
            audited = await asyncio.to_thread(run_eop, "audit", HELD_APP, "--json", env=workers.env)
            shown = await asyncio.to_thread(run_eop, "status", HELD_APP, "--json", env=workers.env)
        assert audited.returncode == 1, audited.stdout + audited.stderr
        report = json.loads(audited.stdout)
        stuck = _stuck_in(report)
        assert [a["seq"] for a in stuck] == [1], report
        assert waited(stuck[0]["detail"]) >= STUCK_AFTER_S
        assert shown.returncode == 1, shown.stderr
        [row] = json.loads(shown.stdout)
        assert row["oldest_unacked_seq"] == 1
        assert row["oldest_unacked_s"] >= STUCK_AFTER_S  # rounded to 0.1 s
        assert len(row["anomalies"]) == 1
        assert "stuck_delivery" in shown.stderr
        [line] = [json.loads(x) for x in workers.logs().splitlines() if '"delivery.stuck"' in x]
        assert line["seq"] == 1
        assert line["pid"] != frozen.pid
    finally:
        frozen.send_signal(signal.SIGCONT)
    await wait_for(lambda: drained(js, DURABLE), timeout_s=60, what="everything acked")
    assert await scalar(engine, "SELECT n FROM accounts WHERE id = 'hot'") == 1
    assert workers.stop_all() == [0, 0]


def _stuck_in(report: Any) -> list[dict[str, Any]]:
    """The stuck deliveries of an `eop audit --json` report."""
    found = []
    for h in report["handlers"]:
        found += [a for a in h["anomalies"] if a["kind"] == "stuck_delivery"]
    return found


async def test_floor_record_keeps_a_wait_while_the_floor_stays_and_restarts_it_when_it_moves(
    engine: AsyncEngine,
) -> None:
    """The ack_floors record: a wait begins at the first reading with a delivery above
    the floor, lasts while readings find the same floor, restarts when the floor rises,
    ends when nothing waits; an older reading (a lower floor) changes nothing."""
    from eop.pg import floors, models

    t = models.tables()

    async def read(floor: int, delivered: int, pending: int) -> floors.Observed | None:
        return await floors.observe(
            engine,
            t,
            subscription="ledger",
            stream=STREAM,
            consumer=DURABLE,
            partition=None,
            created=None,
            floor=floor,
            delivered=delivered,
            ack_pending=pending,
        )

    first = await read(5, 7, 2)
    assert first is not None
    assert first.waiting_since is not None
    later = await read(5, 9, 3)
    assert later is not None
    assert (later.waiting_since, later.delivered) == (first.waiting_since, 7)
    assert await read(4, 9, 3) is None
    moved = await read(8, 9, 1)
    assert moved is not None
    assert moved.waiting_since is not None
    assert moved.waiting_since > first.waiting_since
    assert moved.delivered == 9
    idle = await read(9, 9, 0)
    assert idle is not None
    assert idle.waiting_since is None
    assert floors.waited_s(idle, 9, None) is None


async def test_partition_handed_over_at_the_same_floor_keeps_its_wait(
    engine: AsyncEngine,
) -> None:
    """An ordered handler's partition taken over at the same floor: the new consumer's
    record continues the old one's wait (same message, still unacknowledged), and the
    old consumer's record goes."""
    from eop.pg import floors, models

    t = models.tables()

    async def read(consumer: str, floor: int) -> floors.Observed | None:
        return await floors.observe(
            engine,
            t,
            subscription="ledger",
            stream=STREAM,
            consumer=consumer,
            partition=0,
            created=None,
            floor=floor,
            delivered=floor + 1,
            ack_pending=1,
        )

    before = await read("eop-ledger-p0-e1", 10)
    after = await read("eop-ledger-p0-e2", 10)
    assert before is not None
    assert after is not None
    assert after.waiting_since == before.waiting_since
    assert list(await floors.read(engine, t, "ledger", STREAM)) == ["eop-ledger-p0-e2"]
    elsewhere = await read("eop-ledger-p0-e3", 11)
    assert elsewhere is not None
    assert elsewhere.waiting_since != before.waiting_since


async def test_ordered_handlers_stuck_delivery_is_found_on_its_partition(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """An ordered handler (two partitions, a consumer each): the held account's message
    waits while the other keys' messages, on both partitions, are acked. The audit names
    the partition and seq 1; the status shows it on that partition's row."""
    await heldapp.create_accounts(engine)
    app = eop.App(settings=bed_settings(database_url, nats_url, ack_wait_s=ACK_WAIT_S))
    app.stream("ACCTS", subjects=["acct.>"], storage="file")

    @app.handler(
        stream="ACCTS", subject="acct.*", name="ledger", order_by="subject:1", partitions=2
    )
    async def post(msg: eop.Message, session: Any) -> None:
        await session.execute(
            sa.text(
                "INSERT INTO accounts (id, n) VALUES (:id, 1) "
                "ON CONFLICT (id) DO UPDATE SET n = accounts.n + 1"
            ),
            {"id": msg.subject.split(".")[1]},
        )

    async def others() -> None:
        i = 0
        while True:
            await js.publish(f"acct.k{i}", b"")
            i += 1
            await asyncio.sleep(0.2)

    async with running(app), held_row(engine):
        await js.publish("acct.hot", b"")
        await wait_for(lambda: _locked_out(engine), what="message 1's handler on the held row")
        task = asyncio.create_task(others())
        try:
            found = await stuck_in_audit(app)
            copy = app.with_settings()
            try:
                [s] = await status.collect(copy)
            finally:
                await copy.dispose()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert [a.seq for a in found] == [1]
    assert found[0].detail.startswith("partition ")
    assert s.ordered is not None
    [waiting] = [p for p in s.ordered.partitions if p.oldest_unacked_seq == 1]
    assert (waiting.oldest_unacked_s or 0) >= STUCK_AFTER_S  # rounded to 0.1 s
    assert s.oldest_unacked_seq == 1
    assert len(s.anomalies) == 1
    assert await scalar(engine, "SELECT n FROM accounts WHERE id = 'hot'") == 1
