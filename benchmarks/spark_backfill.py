"""Backfill rows/s on Spark next to one `eop worker` process, on the same messages.

    python benchmarks/spark_backfill.py --messages 20000 [--master local[2]]

Starts its own nats-server and PostgreSQL (the `embedded` extra), publishes N
100-byte messages, then runs the same handler (tests.integration.cliapp's
``cli``: one row inserted per message) twice over them, starting from empty
tables each time:

1. one `eop worker` subprocess, timed from its start until its consumer has
   nothing pending and nothing awaiting an ack;
2. the Spark backfill job (:func:`eop.contrib.spark.jobs.backfill`) on a SparkSession
   started beforehand (its start-up reported apart), twice: the first job also
   starts Spark's Python workers; the second shows the steady state.

Prints the rates. With ``--master spark://...`` (a standalone cluster on this
machine, see BENCHMARKS.md) the executors run this interpreter with the
repository on their path; ``--cores-max 1`` and ``2`` give the scaling ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import nats
import sqlalchemy as sa
import worker_throughput  # type: ignore[import-not-found]  # beside this script, on sys.path
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from eop.pg import migrate
from eop.tools import embedded

APP = worker_throughput.APP
ROOT = Path(__file__).resolve().parents[1]
RESET = (
    "TRUNCATE effects, eop.inbox, eop.dead_letters, eop.watermarks",
    "CREATE TABLE IF NOT EXISTS effects (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " handler text NOT NULL, msg_key text NOT NULL, body text NOT NULL)",
)


async def publish(url: str, messages: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name="ORDERS", subjects=["ORDERS.>"])
    payload = b"x" * 100
    for i in range(0, messages, 500):
        await asyncio.gather(
            *(js.publish("ORDERS.created", payload) for _ in range(min(500, messages - i)))
        )
    await nc.close()


async def reset(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(sa.text(RESET[1]))
        await conn.execute(sa.text(RESET[0]))


async def effects(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(sa.text("SELECT count(*) FROM effects"))).scalar() or 0)


async def time_worker(nats_url: str, database_url: str) -> float:
    env = dict(
        os.environ,
        EOP_DATABASE_URL=database_url,
        EOP_NATS_URL=nats_url,
        EOP_LOG_LEVEL="warning",
        CLIAPP_HANDLER_DELAY_S="0",
    )
    nc = await nats.connect(nats_url)
    try:
        return await worker_throughput.time_worker(nc.jetstream(), env)
    finally:
        await nc.close()


def cluster_conf(master: str, cores_max: int | None) -> dict[str, str]:
    """Settings for a cluster on this machine: the executors import the repository's cliapp."""
    conf = {"spark.ui.showConsoleProgress": "false"}
    if not master.startswith("local"):
        os.environ["PYSPARK_PYTHON"] = sys.executable
        conf["spark.executorEnv.PYTHONPATH"] = str(ROOT)
        conf["spark.executorEnv.CLIAPP_HANDLER_DELAY_S"] = "0"
        conf["spark.ui.enabled"] = "false"
    if cores_max is not None:
        conf["spark.cores.max"] = str(cores_max)
    return conf


def time_spark(
    nats_url: str,
    database_url: str,
    master: str,
    per_partition: int,
    reset_tables: Any,
    cores_max: int | None = None,
) -> tuple[float, list[float]]:
    from eop.contrib.spark import jobs, session, sink
    from tests.integration import cliapp

    os.environ["CLIAPP_HANDLER_DELAY_S"] = "0"
    started = time.perf_counter()
    spark = session.build(master, conf=cluster_conf(master, cores_max))
    spark.sparkContext.setLogLevel("ERROR")
    startup = time.perf_counter() - started
    spec = cliapp.app.handlers["cli"]
    target = sink.Target.create(APP, "cli", database_url=database_url, log_level="warning")
    read = jobs.ReadOptions(nats_url, per_partition=per_partition)
    runs = []
    for _ in range(2):
        reset_tables()
        started = time.perf_counter()
        counts = jobs.backfill(spark, target, spec, read)
        runs.append(time.perf_counter() - started)
        print(f"  spark: {counts}")
    spark.stop()
    return startup, runs


async def main(messages: int, master: str, per_partition: int, cores_max: int | None) -> None:
    with embedded.NatsServer() as ns, embedded.PostgresServer() as pg:
        migrate.upgrade(pg.url)
        engine = create_async_engine(pg.url)
        await publish(ns.url, messages)

        await reset(engine)
        worker_s = await time_worker(ns.url, pg.url)
        worker_effects = await effects(engine)

        loop = asyncio.get_running_loop()

        def reset_tables() -> None:
            asyncio.run_coroutine_threadsafe(reset(engine), loop).result()

        startup_s, (cold_s, warm_s) = await asyncio.to_thread(
            time_spark, ns.url, pg.url, master, per_partition, reset_tables, cores_max
        )
        spark_effects = await effects(engine)
        await engine.dispose()
    print(
        f"{messages} messages of 100 bytes, one row inserted per message:\n"
        f"  eop worker (1 process, defaults):   {worker_s:6.2f} s {messages / worker_s:7,.0f} msg/s"
        f"   (process start-up included; {worker_effects} effects)\n"
        f"  eop spark backfill, {master}, first: {cold_s:6.2f} s {messages / cold_s:7,.0f} rows/s"
        f"   (Python workers start; SparkSession start-up {startup_s:.1f} s not included)\n"
        f"  eop spark backfill, {master}, again: {warm_s:6.2f} s {messages / warm_s:7,.0f} rows/s"
        f"   ({spark_effects} effects; {per_partition} messages per partition)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--per-partition", type=int, default=1000)
    parser.add_argument("--cores-max", type=int, help="spark.cores.max: executor cores used")
    args = parser.parse_args()
    asyncio.run(main(args.messages, args.master, args.per_partition, args.cores_max))
