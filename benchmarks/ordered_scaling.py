"""Throughput of an I/O-bound ordered handler on 1, 2 and 4 worker processes.

    python benchmarks/ordered_scaling.py [--messages 60000] [--keys 64] [--partitions 16]
        [--commands 1,2,4] [--window-s 15] [--unordered] [--pool-size N] [--traffic]
        [--processes]

Starts its own nats-server and PostgreSQL (the ``embedded`` extra). For each
count N: a fresh stream, ``--messages`` published over ``--keys`` keys, then
N ``eop worker --processes 1`` commands (N pods) of ``benchmarks/ordered_app.py``
(``await asyncio.sleep(0.005)`` per message, ``partitions=--partitions``), at
default settings; with ``--processes``, one ``eop worker --processes N``
command instead (the processes one command starts on a machine, which share
its ``db_connections``: pass ``--pool-size`` for each to have its own).
Start-up is excluded: the window opens once every process owns its share of
the partitions and lasts ``--window-s``. Prints messages/s
over the window, the ratio to N times the one-command figure, and CPU per
message: the workers', PostgreSQL's and nats-server's (psutil, over the window),
the cores all of them used together (on a machine with fewer, the run is bound
by CPU, not by the handler's I/O), and PostgreSQL transactions a message.
``--traffic`` counts the NATS traffic a message with a side subscriber (pull
requests, acks and lease renewals, ``+WPI``); it costs nats-server and the
bench CPU of their own, so it is off unless asked.
``--pool-size N`` sets ``EOP_DB_POOL_SIZE`` (each process's connections, so
its handler concurrency: 16 by default) to run below the machine's cores.
``--unordered`` runs the same handler without ``order_by`` (each command's
default processes then share one consumer): the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats
import psutil
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from eop.pg import migrate
from eop.tools import embedded

ROOT = Path(__file__).resolve().parents[1]
APP = "benchmarks.ordered_app:app"


def start_worker(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """One `eop worker` command of the app (a pod)."""
    return subprocess.Popen([sys.executable, "-m", "eop", "worker", APP], env=env, cwd=ROOT)


def cpu_s(procs: list[psutil.Process]) -> float:
    """User and system CPU seconds of ``procs`` and their children, living ones only."""
    total = 0.0
    for proc in procs:
        for p in [proc, *proc.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
    return total


async def remaining(js: Any, stream: str) -> int:
    """Messages the handler's partition consumers have not acked yet."""
    total = 0
    for info in await js.consumers_info(stream):
        total += int(info.num_pending or 0) + int(info.num_ack_pending or 0)
    return total


async def balanced(engine: AsyncEngine, handler: str, commands: int) -> bool:
    """Whether ``commands`` processes each own their share, every partition with a consumer."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                sa.text(
                    "SELECT owner_pid, count(*) FROM eop.partitions WHERE subscription = :h"
                    " AND consumer IS NOT NULL AND expires_at > now() GROUP BY owner_pid"
                ),
                {"h": handler},
            )
        ).all()
        members = (
            await conn.execute(
                sa.text(
                    "SELECT count(*) FROM eop.members WHERE subscription = :h"
                    " AND expires_at > now()"
                ),
                {"h": handler},
            )
        ).scalar_one()
    counts = [int(n) for _, n in rows]
    return members == commands and len(counts) == commands and max(counts) - min(counts) <= 1


async def count_traffic(nc: Any, counts: dict[str, int]) -> list[Any]:
    """Side subscriptions counting pull requests, acks and lease renewals into ``counts``."""

    async def counted(msg: Any) -> None:
        if msg.subject.startswith("$JS.API.CONSUMER.MSG.NEXT."):
            counts["pull"] += 1
        elif msg.data == b"+WPI":
            counts["wpi"] += 1
        else:
            counts["ack"] += 1

    return [
        await nc.subscribe("$JS.API.CONSUMER.MSG.NEXT.>", cb=counted),
        await nc.subscribe("$JS.ACK.>", cb=counted),
    ]


async def commits(engine: AsyncEngine) -> int:
    """Transactions committed in the database so far (the bench's own included: a few)."""
    async with engine.connect() as conn:
        got = await conn.execute(
            sa.text("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        )
        return int(got.scalar_one())


async def one_run(
    ns: embedded.NatsServer, pg: embedded.PostgresServer, args: argparse.Namespace, n: int
) -> dict[str, float]:
    stream = f"ORDERED{n}X{int(time.time())}"
    handler = f"io-{stream.lower()}"
    nc = await nats.connect(ns.url)
    js = nc.jetstream()
    engine = create_async_engine(pg.url)
    env = dict(
        os.environ,
        EOP_DATABASE_URL=pg.url,
        EOP_NATS_URL=ns.url,
        EOP_LOG_LEVEL="warning",
        EOP_PROCESSES=str(n) if args.processes else "1",
        BENCH_STREAM=stream,
        BENCH_PARTITIONS=str(args.partitions),
        BENCH_UNORDERED="1" if args.unordered else "0",
    )
    if args.pool_size:
        env["EOP_DB_POOL_SIZE"] = str(args.pool_size)
    # The first command creates the stream (with its partition transform); then the backlog.
    procs = [start_worker(env)]
    while True:
        try:
            await js.stream_info(stream)
            break
        except Exception:
            await asyncio.sleep(0.1)
    subject = stream.lower()
    for start in range(0, args.messages, 1000):
        await asyncio.gather(
            *(
                js.publish(f"{subject}.k{i % args.keys}.step", b"x" * 100)
                for i in range(start, min(start + 1000, args.messages))
            )
        )
    if not args.processes:
        procs += [start_worker(env) for _ in range(n - 1)]
    if args.unordered:
        await asyncio.sleep(3)  # every command started and fetching
    else:
        while not await balanced(engine, handler, n):  # noqa: ASYNC110  # polls the database
            await asyncio.sleep(0.2)
    servers = [psutil.Process(ns.pid or 0), psutil.Process(pg.pid or 0)]
    workers = [psutil.Process(p.pid) for p in procs]
    counts = {"pull": 0, "ack": 0, "wpi": 0}
    sides = await count_traffic(nc, counts) if args.traffic else []
    left0, t0 = await remaining(js, stream), time.perf_counter()
    cpu0 = (cpu_s(workers), cpu_s(servers[1:]), cpu_s(servers[:1]))
    xacts0 = await commits(engine)
    await asyncio.sleep(args.window_s)
    left1, t1 = await remaining(js, stream), time.perf_counter()
    cpu1 = (cpu_s(workers), cpu_s(servers[1:]), cpu_s(servers[:1]))
    xacts1 = await commits(engine)
    done = left0 - left1
    for side in sides:
        await side.unsubscribe()
    for p in procs:
        p.terminate()
    for p in procs:
        await asyncio.to_thread(p.wait)
    await nc.close()
    await engine.dispose()
    if left1 == 0:
        print(f"  warning: the backlog ran out within the window (N={n}): raise --messages")
    return {
        "rate": done / (t1 - t0),
        "worker_us": 1e6 * (cpu1[0] - cpu0[0]) / max(done, 1),
        "pg_us": 1e6 * (cpu1[1] - cpu0[1]) / max(done, 1),
        "nats_us": 1e6 * (cpu1[2] - cpu0[2]) / max(done, 1),
        "cores": sum(b - a for a, b in zip(cpu0, cpu1, strict=True)) / (t1 - t0),
        "xacts_per_msg": (xacts1 - xacts0) / max(done, 1),
        **{f"{k}_per_msg": v / max(done, 1) for k, v in counts.items()},
    }


async def main(args: argparse.Namespace) -> None:
    counts = [int(c) for c in args.commands.split(",")]
    with embedded.NatsServer() as ns, embedded.PostgresServer() as pg:
        migrate.upgrade(pg.url)
        results = {n: await one_run(ns, pg, args, n) for n in counts}
    base = results[counts[0]]["rate"] / counts[0]
    kind = "unordered" if args.unordered else "ordered"
    pool = f"EOP_DB_POOL_SIZE={args.pool_size}" if args.pool_size else "default settings"
    form = "processes of one command" if args.processes else "commands of one process"
    print(
        f"{kind} I/O-bound handler: {args.keys} keys, {args.partitions} partitions, "
        f"5 ms a message, {pool}, window {args.window_s} s, {os.cpu_count()} cores; N {form}"
    )
    traffic = "  pulls/msg  acks/msg  +WPI/msg" if args.traffic else ""
    print(
        "       N  msg/s   vs N x one   worker us/msg  pg us/msg  nats us/msg"
        f"  cores used  xacts/msg{traffic}"
    )
    for n, r in results.items():
        counted = (
            f"  {r['pull_per_msg']:>9.2f}  {r['ack_per_msg']:>8.2f}  {r['wpi_per_msg']:>8.2f}"
            if args.traffic
            else ""
        )
        print(
            f"{n:>8}  {r['rate']:>6.0f}  {r['rate'] / (base * n):>10.2f}  "
            f"{r['worker_us']:>13.0f}  {r['pg_us']:>9.0f}  {r['nats_us']:>11.0f}"
            f"  {r['cores']:>10.2f}  {r['xacts_per_msg']:>9.2f}{counted}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=60_000)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--commands", default="1,2,4")
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--unordered", action="store_true")
    parser.add_argument("--pool-size", type=int, default=0)
    parser.add_argument("--traffic", action="store_true")
    parser.add_argument("--processes", action="store_true")
    asyncio.run(main(parser.parse_args()))
