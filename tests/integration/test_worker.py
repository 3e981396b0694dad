"""The per-message protocol against real JetStream and PostgreSQL, branch by branch."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import sqlalchemy as sa
from nats.js import api
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

import eop

from .bed import (
    STREAM,
    SUBJECT,
    bed_settings,
    create_effects_table,
    drained,
    effects_by_body,
    insert_inbox,
    publish,
    record_effect,
    running,
    scalar,
    wait_for,
)


@pytest.fixture
async def bed_engine(engine: AsyncEngine) -> AsyncEngine:
    """The test database with an effects table."""
    await create_effects_table(engine)
    return engine


def make_app(database_url: str, nats_url: str, **changes: Any) -> eop.App:
    """An app on the test's servers, its stream declared."""
    app = eop.App(settings=bed_settings(database_url, nats_url, **changes))
    app.stream(STREAM, subjects=["ORDERS.>"], storage="file")
    return app


async def test_each_message_takes_effect_once_and_is_acked(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """Happy path: every message gives one effect and one inbox row, and is acked."""
    app = make_app(database_url, nats_url)

    @app.handler(stream=STREAM, subject=SUBJECT, name="billing")
    async def bill(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, "billing", msg)

    async with running(app):
        await wait_for(lambda: drained(js, "eop-billing"), what="the consumer to exist")
        for i in range(20):
            await publish(js, f"order-{i}")
        await wait_for(lambda: drained(js, "eop-billing"), what="all messages acked")
    assert await effects_by_body(bed_engine) == {f"order-{i}": 1 for i in range(20)}
    inbox_rows = await scalar(
        bed_engine, "SELECT count(*) FROM eop.inbox WHERE outcome = 'processed'"
    )
    assert inbox_rows == 20


async def test_sync_handler_runs_in_a_thread_with_a_sync_session(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """A plain def handler gets a sync Session and runs off the event loop's thread."""
    app = make_app(database_url, nats_url)
    threads: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="sync")
    def handle(msg: eop.Message, session: Session) -> None:
        assert isinstance(session, Session)
        threads.append(threading.get_ident())
        session.execute(
            sa.text("INSERT INTO effects (handler, msg_key, body) VALUES ('sync', :k, :b)"),
            {"k": msg.idempotency_key, "b": msg.data.decode()},
        )

    async with running(app):
        for i in range(5):
            await publish(js, f"s{i}")
        await wait_for(lambda: drained(js, "eop-sync"), what="sync handler to finish")
    assert await effects_by_body(bed_engine) == {f"s{i}": 1 for i in range(5)}
    assert threading.get_ident() not in threads


async def test_failing_handler_is_rolled_back_and_redelivered(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """A handler error rolls back its writes, parks the retry, and the retry succeeds once."""
    app = make_app(database_url, nats_url)
    deliveries: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="flaky")
    async def flaky(msg: eop.Message, session: AsyncSession) -> None:
        deliveries.append(msg.num_delivered)
        await record_effect(session, "flaky", msg)
        if msg.num_delivered < 3:
            raise RuntimeError("transient trouble")

    async with running(app):
        await publish(js, "x")
        await wait_for(lambda: drained(js, "eop-flaky", engine=bed_engine), what="the retries")
    assert deliveries == [1, 2, 3]
    assert await effects_by_body(bed_engine) == {"x": 1}


async def test_poison_message_is_dead_lettered_with_its_reason_and_termed(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """Undecodable input: one dead letter (reason, error, payload, redacted headers), no retry."""
    app = make_app(database_url, nats_url)
    calls: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="json")
    async def parse(msg: eop.Message, session: AsyncSession) -> None:
        calls.append(msg.seq)
        msg.json()

    async with running(app):
        await js.publish(
            SUBJECT, b"\xffnot json", headers={"Authorization": "Bearer s3cr3t", "X-Trace": "t1"}
        )
        await wait_for(lambda: drained(js, "eop-json"), what="the dead letter")
    async with bed_engine.connect() as conn:
        row = (
            await conn.execute(
                sa.text("SELECT reason, error, payload, headers, subject FROM eop.dead_letters")
            )
        ).one()
        outcome = (await conn.execute(sa.text("SELECT outcome FROM eop.inbox"))).scalar()
    assert row.reason == "undecodable"
    assert "JSON" in row.error
    assert bytes(row.payload) == b"\xffnot json"
    assert row.headers == {"Authorization": "***", "X-Trace": "t1"}
    assert row.subject == SUBJECT
    assert outcome == "dead_lettered"
    assert calls == [1]


async def test_exhausted_attempts_are_dead_lettered_and_others_not_blocked(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """A message failing every attempt ends as one dead letter; its neighbours take effect."""
    app = make_app(database_url, nats_url, max_attempts=3)
    attempts: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="strict")
    async def strict(msg: eop.Message, session: AsyncSession) -> None:
        if msg.data == b"bad":
            attempts.append(msg.num_delivered)
            raise ValueError("never works")
        await record_effect(session, "strict", msg)

    async with running(app):
        for body in ("a", "bad", "b"):
            await publish(js, body)
        await wait_for(lambda: drained(js, "eop-strict", engine=bed_engine), what="the dead letter")
    # A batch may run a failing handler twice per delivery (see eop.protocol.batch).
    assert sorted(set(attempts)) == [1, 2, 3]
    assert await effects_by_body(bed_engine) == {"a": 1, "b": 1}
    reason = await scalar(bed_engine, "SELECT reason FROM eop.dead_letters")
    assert reason == "attempts_exhausted"


@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])
async def test_serialization_failure_and_deadlock_retry_the_whole_transaction(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine, sqlstate: str
) -> None:
    """40001/40P01 from PostgreSQL: the claim and handler rerun in a new transaction; effect 1."""
    app = make_app(database_url, nats_url)
    runs: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="conflicted")
    async def conflicted(msg: eop.Message, session: AsyncSession) -> None:
        runs.append(msg.num_delivered)
        await record_effect(session, "conflicted", msg)
        if len(runs) == 1:
            await session.execute(
                sa.text(
                    f"DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '{sqlstate}'; END $$"
                )
            )

    async with running(app):
        await publish(js, "c")
        await wait_for(lambda: drained(js, "eop-conflicted"), what="the retry")
    # Both runs belong to the first delivery: retried in process, not redelivered.
    assert runs == [1, 1]
    assert await effects_by_body(bed_engine) == {"c": 1}


async def test_lost_connection_mid_handler_retries_the_transaction(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """The backend is terminated under the handler: the transaction reruns on a new one."""
    app = make_app(database_url, nats_url)
    runs: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="cut")
    async def cut(msg: eop.Message, session: AsyncSession) -> None:
        runs.append(msg.num_delivered)
        await record_effect(session, "cut", msg)
        if len(runs) == 1:
            await session.execute(sa.text("SELECT pg_terminate_backend(pg_backend_pid())"))

    async with running(app):
        await publish(js, "k")
        await wait_for(lambda: drained(js, "eop-cut"), what="the reconnect")
    assert len(runs) == 2
    assert await effects_by_body(bed_engine) == {"k": 1}


async def test_connection_lost_during_commit_is_not_acked_nor_rerun_in_process(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """Ambiguous COMMIT: eop checks the inbox, naks, and the redelivery decides; effect 1."""
    app = make_app(database_url, nats_url)
    runs: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="ambiguous")
    async def ambiguous(msg: eop.Message, session: AsyncSession) -> None:
        runs.append(msg.num_delivered)
        await record_effect(session, "ambiguous", msg)
        if len(runs) == 1:
            pid = (await session.execute(sa.text("SELECT pg_backend_pid()"))).scalar()
            # Kill this backend from outside once the handler has returned, so the
            # connection dies under the COMMIT rather than under a statement.
            asyncio.get_running_loop().call_later(
                0.0, lambda: asyncio.ensure_future(_terminate_later(bed_engine, pid))
            )
            await asyncio.sleep(0.5)

    async with running(app):
        await publish(js, "amb")
        await wait_for(lambda: drained(js, "eop-ambiguous"), what="the redelivery")
    assert runs == [1, 2]
    assert await effects_by_body(bed_engine) == {"amb": 1}


async def _terminate_later(engine: AsyncEngine, pid: int) -> None:
    await asyncio.sleep(0.2)
    async with engine.connect() as conn:
        await conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})


async def test_claim_held_by_another_transaction_times_out_and_naks(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """A concurrent holder of the inbox key: lock_timeout, nak, handler not run until it ends."""
    app = make_app(database_url, nats_url, lock_timeout_s=0.3)
    runs: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="held")
    async def held(msg: eop.Message, session: AsyncSession) -> None:
        runs.append(msg.num_delivered)
        await record_effect(session, "held", msg)

    async with running(app):
        await wait_for(lambda: drained(js, "eop-held"), what="the consumer")
        info = await js.stream_info(STREAM)
        epoch = info.config.metadata["eop_epoch"]
        async with bed_engine.connect() as holder:
            row = {
                "subscription": "held",
                "stream": STREAM,
                "stream_epoch": epoch,
                "stream_seq": 1,
                "fingerprint": b"\x00",
                "outcome": "processed",
                "delivery_count": 1,
            }
            await insert_inbox(holder, [row])
            await publish(js, "h")
            await asyncio.sleep(1.0)
            assert runs == []
            await holder.rollback()
        await wait_for(lambda: drained(js, "eop-held"), what="the redelivery")
    assert runs
    assert runs[0] >= 2
    assert await effects_by_body(bed_engine) == {"h": 1}


async def test_two_deliveries_of_one_message_at_once_commit_once(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """Two workers get the same message at once (lease expired): one commit wins, effect 1.

    The second delivery's claim waits on the inbox key held by the first
    transaction; when the first commits, the second inserts nothing, finds the
    row and acks without running the handler.
    """
    app = make_app(database_url, nats_url, ack_wait_s=60.0, lock_timeout_s=30.0)
    first_started = asyncio.Event()
    release_first = asyncio.Event()
    runs: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="race")
    async def race(msg: eop.Message, session: AsyncSession) -> None:
        runs.append(msg.num_delivered)
        await record_effect(session, "race", msg)
        if msg.num_delivered == 1:
            first_started.set()
            await release_first.wait()

    await js.add_stream(name=STREAM, subjects=["ORDERS.>"], metadata={"eop_epoch": "e1"})
    async with running(app), running(app):
        # A short AckWait on the server and a long one in eop (set behind the bound
        # workers' backs): no renewal rescues the first delivery's lease, so the
        # server hands the message out again.
        await js.add_consumer(
            STREAM,
            api.ConsumerConfig(
                durable_name="eop-race", ack_policy=api.AckPolicy.EXPLICIT, ack_wait=1.0,
                filter_subject=SUBJECT, max_deliver=-1,
            ),
        )  # fmt: skip
        await publish(js, "r")
        await asyncio.wait_for(first_started.wait(), 10)
        await wait_for(lambda: _claim_waiting(bed_engine), what="the second claim to wait")
        release_first.set()
        await wait_for(lambda: drained(js, "eop-race"), what="both deliveries to settle")
    info = await js.consumer_info(STREAM, "eop-race")
    assert info.delivered.consumer_seq >= 2
    assert runs == [1]
    assert await effects_by_body(bed_engine) == {"r": 1}


async def _claim_waiting(engine: AsyncEngine) -> bool:
    """True while some backend waits on a lock (the second delivery's claim)."""
    waiting = await scalar(engine, "SELECT count(*) FROM pg_locks WHERE NOT granted")
    return bool(waiting)


async def _count(items: list[int], n: int) -> bool:
    return len(items) >= n


async def test_heartbeat_keeps_the_lease_of_a_handler_slower_than_ack_wait(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """in_progress() every AckWait/3: a 2.5 s handler under a 1 s AckWait is not redelivered."""
    app = make_app(database_url, nats_url, ack_wait_s=1.0)
    runs: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="slow")
    async def slow(msg: eop.Message, session: AsyncSession) -> None:
        runs.append(msg.num_delivered)
        await asyncio.sleep(2.5)
        await record_effect(session, "slow", msg)

    async with running(app):
        await publish(js, "s")
        await wait_for(lambda: drained(js, "eop-slow"), what="the slow handler")
    assert runs == [1]
    assert await effects_by_body(bed_engine) == {"s": 1}


async def test_republish_after_duplicate_window_is_skipped_by_msg_id(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """The server forgot the Nats-Msg-Id and stored it again: the inbox's msg-id guard skips it."""
    app = make_app(database_url, nats_url)
    app.stream(STREAM, subjects=["ORDERS.>"], duplicate_window_s=0.5)
    runs: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="guard")
    async def guard(msg: eop.Message, session: AsyncSession) -> None:
        runs.append(msg.seq)
        await record_effect(session, "guard", msg)

    async with running(app):
        await wait_for(lambda: drained(js, "eop-guard"), what="the consumer")
        first = await publish(js, "payment", msg_id="pay-1")
        await wait_for(lambda: drained(js, "eop-guard"), what="the first delivery")
        await asyncio.sleep(1.0)
        second = await publish(js, "payment", msg_id="pay-1")
        await wait_for(lambda: drained(js, "eop-guard"), what="the republish")
    assert (first.seq, second.seq, bool(second.duplicate)) == (1, 2, False)
    assert runs == [1]
    assert await effects_by_body(bed_engine) == {"payment": 1}


async def test_recreated_stream_is_a_new_epoch_and_processed(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """Delete and recreate the stream: sequences restart at 1 under a new epoch, nothing skipped."""
    app = make_app(database_url, nats_url)

    @app.handler(stream=STREAM, subject=SUBJECT, name="epoch")
    async def epoch(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, "epoch", msg)

    async with running(app):
        await wait_for(lambda: drained(js, "eop-epoch"), what="the consumer")
        await publish(js, "old")
        # Its effect, not the consumer's counts: right after a publish they may not
        # count the message yet, and the stream would be deleted under it.
        await wait_for(lambda: _has_effect(bed_engine, "old"), what="the old message")
        await wait_for(lambda: drained(js, "eop-epoch"), what="the old message's ack")
        await js.delete_stream(STREAM)
        await wait_for(
            lambda: drained(js, "eop-epoch"), what="the worker to recreate it", timeout_s=30
        )
        await publish(js, "new")
        await wait_for(lambda: drained(js, "eop-epoch"), what="the new message")
    assert await effects_by_body(bed_engine) == {"old": 1, "new": 1}
    # A lane for each epoch: the new incarnation's rows are not the old one's.
    epochs = await scalar(bed_engine, "SELECT count(DISTINCT lane) FROM eop.inbox")
    assert epochs == 2


async def _has_effect(engine: AsyncEngine, body: str) -> bool:
    return (await effects_by_body(engine)).get(body) == 1


async def test_reused_sequence_with_another_fingerprint_is_quarantined(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """Same epoch, same sequence, different message (lost tail): dead letter + alarm, no skip."""
    app = make_app(database_url, nats_url)
    runs: list[str] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="reuse")
    async def reuse(msg: eop.Message, session: AsyncSession) -> None:
        runs.append(msg.data.decode())
        await record_effect(session, "reuse", msg)

    await js.add_stream(name=STREAM, subjects=["ORDERS.>"], metadata={"eop_epoch": "fixed"})
    async with running(app):
        await publish(js, "first")
        await wait_for(lambda: drained(js, "eop-reuse"), what="the first message")
    # The server "loses" its data but keeps the stream's identity.
    await js.delete_stream(STREAM)
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"], metadata={"eop_epoch": "fixed"})
    async with running(app):
        await publish(js, "second")
        await wait_for(lambda: drained(js, "eop-reuse"), what="the quarantine")
    assert runs == ["first"]
    reason = await scalar(bed_engine, "SELECT reason FROM eop.dead_letters WHERE stream_seq = 1")
    assert reason == "sequence_reused"


async def test_graceful_stop_finishes_in_flight_messages(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """stop() while a handler runs: it completes, commits and is acked before the worker exits."""
    app = make_app(database_url, nats_url)
    started = asyncio.Event()

    @app.handler(stream=STREAM, subject=SUBJECT, name="inflight")
    async def inflight(msg: eop.Message, session: AsyncSession) -> None:
        started.set()
        await asyncio.sleep(1.0)
        await record_effect(session, "inflight", msg)

    async with running(app) as worker:
        await publish(js, "f")
        await asyncio.wait_for(started.wait(), 10)
        worker.stop()
    assert await drained(js, "eop-inflight")
    assert await effects_by_body(bed_engine) == {"f": 1}


async def test_deleted_consumer_is_recreated_and_old_messages_skipped(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """A recreated consumer redelivers the whole stream: the inbox skips what was processed."""
    app = make_app(database_url, nats_url)
    runs: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="again")
    async def again(msg: eop.Message, session: AsyncSession) -> None:
        runs.append(msg.seq)
        await record_effect(session, "again", msg)

    async with running(app):
        for i in range(5):
            await publish(js, f"m{i}")
        await wait_for(lambda: drained(js, "eop-again"), what="the first pass")
    await js.delete_consumer(STREAM, "eop-again")
    async with running(app):
        await publish(js, "m5")
        await wait_for(lambda: drained(js, "eop-again"), what="the second pass")
    assert sorted(runs) == [1, 2, 3, 4, 5, 6]
    assert await effects_by_body(bed_engine) == {f"m{i}": 1 for i in range(6)}


async def test_stream_recreated_under_a_running_worker_is_not_mistaken_for_the_old_one(
    database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """Recreated stream and consumer, same payload at the same sequence: a new message.

    The worker's fetch never fails (its consumer is back at once), so only the
    message's store time tells that it belongs to a new epoch.
    """
    app = make_app(database_url, nats_url)

    @app.handler(stream=STREAM, subject=SUBJECT, name="reborn")
    async def reborn(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, "reborn", msg)

    consumer = api.ConsumerConfig(
        durable_name="eop-reborn", ack_policy=api.AckPolicy.EXPLICIT, ack_wait=5.0,
        filter_subject=SUBJECT, max_deliver=-1,
    )  # fmt: skip
    async with running(app):
        first = await publish(js, "same")
        await wait_for(lambda: drained(js, "eop-reborn"), what="the first message")
        await js.delete_stream(STREAM)
        await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
        await js.add_consumer(STREAM, consumer)
        second = await publish(js, "same")

        async def both_applied() -> bool:
            return (await effects_by_body(bed_engine)).get("same") == 2

        # Not drained(): a consumer created a moment ago may still read 0 pending.
        await wait_for(both_applied, what="the second message to take effect")
        await wait_for(lambda: drained(js, "eop-reborn"), what="the second message's ack")
    assert first.seq == second.seq == 1
    assert await effects_by_body(bed_engine) == {"same": 2}
