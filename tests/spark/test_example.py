"""The Spark example runs as its docstring says (on the test session's Spark)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from eop.contrib.spark import jobs, sink
from examples.spark import app as example
from tests.integration.bed import bed_settings, drained, running, scalar, wait_for

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration


async def test_balances_add_up_whether_spark_or_workers_or_both_apply_the_payments(
    spark: SparkSession, database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A backfill, a second backfill and then a worker: every payment counted once. The
    docstring's steps on a fresh server: the example's publish makes the stream."""
    async with engine.begin() as conn:
        await conn.run_sync(example.Base.metadata.create_all)
    await example.publish(600, nats_url)
    spec = example.app.handlers["balances"]
    target = sink.Target.create("examples.spark.app:app", "balances", database_url=database_url)
    read = jobs.ReadOptions(nats_url, per_partition=200)

    first = await asyncio.to_thread(jobs.backfill, spark, target, spec, read)
    again = await asyncio.to_thread(jobs.backfill, spark, target, spec, read)
    app = example.app.with_settings(**vars(bed_settings(database_url, nats_url)))
    async with running(app):
        await wait_for(lambda: drained(js, "eop-balances", "PAYMENTS"), what="the worker")

    assert (first.processed, again.duplicates) == (600, 600)
    assert await scalar(engine, "SELECT sum(cents) FROM balances") == example.expected_total(600)
