"""The exactly-once sink, the ``eop`` data source, on classic Spark and on Spark Connect.

Every test runs twice (the ``any_spark`` fixture): on the local[2] session in
this process and on a session of a Spark Connect server, whose own Python
workers import eop and the tests' app. The same counts and effects on both:
each good message applied once and never dead-lettered, a poison message
dead-lettered once, a rerun or a replayed micro-batch a no-op.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from eop import cli
from eop.contrib.spark import connect, jobs, sink
from eop.contrib.spark.apply import Counts
from tests.integration.bed import STREAM, create_effects_table, effects_by_body, publish
from tests.spark.connect_server import ConnectServer

from . import sparkapp

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Two Spark sessions' worth of jobs on a shared two-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

HANDLER = "spark_sync"
POISON = {7: "poison-7", 13: "reject-13"}
"""Bodies by stream sequence: the handler always fails on one, rejects the other."""


@pytest.fixture
async def bed_engine(engine: AsyncEngine) -> AsyncEngine:
    """The test database with an effects table."""
    await create_effects_table(engine)
    return engine


def target(database_url: str) -> sink.Target:
    """The sync handler on the test's database; a failing message gets two quick attempts."""
    return sink.Target.create(
        sparkapp.PATH,
        HANDLER,
        database_url=database_url,
        max_attempts=2,
        backoff_base_s=0.001,
        backoff_max_s=0.01,
    )


async def publish_orders(js: Any, first: int, last: int) -> dict[str, int]:
    """Orders ``first..last`` (their stream sequences), the poison ones among them."""
    good = {}
    for seq in range(first, last + 1):
        body = POISON.get(seq, f"order-{seq}")
        await publish(js, body)
        if seq not in POISON:
            good[body] = 1
    return good


async def dead_letters(engine: AsyncEngine) -> list[tuple[int, str]]:
    """(sequence, reason) of every dead letter, by sequence: a job's partitions commit in
    whatever order Spark finishes them (a letter twice still shows twice)."""
    async with engine.connect() as conn:
        query = "SELECT stream_seq, reason FROM eop.dead_letters ORDER BY stream_seq, id"
        return [(int(s), r) for s, r in await conn.execute(sa.text(query))]


EXPECTED_DEAD = [(7, "attempts_exhausted"), (13, "rejected")]


async def test_a_backfill_applies_each_message_once_and_running_it_again_changes_nothing(
    any_spark: SparkSession, database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """df.write.format("eop"): good messages once, the poison and the rejected one
    dead-lettered once, the counts back from the writer's commit; the same job
    again (a retry, a replay) finds every message done."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    good = await publish_orders(js, 1, 20)
    spec = sparkapp.app.handlers[HANDLER]
    read = jobs.ReadOptions(nats_url, per_partition=6)

    def run() -> Counts:
        return jobs.backfill(any_spark, target(database_url), spec, read)

    assert await asyncio.to_thread(run) == Counts(processed=18, dead_lettered=2)
    assert await asyncio.to_thread(run) == Counts(duplicates=20)
    assert await effects_by_body(bed_engine) == good
    assert await dead_letters(bed_engine) == EXPECTED_DEAD


async def test_a_stream_applies_each_message_once_and_a_replayed_micro_batch_is_a_no_op(
    any_spark: SparkSession,
    database_url: str,
    nats_url: str,
    js: Any,
    bed_engine: AsyncEngine,
    tmp_path: Path,
) -> None:
    """writeStream.format("eop") from the jetstream source: each micro-batch's counts reach
    the caller. With the last batch's commit removed from the checkpoint, the restarted
    query writes that batch again: all of it already done; then the new messages."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    good = await publish_orders(js, 1, 25)
    spec = sparkapp.app.handlers[HANDLER]
    read = jobs.ReadOptions(nats_url, max_per_batch=10, per_partition=4)
    checkpoint = tmp_path / "checkpoint"

    async def run() -> list[tuple[int, Counts]]:
        batches: list[tuple[int, Counts]] = []
        query = await asyncio.to_thread(
            jobs.stream,
            any_spark,
            target(database_url),
            spec,
            read,
            checkpoint=str(checkpoint),
            available_now=True,
            on_batch=lambda batch_id, counts: batches.append((batch_id, counts)),
        )
        await asyncio.to_thread(jobs.wait, query)
        return batches

    assert await run() == [
        (0, Counts(processed=9, dead_lettered=1)),
        (1, Counts(processed=9, dead_lettered=1)),
        (2, Counts(processed=5)),
    ]
    for name in ("2", ".2.crc"):
        (checkpoint / "commits" / name).unlink(missing_ok=True)
    good |= await publish_orders(js, 26, 30)
    assert await run() == [(2, Counts(duplicates=5)), (3, Counts(processed=5))]
    assert await effects_by_body(bed_engine) == good
    assert await dead_letters(bed_engine) == EXPECTED_DEAD


async def test_eop_spark_backfill_and_stream_print_the_counts_on_either_kind_of_session(
    any_spark: SparkSession,
    request: pytest.FixtureRequest,
    database_url: str,
    nats_url: str,
    js: Any,
    bed_engine: AsyncEngine,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`eop spark backfill` and `eop spark stream`, with --remote sc://... on Connect (the
    classic run uses this process's session): the counts printed, effects once."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    good = await publish_orders(js, 1, 14)
    common = [sparkapp.PATH, "--handler", HANDLER, "--max-attempts", "1"]
    common += ["--database-url", database_url, "--nats-url", nats_url]
    if connect.is_connect(any_spark):
        server: ConnectServer = request.getfixturevalue("connect_server")
        common += ["--remote", server.url]

    async def eop(*args: str) -> tuple[str, str]:
        status = await asyncio.to_thread(cli.main, ["--log-level", "error", *args])
        out, err = capsys.readouterr()
        assert status == 0, err
        return out, err

    out, _ = await eop("spark", "backfill", *common, "--to-seq", "10")
    assert "backfill of ORDERS for handler spark_sync: 9 processed, 0 already done, " in out
    assert "1 dead-lettered" in out
    stream = ["--checkpoint", str(tmp_path / "checkpoint"), "--available-now"]
    out, err = await eop("spark", "stream", *common, *stream, "--max-per-batch", "7")
    assert "batch 0: 0 processed, 7 already done" in err
    assert "batch 1: 3 processed, 3 already done, 1 dead-lettered" in err
    assert "stopped: 3 processed, 10 already done, 1 dead-lettered" in out
    assert await effects_by_body(bed_engine) == good
    assert await dead_letters(bed_engine) == EXPECTED_DEAD
