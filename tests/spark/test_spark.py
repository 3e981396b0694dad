"""The jetstream source and the exactly-once sink on a local[2] Spark.

One SparkSession serves the whole test session (see conftest.py); Spark calls
run in a thread so that the test's event loop (and a live worker on it) goes on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from eop import cli
from eop.contrib.spark import errors, jobs, sink
from eop.contrib.spark.apply import Counts
from eop.message import Message
from tests.integration.bed import (
    STREAM,
    SUBJECT,
    bed_settings,
    create_effects_table,
    drained,
    effects_by_body,
    publish,
    running,
    wait_for,
)

from . import sparkapp

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
HANDLER = "spark_sync"


@pytest.fixture
async def bed_engine(engine: AsyncEngine) -> AsyncEngine:
    """The test database with an effects table."""
    await create_effects_table(engine)
    return engine


def target(database_url: str) -> sink.Target:
    """The Spark test app's sync handler on the test's database."""
    return sink.Target.create(sparkapp.PATH, HANDLER, database_url=database_url)


async def backfill(spark: SparkSession, database_url: str, nats_url: str, **read: Any) -> Counts:
    """`eop spark backfill`'s job, in a thread."""
    spec = sparkapp.app.handlers[HANDLER]
    options = jobs.ReadOptions(nats_url, **read)
    return await asyncio.to_thread(jobs.backfill, spark, target(database_url), spec, options)


async def snapshot(engine: AsyncEngine) -> tuple[Any, ...]:
    """Everything the handler and eop wrote."""
    async with engine.connect() as conn:
        queries = (
            "SELECT id, msg_key, body FROM effects ORDER BY id",
            "SELECT stream_seq, fingerprint, outcome, processed_at FROM eop.inbox ORDER BY 1",
            "SELECT id, stream_seq, reason FROM eop.dead_letters ORDER BY id",
        )
        found = []
        for query in queries:
            found.append([tuple(row) for row in await conn.execute(sa.text(query))])
        return tuple(found)


async def test_a_batch_backfill_equals_the_stream(
    spark: SparkSession, database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """The source reads every stored message; the sink applies each of the handler's once."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    for i in range(1, 31):
        await publish(js, f"order-{i}", msg_id=f"id-{i}" if i % 2 else None)
    for i in range(3):
        await publish(js, f"cancel-{i}", subject="ORDERS.cancelled")
    await js.delete_msg(STREAM, 4)  # a gap
    stored = [await js.get_msg(STREAM, seq) for seq in range(1, 34) if seq != 4]

    df = (
        spark.read.format("jetstream")
        .options(stream=STREAM, natsUrl=nats_url, messagesPerPartition="7")
        .load()
    )
    rows = await asyncio.to_thread(df.collect)
    assert [(r.seq, r.subject, r.data, r.msg_id) for r in rows] == [
        (m.seq, m.subject, m.data, (m.headers or {}).get("Nats-Msg-Id")) for m in stored
    ]

    counts = await backfill(spark, database_url, nats_url, per_partition=7)
    assert counts == Counts(processed=29)
    assert await effects_by_body(bed_engine) == {f"order-{i}": 1 for i in range(1, 31) if i != 4}
    async with bed_engine.connect() as conn:
        fingerprints = dict(
            (await conn.execute(sa.text("SELECT stream_seq, fingerprint FROM eop.inbox"))).all()
        )
    epoch = rows[0].epoch
    assert fingerprints == {
        m.seq: Message(
            HANDLER, m.subject, m.data, dict(m.headers or {}), STREAM, epoch, m.seq, 1
        ).fingerprint
        for m in stored
        if m.subject == "ORDERS.created"
    }


async def test_a_first_job_makes_its_handlers_lane_before_any_task_runs(
    spark: SparkSession, database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """The handler's watermark row (its lane) of the stream's epoch is made and committed
    by the job's driver, before any task: tasks of a first job each made it in their own
    transaction, the first held it while it retried a failing message in place, and the
    others' claims waited on it past their lock timeout until the job failed. Here the
    stream holds nothing of the handler's subject, so no task runs at all, and the lane is
    there; then a first job over a poison message and the orders after it applies each."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    await publish(js, "cancel-0", subject="ORDERS.cancelled")
    lanes = sa.text(
        "SELECT stream, count(*) FROM eop.watermarks WHERE subscription = :s GROUP BY stream"
    )
    assert await backfill(spark, database_url, nats_url) == Counts()
    async with bed_engine.connect() as conn:
        assert (await conn.execute(lanes, {"s": HANDLER})).all() == [(STREAM, 1)]
    await publish(js, "poison-0")
    for i in range(12):
        await publish(js, f"order-{i}")
    counts = await backfill(spark, database_url, nats_url, per_partition=3)
    assert (counts.processed, counts.dead_lettered) == (12, 1)
    assert await effects_by_body(bed_engine) == {f"order-{i}": 1 for i in range(12)}


async def test_a_backfill_over_what_live_workers_processed_changes_nothing(
    spark: SparkSession, database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """Same inbox key, same fingerprint: every message is skipped, dead letters included.

    And a backfill running beside a live worker on new messages: each applied once.
    """
    app = sparkapp.app.with_settings(**vars(bed_settings(database_url, nats_url)))
    async with running(app, handlers=[HANDLER]):
        for i in range(20):
            await publish(js, f"order-{i}")
        await publish(js, "reject-me")
        await wait_for(lambda: drained(js, f"eop-{HANDLER}"), what="the worker to drain")
    before = await snapshot(bed_engine)
    assert len(before[0]) == 20
    assert len(before[2]) == 1

    counts = await backfill(spark, database_url, nats_url)
    assert counts == Counts(duplicates=21)
    assert await snapshot(bed_engine) == before

    async with running(app, handlers=[HANDLER]):
        for i in range(20, 220):
            await publish(js, f"order-{i}")
        overlap = await backfill(spark, database_url, nats_url, per_partition=50)
        await wait_for(lambda: drained(js, f"eop-{HANDLER}"), what="the worker to drain")
    assert overlap.processed + overlap.duplicates == 221
    assert await effects_by_body(bed_engine) == {f"order-{i}": 1 for i in range(220)}


async def test_an_ordered_handler_applies_each_keys_messages_in_stream_order(
    spark: SparkSession, database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """order_by: a key's messages land in one partition, sorted by sequence, whatever the ranges."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    for i in range(60):
        await js.publish(SUBJECT, f"m{i}".encode(), headers={"X-Account": f"a{i % 3}"})
    spec = sparkapp.app.handlers["spark_ordered"]
    target = sink.Target.create(sparkapp.PATH, spec.name, database_url=database_url)
    read = jobs.ReadOptions(nats_url, per_partition=7)
    counts = await asyncio.to_thread(jobs.backfill, spark, target, spec, read)
    assert counts.processed == 60
    async with bed_engine.connect() as conn:
        keys = [
            k for (k,) in await conn.execute(sa.text("SELECT msg_key FROM effects ORDER BY id"))
        ]
    for account in ("a0", "a1", "a2"):
        seqs = [int(k.split(":")[1]) for k in keys if k.startswith(f"{account}:")]
        assert seqs == sorted(seqs)
        assert len(seqs) == 20


async def test_a_range_that_retention_removed_fails_the_backfill_loudly(
    spark: SparkSession, database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """Asking for sequences the stream dropped is an error naming them, not a short backfill."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"], max_msgs=5)
    for i in range(10):
        await publish(js, f"order-{i}")
    with pytest.raises(errors.SparkJobFailed, match=r"no longer holds sequences 1\.\.5"):
        await backfill(spark, database_url, nats_url, from_seq=1)
    assert await effects_by_body(bed_engine) == {}


async def test_a_stream_killed_between_its_sink_and_spark_commit_applies_each_message_once(
    spark: SparkSession,
    database_url: str,
    nats_url: str,
    js: Any,
    bed_engine: AsyncEngine,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The sink committed micro-batch 0, then the driver was SIGKILLed before Spark did.
    Restarted (`eop spark stream --available-now`), Spark replays batch 0, whose rows the
    inbox skips, and goes on: every message applied once. The counts the dead run's commit
    left under the checkpoint are reported by the restart: 30 processed in all."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    for i in range(1, 31):
        await publish(js, f"order-{i}")
    checkpoint = tmp_path / "checkpoint"
    driver = [sys.executable, "-m", "tests.spark.crash_driver", nats_url, database_url]
    crashed = await asyncio.to_thread(
        subprocess.run,
        [*driver, str(checkpoint), "10"],
        cwd=ROOT,
        env=dict(os.environ, EOP_LOG_LEVEL="warning"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    assert (checkpoint / "offsets" / "0").exists()
    assert not (checkpoint / "commits" / "0").exists()
    assert await effects_by_body(bed_engine) == {f"order-{i}": 1 for i in range(1, 11)}

    # The command in this process, so that it uses the test session's Spark.
    args = ["spark", "stream", sparkapp.PATH, "--handler", HANDLER, "--available-now"]
    args += ["--checkpoint", str(checkpoint), "--max-per-batch", "10"]
    args += ["--database-url", database_url, "--nats-url", nats_url]
    status = await asyncio.to_thread(cli.main, ["--log-level", "warning", *args])
    out, err = capsys.readouterr()
    assert status == 0, err
    # The dead run's report first, then (unless it committed before that was read) the
    # replay's; either way every message counts as processed once.
    assert "batch 0: 10 processed, 0 already done" in err
    assert "stopped: 30 processed, " in out
    assert await effects_by_body(bed_engine) == {f"order-{i}": 1 for i in range(1, 31)}


async def test_eop_spark_backfill_runs_a_range_and_reports_what_it_did(
    spark: SparkSession,
    database_url: str,
    nats_url: str,
    js: Any,
    bed_engine: AsyncEngine,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--from-seq/--to-seq bound the backfill (inclusive); the counts are printed at the end."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    for i in range(1, 11):
        await publish(js, "reject-me" if i == 5 else f"order-{i}")
    args = ["spark", "backfill", sparkapp.PATH, "--handler", HANDLER]
    args += ["--from-seq", "3", "--to-seq", "6", "--messages-per-partition", "2"]
    args += ["--database-url", database_url, "--nats-url", nats_url]
    status = await asyncio.to_thread(cli.main, ["--log-level", "error", *args])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "3 processed, 0 already done, 1 dead-lettered" in out
    assert await effects_by_body(bed_engine) == {"order-3": 1, "order-4": 1, "order-6": 1}
