"""A poll's due retries in one transaction (eop.protocol.retry_batch), on JetStream and PostgreSQL.

The handlers park their messages with ``eop.Retry(delay_s=3600)``; the test then makes every
parked message due in one statement, so the retry loop's next poll takes them all at once.
Each run records ``txid_current()``: the transaction it ran in.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop
from eop.broker import jetstream
from eop.pg import retries
from eop.protocol import processor, retry_batch
from eop.types import Outcome

from .bed import (
    STREAM,
    SUBJECT,
    bed_settings,
    create_effects_table,
    drained,
    effects_by_body,
    equals,
    publish,
    record_effect,
    running,
    scalar,
    wait_for,
)

LATER_S = 3600.0
"""A parked retry's delay, ended by :func:`hurry` (never by the clock)."""


def make_app(database_url: str, nats_url: str) -> eop.App:
    """Slots for a whole poll (the fetch loop holds at most ``batch`` of them)."""
    settings = bed_settings(
        database_url, nats_url, concurrency=16, batch=8, max_attempts=3, retry_poll_s=0.2
    )
    app = eop.App(settings=settings)
    app.stream(STREAM, subjects=["ORDERS.>"])
    return app


async def hurry(engine: AsyncEngine) -> None:
    """Make every parked message due now, in one statement."""
    async with engine.begin() as conn:
        await conn.execute(sa.text("UPDATE eop.retries SET due_at = now() WHERE parked"))


async def parked_with(engine: AsyncEngine, failures: int) -> int:
    query = "SELECT count(*) FROM eop.retries WHERE parked AND failures = :n"
    return int(await scalar(engine, query, n=failures))


async def txid(session: AsyncSession) -> int:
    return int((await session.execute(sa.text("SELECT txid_current()"))).scalar_one())


async def test_a_polls_due_retries_settle_in_one_transaction_each_counted_once(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Six parked messages due at once run in one transaction: the two that succeed are
    processed once, the four that fail are counted once each (2); on their next poll, the
    third failure of each dead-letters all four in one transaction, attempts_exhausted."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url)
    runs: dict[int, dict[str, int]] = {}  # attempt -> body -> transaction id

    @app.handler(stream=STREAM, subject=SUBJECT, name="polled")
    async def polled(msg: eop.Message, session: AsyncSession) -> None:
        body = msg.data.decode()
        runs.setdefault(msg.num_delivered, {})[body] = await txid(session)
        await record_effect(session, "polled", msg)
        if msg.num_delivered == 1 or (body.startswith("p") and msg.num_delivered == 2):
            raise eop.Retry("later", delay_s=LATER_S)
        if body.startswith("p"):
            raise RuntimeError("poison")

    bodies = ["p1", "g1", "p2", "p3", "g2", "p4"]
    async with running(app):
        for body in bodies:
            await publish(js, body)
        await wait_for(lambda: equals(parked_with(engine, 1), 6), what="six parked")
        await hurry(engine)
        await wait_for(lambda: equals(parked_with(engine, 2), 4), what="four parked again")
        assert await effects_by_body(engine) == {"g1": 1, "g2": 1}
        await hurry(engine)
        await wait_for(lambda: drained(js, "eop-polled", engine=engine), what="the dead letters")
    assert set(runs[2]) == set(bodies)
    assert len(set(runs[2].values())) == 1  # one transaction for the poll's six runs
    assert set(runs[3]) == {"p1", "p2", "p3", "p4"}
    assert len(set(runs[3].values())) == 1
    assert await effects_by_body(engine) == {"g1": 1, "g2": 1}
    dead = "SELECT count(*) FROM eop.dead_letters WHERE reason = 'attempts_exhausted'"
    assert await scalar(engine, dead) == 4
    assert await scalar(engine, "SELECT count(DISTINCT xmin::text) FROM eop.dead_letters") == 1
    outcomes = "SELECT outcome, count(*) FROM eop.inbox GROUP BY outcome ORDER BY outcome"
    async with engine.connect() as conn:
        assert dict((await conn.execute(sa.text(outcomes))).all()) == {
            "dead_lettered": 4,
            "processed": 2,
        }
    assert await scalar(engine, "SELECT count(*) FROM eop.retries") == 0


async def test_a_deadlock_in_one_parked_run_reruns_the_poll_one_run_per_transaction(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A parked run whose handler deadlocks (40P01) aborts the poll's transaction: each run
    goes again in one of its own. The deadlock is never counted (its message is processed at
    that same attempt, no count left), the failing neighbour is counted once (2), the good
    neighbour takes effect once."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url)
    runs: dict[tuple[str, int], list[int]] = {}  # (body, attempt) -> transaction ids

    @app.handler(stream=STREAM, subject=SUBJECT, name="crossed")
    async def crossed(msg: eop.Message, session: AsyncSession) -> None:
        body = msg.data.decode()
        ran = runs.setdefault((body, msg.num_delivered), [])
        ran.append(await txid(session))
        await record_effect(session, "crossed", msg)
        if msg.num_delivered == 1 or body == "bad":
            raise eop.Retry("later", delay_s=LATER_S)
        if body == "deadlocked" and len(ran) == 1:
            await session.execute(
                sa.text("DO $$ BEGIN RAISE EXCEPTION 'crossed' USING ERRCODE = '40P01'; END $$")
            )

    async with running(app):
        for body in ("good", "deadlocked", "bad"):
            await publish(js, body)
        await wait_for(lambda: equals(parked_with(engine, 1), 3), what="three parked")
        await hurry(engine)
        await wait_for(lambda: equals(parked_with(engine, 2), 1), what="the bad one counted")
        await wait_for(lambda: drained(js, "eop-crossed"), what="the acks")
        await wait_for(lambda: equals(parked_with(engine, 1), 0), what="the others settled")
    # In the poll's transaction, then alone (where the deadlock did not come back).
    first, alone = runs[("deadlocked", 2)]
    assert first != alone
    # Whichever ran in the poll's transaction before the deadlock ran again alone.
    assert all(len(runs[(body, 2)]) in (1, 2) for body in ("good", "bad"))
    assert max(attempt for _, attempt in runs) == 2  # none ran a third time
    assert await effects_by_body(engine) == {"good": 1, "deadlocked": 1}
    assert await scalar(engine, "SELECT failures FROM eop.retries WHERE parked") == 2
    assert await scalar(engine, "SELECT count(*) FROM eop.retries") == 1
    assert await scalar(engine, "SELECT count(*) FROM eop.dead_letters") == 0


@pytest.mark.parametrize("style", ["async", "sync"])
async def test_a_writes_handler_that_reads_through_the_session_keeps_its_savepoints(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine, style: str
) -> None:
    """An eop.Writes handler runs outside a savepoint while it sends nothing; one that asks
    for writes.session (a read) and then fails has its transaction run again, never counted,
    with a savepoint: its failure is counted once, its neighbour commits once, and the write
    its savepoint rolled back never lands. Async and sync handlers alike."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url)
    runs: dict[tuple[str, int], int] = {}
    insert = sa.text("INSERT INTO effects (handler, msg_key, body) VALUES (:h, :k, :b)")
    count = sa.text("SELECT count(*) FROM effects")

    def run(msg: eop.Message, writes: eop.Writes) -> bool:
        """Queue the effect; whether the handler reads through the session, then fails."""
        body = msg.data.decode()
        runs[(body, msg.num_delivered)] = runs.get((body, msg.num_delivered), 0) + 1
        writes.add(insert, {"h": "reader", "k": msg.idempotency_key, "b": body})
        if msg.num_delivered == 1:
            raise eop.Retry("later", delay_s=LATER_S)
        return body == "reads"

    if style == "async":

        @app.handler(stream=STREAM, subject=SUBJECT, name="reader")
        async def reader(msg: eop.Message, writes: eop.Writes) -> None:
            if run(msg, writes):
                await writes.session.execute(count)
                raise RuntimeError("fails after its read")

    else:

        @app.handler(stream=STREAM, subject=SUBJECT, name="reader")
        def sync_reader(msg: eop.Message, writes: eop.Writes) -> None:
            if run(msg, writes):
                writes.session.execute(count)
                raise RuntimeError("fails after its read")

    async with running(app):
        for body in ("reads", "writes"):
            await publish(js, body)
        await wait_for(lambda: equals(parked_with(engine, 1), 2), what="two parked")
        await hurry(engine)
        await wait_for(lambda: equals(parked_with(engine, 2), 1), what="the reader counted")
        await wait_for(lambda: equals(parked_with(engine, 1), 0), what="the writer settled")
    assert await effects_by_body(engine) == {"writes": 1}
    assert await scalar(engine, "SELECT failures FROM eop.retries WHERE parked") == 2
    assert runs[("reads", 2)] >= 2  # outside a savepoint, then inside one
    assert max(attempt for _, attempt in runs) == 2


async def test_a_parked_row_held_for_a_moment_is_waited_for_not_left_to_its_lease(
    database_url: str, nats_url: str, js: Any, nc: Any, engine: AsyncEngine
) -> None:
    """The poll's lock waits for a row another transaction holds (the next poll's take_due
    locks rows for an instant): with SKIP LOCKED its run was left, to wait out its whole
    lease. Once the holder commits, every run of the poll settles in its transaction."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url)

    @app.handler(stream=STREAM, subject=SUBJECT, name="held")
    async def held(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, "held", msg)
        if msg.num_delivered == 1:
            raise eop.Retry("later", delay_s=LATER_S)

    async with running(app):
        for body in ("a", "b", "c"):
            await publish(js, body)
        await wait_for(lambda: equals(parked_with(engine, 1), 3), what="three parked")
    spec = app.handlers["held"]
    store = app.make_store()
    proc = processor.Processor(
        spec=spec, settings=app.settings, store=store, epochs=jetstream.StreamEpochs(nc)
    )
    await hurry(engine)
    parked = await retries.take_due(store, spec, 10, proc.ack_wait_s)
    assert len(parked) == 3
    async with engine.connect() as holder:
        await holder.execute(
            sa.text("SELECT 1 FROM eop.retries WHERE stream_seq = :seq FOR UPDATE"),
            {"seq": parked[1].message.seq},
        )
        running_poll = asyncio.create_task(retry_batch.RetryBatch(proc).run(parked))
        await asyncio.sleep(0.5)
        await holder.commit()
    outcomes = await asyncio.wait_for(running_poll, 30)
    assert outcomes == [Outcome.PROCESSED] * 3
    assert await effects_by_body(engine) == {"a": 1, "b": 1, "c": 1}
    assert await scalar(engine, "SELECT count(*) FROM eop.retries") == 0
