"""``python -m eop.tools.bench spark``: backfill rows/s on a Spark cluster beside one worker.

    python -m eop.tools.bench spark [--messages 20000] [--per-partition 1000] [--warm-jobs 2]

On servers of its own (nats-server, PostgreSQL, and a Spark standalone master
with one worker of ``--cores`` cores started from pyspark's jars, see
:mod:`eop.tools.spark_cluster`), it publishes ``--messages`` messages and runs one
handler over those same messages (``eop bench``'s c1 handler: eop.Writes, one
INSERT per message), each run from empty tables:

1. one ``eop worker`` process: ``eop bench``'s run c1, the rate from its first
   commit to its last (start-up excluded);
2. ``eop spark backfill`` as a user runs it against the cluster, all its
   cores: from the command's start to its exit (Python, the SparkSession, the
   executor and its Python workers all start cold);
3. the backfill job (:func:`eop.contrib.spark.jobs.backfill`) in a SparkSession that
   gets 1 executor core (``spark.cores.max``): its first job, then
   ``--warm-jobs`` more (their median is the warm rate);
4. the same with ``--cores`` executor cores.

It prints a table, the warm rate's scaling from 1 to ``--cores`` executor
cores, and the load average before and after: on a machine where other work
runs, or where NATS, PostgreSQL and the driver share the executors' cores, the
figures say little about a real cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from eop import errors
from eop.tools.bench import harness, measurement, report, runs

#: ``eop bench``'s run whose handler and stream every row here uses.
RUN = next(run for run in runs.RUNS if run.key == "c1")
_TABLES = ("bench_effects", "inbox", "dead_letters", "watermarks", "retries")


@dataclasses.dataclass(frozen=True)
class Options:
    """The choices of one ``python -m eop.tools.bench spark``."""

    messages: int = 20_000
    per_partition: int = 1000
    """Stream sequences per Spark task (and per transaction)."""
    warm_jobs: int = 2
    """Jobs after the first in each session; the warm rate is their median."""
    cores: int = 2
    """The cluster worker's cores: the second session's executor cores."""
    fsync: bool = True


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured run: what it was, and how long its messages took."""

    label: str
    seconds: float
    messages: int

    @property
    def rate(self) -> float:
        """Messages (rows) per second."""
        return self.messages / self.seconds


@dataclasses.dataclass
class Report:
    """Everything one bench measured."""

    options: Options
    machine: dict[str, object]
    rows: list[Row] = dataclasses.field(default_factory=list)
    scaling: float = 0.0
    """The warm rate with ``cores`` executor cores over the warm rate with one."""


def run(options: Options) -> Report:
    """Start the servers and the cluster, measure every row, stop them."""
    from eop.tools.spark_cluster import Cluster

    found = Report(options, report.machine())
    with harness.servers(fsync=options.fsync, prefix="eop-bench-spark-") as srv:
        worker = asyncio.run(_worker(options, srv.nats_url, srv.pg_url, srv.tmp, srv.pids))
        label = "one `eop worker` process (first to last commit)"
        found.rows.append(Row(label, options.messages / worker, options.messages))
        with Cluster(srv.tmp / "cluster", cores=options.cores).start() as cluster:
            spark = _Spark(options, srv.nats_url, srv.pg_url, cluster.url)
            found.rows.append(spark.cold_cli())
            for cores in (1, options.cores):
                found.rows += spark.session(cores)
    warm = [row for row in found.rows if row.label.endswith(_WARM)]
    found.scaling = warm[-1].rate / warm[0].rate
    found.machine["load_average_end"] = round(os.getloadavg()[0], 2)
    return found


_WARM = "warm job (median)"


async def _worker(
    options: Options, nats_url: str, database_url: str, tmp: Path, pids: tuple[int | None, ...]
) -> float:
    """``eop bench``'s run c1 (which publishes the messages); its rate."""
    import nats

    # No warm-up backlog: the backfill reads the messages from the stream's first sequence.
    bench_options = runs.Options(
        messages=options.messages, warm_messages=0, latency_s=1.0, runs=RUN.key
    )
    bench = harness.Bench(bench_options, nats_url, database_url, tmp, (pids[0], pids[1]))
    nc = await nats.connect(nats_url)
    try:
        await bench.start(nc)
        result = await measurement.measure(bench, RUN, options.messages, RUN.args.split())
    finally:
        await nc.close()
        await bench.engine.dispose()
    return result.rate


class _Spark:
    """The Spark rows, each from empty tables, on the handler's first ``messages`` sequences."""

    def __init__(self, options: Options, nats_url: str, database_url: str, master: str) -> None:
        self.options = options
        self.nats_url, self.database_url, self.master = nats_url, database_url, master

    def cold_cli(self) -> Row:
        """``eop spark backfill`` in a process of its own, start to exit."""
        argv = [sys.executable, "-m", "eop", "spark", "backfill", "eop.tools.bench:app"]
        argv += ["--handler", RUN.handler, "--master", self.master, "--python", sys.executable]
        argv += ["--to-seq", str(self.options.messages), "--log-level", "warning"]
        argv += ["--messages-per-partition", str(self.options.per_partition)]
        argv += ["--database-url", self.database_url, "--nats-url", self.nats_url]
        argv += ["--conf", f"spark.cores.max={self.options.cores}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EOP_", "PYSPARK_"))}
        env["SPARK_LOCAL_IP"] = "127.0.0.1"
        self._reset()
        started = time.perf_counter()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise errors.EopError(f"eop spark backfill failed: {done.stderr[-2000:]}")
        self._check()
        label = f"cluster, cold CLI run (`eop spark backfill`, {self.options.cores} cores)"
        return Row(label, seconds, self.options.messages)

    def session(self, cores: int) -> list[Row]:
        """A SparkSession with ``cores`` executor cores: its first job, then its warm jobs."""
        from eop.contrib.spark import jobs, session, sink

        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        conf = {"spark.cores.max": str(cores), "spark.ui.enabled": "false"}
        conf["spark.ui.showConsoleProgress"] = "false"
        spark = session.build(self.master, app_name=f"eop-bench-{cores}-cores", conf=conf)
        spark.sparkContext.setLogLevel("ERROR")
        spec = runs.app.handlers[RUN.handler]
        target = sink.Target.create(
            "eop.tools.bench:app", RUN.handler, database_url=self.database_url, log_level="warning"
        )
        read = jobs.ReadOptions(
            self.nats_url, to_seq=self.options.messages, per_partition=self.options.per_partition
        )
        try:
            times = [
                self._timed(lambda: jobs.backfill(spark, target, spec, read))
                for _ in range(1 + self.options.warm_jobs)
            ]
        finally:
            spark.stop()
        name = f"cluster, {cores} executor core{'s' if cores > 1 else ''}"
        n = self.options.messages
        return [
            Row(f"{name}, first job of the session", times[0], n),
            Row(f"{name}, {_WARM}", statistics.median(times[1:]), n),
        ]

    def _timed(self, job: Callable[[], object]) -> float:
        self._reset()
        started = time.perf_counter()
        job()
        seconds = time.perf_counter() - started
        self._check()
        return seconds

    def _reset(self) -> None:
        asyncio.run(_sql(self.database_url, [f"TRUNCATE {', '.join(_qualified())}"]))

    def _check(self) -> None:
        """Every message applied exactly once: one effect row each."""
        query = "SELECT count(*), count(DISTINCT seq) FROM bench_effects"
        (rows, distinct), *_ = asyncio.run(_sql(self.database_url, [query]))
        if not rows == distinct == self.options.messages:
            raise errors.EopError(
                f"{rows} effect rows of {distinct} messages, not one of each of "
                f"{self.options.messages}"
            )


def _qualified() -> list[str]:
    schema = runs.app.settings.schema
    return [_TABLES[0], *(f'"{schema}".{table}' for table in _TABLES[1:])]


async def _sql(database_url: str, statements: Sequence[str]) -> list[tuple[object, ...]]:
    """Run ``statements`` in one transaction; the last one's rows."""
    engine = create_async_engine(database_url)
    try:
        async with engine.begin() as conn:
            rows: list[tuple[object, ...]] = []
            for statement in statements:
                result = await conn.execute(sa.text(statement))
                rows = [tuple(row) for row in result] if result.returns_rows else []
            return rows
    finally:
        await engine.dispose()


def format_report(found: Report) -> str:
    """The table for people, and the scaling ratio."""
    o, m = found.options, found.machine
    worker = found.rows[0].rate
    lines = [
        f"python -m eop.tools.bench spark: {o.messages:,} messages of 100 bytes, handler "
        f"{RUN.handler} (eop.Writes, one INSERT per message), {o.per_partition:,} per Spark "
        f"task; fsync {'on' if o.fsync else 'off'}",
        f"cluster: a standalone master and one worker of {o.cores} cores on this machine; "
        f"machine: {m['cores']} cores ({m['cpu']}), Python {m['python']}; load average "
        f"{m['load_average_start']} -> {m['load_average_end']}",
        "",
        "| run | time | rows/s | vs the worker |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in found.rows:
        lines.append(
            f"| {row.label} | {row.seconds:.1f} s | {row.rate:,.0f} | {row.rate / worker:.2f} |"
        )
    lines += ["", f"scaling of the warm job, 1 -> {o.cores} executor cores: {found.scaling:.2f}x"]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """Parse the flags, run, print the report."""
    defaults = Options()
    parser = argparse.ArgumentParser(
        prog="python -m eop.tools.bench spark", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--messages", type=int, default=defaults.messages)
    parser.add_argument("--per-partition", type=int, default=defaults.per_partition)
    parser.add_argument("--warm-jobs", type=int, default=defaults.warm_jobs)
    parser.add_argument("--cores", type=int, default=defaults.cores)
    parser.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=defaults.fsync)
    args = parser.parse_args(argv)
    if min(args.messages, args.per_partition, args.warm_jobs) < 1 or args.cores < 2:
        parser.error("counts must be at least 1, and --cores at least 2")
    print(format_report(run(Options(**vars(args)))), flush=True)
    return 0
