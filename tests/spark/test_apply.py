"""The sink's per-partition protocol against real PostgreSQL, without Spark.

A partition is run in a thread, as in a Spark task; the same messages run
again stand for a task retry, a speculative copy or a replayed micro-batch.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session

import eop
from eop.contrib.spark.apply import Counts, Partition
from eop.contrib.spark.transaction import SyncPartitionTx
from eop.message import Message
from tests.integration.bed import (
    STREAM,
    SUBJECT,
    create_effects_table,
    debug_logs,
    effects_by_body,
    scalar,
)

from . import sparkapp

pytestmark = pytest.mark.integration


@pytest.fixture
async def bed_engine(engine: AsyncEngine) -> AsyncEngine:
    """The test database with an effects table."""
    await create_effects_table(engine)
    return engine


def make_app(database_url: str) -> eop.App:
    """The Spark test app on the test's database, with quick retries."""
    return sparkapp.app.with_settings(
        database_url=database_url, max_attempts=2, backoff_base_s=0.001, backoff_max_s=0.01
    )


def msg(seq: int, body: str, *, subject: str = SUBJECT, epoch: str = "e1") -> Message:
    """A message of the test stream as the jetstream source delivers it."""
    return Message(
        subscription="",
        subject=subject,
        data=body.encode(),
        headers={},
        stream=STREAM,
        stream_epoch=epoch,
        seq=seq,
        num_delivered=1,
    )


async def run(partition: Partition, messages: list[Message]) -> Counts:
    """Run a partition in a thread, as a Spark task does; the subscription is the handler's."""
    named = [dataclasses.replace(m, subscription=partition.spec.name) for m in messages]
    return await asyncio.to_thread(partition.run, named)


@pytest.mark.parametrize("handler", ["spark_sync", "spark_async"])
async def test_each_message_takes_effect_once_and_a_rerun_skips_them(
    database_url: str, bed_engine: AsyncEngine, handler: str
) -> None:
    """Sync and async handlers: one effect per message; running the partition again is a no-op."""
    app = make_app(database_url)
    partition = Partition(app, app.handlers[handler])
    messages = [msg(i, f"order-{i}") for i in range(1, 6)]
    first = await run(partition, messages)
    again = await run(partition, messages)
    await asyncio.to_thread(partition.close)
    assert (first.processed, first.duplicates) == (5, 0)
    assert (again.processed, again.duplicates) == (0, 5)
    assert await effects_by_body(bed_engine) == {f"order-{i}": 1 for i in range(1, 6)}
    rows = await scalar(
        bed_engine,
        "SELECT count(*) FROM eop.inbox WHERE subscription = :h AND outcome = 'processed'",
        h=handler,
    )
    assert rows == 5


async def test_rejected_and_failing_messages_are_dead_lettered_beside_the_others(
    database_url: str, bed_engine: AsyncEngine
) -> None:
    """Reject: dead letter at once; a failing handler: after max_attempts. The rest commits."""
    app = make_app(database_url)
    partition = Partition(app, app.handlers["spark_sync"])
    messages = [msg(1, "ok-1"), msg(2, "reject-2"), msg(3, "poison-3"), msg(4, "ok-4")]
    counts = await run(partition, messages)
    again = await run(partition, messages)
    assert (counts.processed, counts.dead_lettered) == (2, 2)
    assert again.duplicates == 4
    assert await effects_by_body(bed_engine) == {"ok-1": 1, "ok-4": 1}
    async with bed_engine.connect() as conn:
        dead = dict(
            (await conn.execute(sa.text("SELECT stream_seq, reason FROM eop.dead_letters"))).all()
        )
        outcomes = dict(
            (await conn.execute(sa.text("SELECT stream_seq, outcome FROM eop.inbox"))).all()
        )
        attempts = (
            await conn.execute(sa.text("SELECT delivery_count FROM eop.inbox WHERE stream_seq = 3"))
        ).scalar()
    assert dead == {2: "rejected", 3: "attempts_exhausted"}
    assert outcomes == {1: "processed", 2: "dead_lettered", 3: "dead_lettered", 4: "processed"}
    assert attempts == 2


def conflicting_first_commit(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Make the first partition COMMIT fail with a conflict (it runs again); the list
    returned holds True once it did."""
    first: list[bool] = []
    commit = SyncPartitionTx.commit

    async def conflicting_once(self: SyncPartitionTx) -> None:
        if not first:
            first.append(True)
            raise eop.errors.TransactionConflict()
        await commit(self)

    monkeypatch.setattr(SyncPartitionTx, "commit", conflicting_once)
    return first


async def test_a_dead_letter_is_logged_once_its_partition_committed(
    database_url: str, bed_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition's transaction that fails at COMMIT (a conflict) runs again: its dead
    letter is logged once, by the run that committed it. Logged as each message failed,
    a transaction retried, or a task that failed, told of dead letters that never were."""
    first = conflicting_first_commit(monkeypatch)
    app = make_app(database_url)
    partition = Partition(app, app.handlers["spark_sync"])
    with debug_logs() as logs:
        counts = await run(partition, [msg(1, "ok-1"), msg(2, "reject-2")])
    assert first == [True]
    assert (counts.processed, counts.dead_lettered) == (1, 1)
    lines = [e for e in logs if e["event"] == "message.dead_lettered"]
    assert [(e["seq"], e["reason"]) for e in lines] == [(2, "rejected")]
    assert await scalar(bed_engine, "SELECT count(*) FROM eop.dead_letters") == 1


async def test_a_reused_sequence_is_quarantined_not_skipped(
    database_url: str, bed_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same key, another fingerprint: a dead letter 'sequence_reused'; the handler does not run.
    Its alarm line is logged once, after the partition's COMMIT: a first COMMIT that fails
    (the transaction runs again) tells of none."""
    app = make_app(database_url)
    partition = Partition(app, app.handlers["spark_sync"])
    await run(partition, [msg(1, "first")])
    first = conflicting_first_commit(monkeypatch)
    with debug_logs() as logs:
        counts = await run(partition, [msg(1, "second")])
    assert first == [True]
    assert counts.quarantined == 1
    lines = [e for e in logs if e["event"] == "message.quarantined"]
    assert [(e["seq"], e["alarm"]) for e in lines] == [(1, True)]
    assert await effects_by_body(bed_engine) == {"first": 1}
    reason = await scalar(bed_engine, "SELECT reason FROM eop.dead_letters")
    assert reason == "sequence_reused"


async def test_rows_of_other_subjects_and_repeated_rows_do_not_run_the_handler(
    database_url: str, bed_engine: AsyncEngine
) -> None:
    """A row a worker would not deliver is skipped; a row twice in the partition runs once."""
    app = make_app(database_url)
    partition = Partition(app, app.handlers["spark_sync"])
    counts = await run(
        partition, [msg(1, "a"), msg(2, "other", subject="ORDERS.cancelled"), msg(1, "a")]
    )
    assert counts == Counts(processed=1, duplicates=1, skipped=1)
    assert await effects_by_body(bed_engine) == {"a": 1}


async def test_messages_below_the_watermark_are_skipped_after_compaction(
    database_url: str, bed_engine: AsyncEngine
) -> None:
    """Compaction deleted their inbox rows; the watermark still says they are done."""
    async with bed_engine.begin() as conn:
        await conn.execute(
            sa.text(
                "INSERT INTO eop.watermarks (subscription, stream, stream_epoch, watermark) "
                "VALUES ('spark_sync', :s, 'e1', 10)"
            ),
            {"s": STREAM},
        )
    app = make_app(database_url)
    counts = await run(
        Partition(app, app.handlers["spark_sync"]), [msg(i, f"m{i}") for i in range(8, 13)]
    )
    assert (counts.duplicates, counts.processed) == (3, 2)
    assert await effects_by_body(bed_engine) == {"m11": 1, "m12": 1}


async def test_concurrent_copies_of_a_partition_apply_each_message_once(
    database_url: str, bed_engine: AsyncEngine
) -> None:
    """A speculative task beside the original: the claims make one of them skip each message."""
    app = make_app(database_url)
    messages = [msg(i, f"order-{i}") for i in range(1, 41)]
    partitions = [Partition(app, app.handlers["spark_sync"]) for _ in range(2)]
    one, two = await asyncio.gather(*(run(p, messages) for p in partitions))
    assert one.processed + two.processed == 40
    assert one.duplicates + two.duplicates == 40
    assert await effects_by_body(bed_engine) == {f"order-{i}": 1 for i in range(1, 41)}


async def test_a_batch_handler_failing_on_one_message_still_commits_the_others(
    database_url: str, bed_engine: AsyncEngine
) -> None:
    """batch=True: the handler gets lists; on failure they are run one by one, savepoint each."""
    app = eop.App(
        settings=eop.Settings(database_url=database_url, max_attempts=1, batch=4),
    )
    calls: list[int] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="batched", batch=True)
    def handle(messages: list[eop.Message], session: Session) -> None:
        calls.append(len(messages))
        for m in messages:
            if m.data == b"bad":
                raise ValueError("bad message")
            session.execute(
                sa.text("INSERT INTO effects (handler, msg_key, body) VALUES ('b', :k, :b)"),
                {"k": m.idempotency_key, "b": m.data.decode()},
            )

    messages = [msg(i, "bad" if i == 3 else f"m{i}") for i in range(1, 7)]
    counts = await run(Partition(app, app.handlers["batched"]), messages)
    assert (counts.processed, counts.dead_lettered) == (5, 1)
    assert await effects_by_body(bed_engine) == {f"m{i}": 1 for i in (1, 2, 4, 5, 6)}
    assert max(calls) == 4  # the partition is handed over in lists of at most `batch`


async def test_a_job_forgets_the_members_a_killed_job_left(
    database_url: str, bed_engine: AsyncEngine
) -> None:
    """A killed Spark job of an unordered handler leaves its member row, expired: no
    worker tick forgets it (only an ordered handler's do). The next job's lease forgets
    the expired rows of its handler, not the live ones, nor another handler's."""
    from eop.contrib.spark import lease

    app = make_app(database_url)
    spec = app.handlers["spark_sync"]
    insert = sa.text(
        "INSERT INTO eop.members (subscription, member, host, pid, expires_at) "
        "VALUES (:s, :m, 'h', 1, now() + make_interval(secs => :in_s))"
    )
    async with bed_engine.begin() as conn:
        for subscription, member, in_s in (
            (spec.name, "h:1:spark-dead", -5),
            (spec.name, "h:2:spark-live", 3600),
            ("other", "h:3:spark-dead", -5),
        ):
            await conn.execute(insert, {"s": subscription, "m": member, "in_s": in_s})
    held = lease.JobLease(app, spec)
    await asyncio.to_thread(held.take)
    try:
        async with bed_engine.connect() as conn:
            rows = await conn.execute(sa.text("SELECT subscription, member FROM eop.members"))
            left = set(map(tuple, rows))
        assert left == {
            (spec.name, "h:2:spark-live"),
            (spec.name, held.member),
            ("other", "h:3:spark-dead"),
        }
    finally:
        await asyncio.to_thread(held.give_up)
        await app.dispose()


async def test_a_task_commits_only_while_its_jobs_lease_holds(
    database_url: str, bed_engine: AsyncEngine
) -> None:
    """A partition run under a job's lease commits while the lease holds; once it is given
    up (or ran out) the partition fails with JobLeaseLost and commits nothing. An ordered
    handler's lease holds all its partitions, share-locked by a task until it commits."""
    from eop.contrib.spark import errors, lease

    app = make_app(database_url)
    for name in ("spark_sync", "spark_partitioned"):
        spec = app.handlers[name]
        held = lease.JobLease(app, spec)
        await asyncio.to_thread(held.take)
        partition = Partition(app, spec, lease=held.member)
        subject = "ORDERS.acc1.step" if name == "spark_partitioned" else SUBJECT
        try:
            assert await run(partition, [msg(1, f"{name}-1", subject=subject)]) == Counts(
                processed=1
            )
            await asyncio.to_thread(held.give_up)
            with pytest.raises(errors.JobLeaseLost, match=f"handler '{name}' ran out"):
                await run(partition, [msg(2, f"{name}-2", subject=subject)])
        finally:
            await asyncio.to_thread(partition.close)
    # The partitioned handler writes the subject it was given.
    assert await effects_by_body(bed_engine) == {"spark_sync-1": 1, "ORDERS.acc1.step": 1}
    await app.dispose()
