"""eop default's latency and messages a transaction at steady publish rates.

    python benchmarks/steady_latency.py [--rates 300,1000,3000,10000] [--seconds 4]

``eop bench`` measures latency at half of each consumer's own drain rate.
This runs one default ``eop worker`` (the bench's ``eop.Writes`` handler, its
default process count) on embedded servers and, for each rate, publishes at
that rate for ``--seconds``, then prints the messages published, PostgreSQL's
commits meanwhile (``pg_stat_database.xact_commit``, eop's few own
transactions included), the messages a commit, and the p50 and p99 of each
message's time from its store in the stream to its transaction's commit
(``pg_xact_commit_timestamp``), and the CPU a message of the worker (its
processes), the nats-server and PostgreSQL (every backend) over the phase. A
worker that runs many transactions of a few messages under a moderate load
shows it here: few messages a commit, each batch paying its own round trips,
and a latency that grows with the rate as those round trips fill the machine
(BENCHMARKS.md, "What a message costs at a steady rate").
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import eop
from eop.pg import migrate
from eop.tools import embedded
from eop.tools.bench import procstat, runs

_RUN = next(run for run in runs.RUNS if run.key == "c")
_WARM = 5_000
_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_effects (variant text NOT NULL, seq bigint NOT NULL,"
    " stored_at timestamptz NOT NULL)"
)
_COMMITS = sa.text("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
_LATENCY = sa.text(
    "SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY"
    " extract(epoch FROM pg_xact_commit_timestamp(xmin)) - extract(epoch FROM stored_at))"
    " FROM bench_effects WHERE variant = :v AND seq > :after"
)


async def _commits(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(_COMMITS)).scalar_one())


async def _latency_s(engine: AsyncEngine, after: int) -> tuple[float, float]:
    """The p50 and p99 of store-to-commit time of the messages after ``after``."""
    async with engine.connect() as conn:
        p50, p99 = (await conn.execute(_LATENCY, {"v": _RUN.handler, "after": after})).scalar_one()
    return float(p50), float(p99)


async def _publish(js: Any, count: int, rate: float | None) -> int:
    """Publish ``count`` messages (at ``rate`` a second; None: at once); how many."""
    started, sent = time.monotonic(), 0
    while sent < count:
        due = count if rate is None else min(count, int((time.monotonic() - started) * rate))
        while sent < due:
            await js.publish_async(_RUN.subject, b"x" * 100)
            sent += 1
        await asyncio.sleep(0.001)
    await js.publish_async_completed()
    return sent


def _cpu_s(pids: tuple[int | None, ...]) -> list[float]:
    """CPU seconds so far of each of ``pids`` with its children (0 when unknown)."""
    stats = procstat.snapshot()
    return [procstat.tree_cpu_s(pid, stats) or 0.0 for pid in pids]


async def _measure(
    nats_url: str,
    database_url: str,
    rates: list[float],
    seconds: float,
    pids: tuple[int | None, ...],
) -> None:
    engine = create_async_engine(database_url)
    async with engine.begin() as conn:
        await conn.execute(sa.text(_DDL))
    nc = await nats.connect(nats_url)
    js = nc.jetstream(publish_async_max_pending=2_000)
    try:
        await asyncio.sleep(5)  # the worker binds and creates the stream
        published = await _publish(js, _WARM, None)
        await asyncio.sleep(3)
        for rate in rates:
            before = await _commits(engine)
            cpu_before = _cpu_s(pids)
            count = await _publish(js, int(rate * seconds), rate)
            cpu = [b - a for a, b in zip(cpu_before, _cpu_s(pids), strict=True)]
            await asyncio.sleep(2)  # the last messages committed
            commits = await _commits(engine) - before
            p50, p99 = await _latency_s(engine, published)
            published += count
            print(
                f"{rate:>8,.0f} msg/s: {count:>7,} messages, {commits:>6,} commits,"
                f" {count / max(commits, 1):5.1f} a commit, p50 {p50 * 1000:6.1f} ms,"
                f" p99 {p99 * 1000:6.1f} ms; CPU us a message: worker {cpu[0] / count * 1e6:5.0f},"
                f" nats {cpu[1] / count * 1e6:5.0f}, pg {cpu[2] / count * 1e6:5.0f}",
                flush=True,
            )
    finally:
        await nc.close()
        await engine.dispose()


def main() -> None:
    """Measure each rate in turn on one worker and one pair of embedded servers."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rates", default="300,1000,3000,10000")
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    rates = [float(rate) for rate in args.rates.split(",")]
    settings = {"track_commit_timestamp": "on"}
    with embedded.NatsServer() as nats_server, embedded.PostgresServer(settings=settings) as pg:
        migrate.upgrade(pg.url)
        argv = [sys.executable, "-m", "eop", "worker", "eop.tools.bench:app", "--handler"]
        argv += [_RUN.handler, "--database-url", pg.url, "--nats-url", nats_server.url]
        # `python -m` puts the working directory first on the path: started from the
        # directory that holds the eop this script imported, the worker runs the same code.
        here = Path(eop.__file__).resolve().parents[1]
        worker = subprocess.Popen([*argv, "--log-level", "warning"], cwd=here)
        try:
            pids = (worker.pid, nats_server.pid, pg.pid)
            asyncio.run(_measure(nats_server.url, pg.url, rates, args.seconds, pids))
        finally:
            worker.terminate()
            worker.wait(60)


if __name__ == "__main__":
    main()
