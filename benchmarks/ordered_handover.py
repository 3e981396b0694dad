"""How long an ordered handler's partition has no owner when its process dies or stops.

    python benchmarks/ordered_handover.py [--rounds 3] [--partitions 4]

Starts its own nats-server and PostgreSQL (the ``embedded`` extra) and two
``eop worker`` commands of ``benchmarks/ordered_app.py`` at default settings
(``partition_lease_s`` 10 s), with messages published all along. Each round
SIGKILLs (then, in the next round, SIGTERMs) the command owning partition 0,
and measures, per partition it owned, the time from the signal until another
process owns it with its consumer created (its messages flow from then on);
then starts a new command and waits for the shares to settle. Prints every
gap and the longest per kind of stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from eop.pg import migrate
from eop.tools import embedded

ROOT = Path(__file__).resolve().parents[1]
APP = "benchmarks.ordered_app:app"
STREAM = "HANDOVER"
HANDLER = f"io-{STREAM.lower()}"


def start_worker(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """One `eop worker` command (a pod)."""
    return subprocess.Popen([sys.executable, "-m", "eop", "worker", APP], env=env, cwd=ROOT)


async def owners(engine: AsyncEngine) -> dict[int, int | None]:
    """Partition -> the pid owning it with a live lease and a consumer (None: nobody)."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                sa.text(
                    "SELECT partition, CASE WHEN expires_at > now() AND consumer IS NOT NULL"
                    " THEN owner_pid END FROM eop.partitions WHERE subscription = :h"
                ),
                {"h": HANDLER},
            )
        ).all()
    return {int(p): (int(o) if o is not None else None) for p, o in rows}


async def settled(engine: AsyncEngine, pids: set[int], partitions: int) -> bool:
    """Every partition owned, by the live commands, in even shares."""
    now = await owners(engine)
    if len(now) != partitions or any(o not in pids for o in now.values()):
        return False
    counts = [list(now.values()).count(pid) for pid in pids]
    return max(counts) - min(counts) <= 1


async def publish_forever(js: Any, stop: asyncio.Event) -> None:
    """About 200 messages a second over 64 keys, until ``stop``."""
    i = 0
    while not stop.is_set():
        with contextlib.suppress(Exception):
            await asyncio.gather(
                *(js.publish(f"{STREAM.lower()}.k{(i + j) % 64}.step", b"x") for j in range(20))
            )
        i += 20
        await asyncio.sleep(0.1)


async def one_round(
    engine: AsyncEngine, procs: list[subprocess.Popen[bytes]], sig: int, env: dict[str, str]
) -> list[float]:
    before = await owners(engine)
    victim = next(p for p in procs if p.pid == before[0])
    held = [n for n, pid in before.items() if pid == victim.pid]
    victim.send_signal(sig)
    signalled = time.monotonic()
    gaps: dict[int, float] = {}
    while len(gaps) < len(held):
        now = await owners(engine)
        for n in held:
            if n not in gaps and now.get(n) not in (None, victim.pid):
                gaps[n] = time.monotonic() - signalled
        await asyncio.sleep(0.05)
    await asyncio.to_thread(victim.wait)
    procs.remove(victim)
    procs.append(start_worker(env))
    return sorted(gaps.values())


async def main(args: argparse.Namespace) -> None:
    with embedded.NatsServer() as ns, embedded.PostgresServer() as pg:
        migrate.upgrade(pg.url)
        engine = create_async_engine(pg.url)
        env = dict(
            os.environ,
            EOP_DATABASE_URL=pg.url,
            EOP_NATS_URL=ns.url,
            EOP_LOG_LEVEL="warning",
            EOP_PROCESSES="1",
            BENCH_STREAM=STREAM,
            BENCH_PARTITIONS=str(args.partitions),
        )
        procs = [start_worker(env), start_worker(env)]
        nc = await nats.connect(ns.url)
        js = nc.jetstream()
        stop = asyncio.Event()
        publishing: asyncio.Task[None] | None = None
        results: dict[str, list[float]] = {"SIGKILL": [], "SIGTERM": []}
        try:
            for r in range(2 * args.rounds):
                while not await settled(engine, {p.pid for p in procs}, args.partitions):  # noqa: ASYNC110  # polls the database
                    await asyncio.sleep(0.2)
                if publishing is None:
                    publishing = asyncio.create_task(publish_forever(js, stop))
                    await asyncio.sleep(1)
                sig = signal.SIGKILL if r % 2 == 0 else signal.SIGTERM
                gaps = await one_round(engine, procs, sig, env)
                results[signal.Signals(sig).name].extend(gaps)
                print(
                    f"round {r + 1}: {signal.Signals(sig).name}, gaps "
                    + ", ".join(f"{g:.2f} s" for g in gaps)
                )
        finally:
            stop.set()
            if publishing is not None:
                await publishing
            for p in procs:
                p.terminate()
            for p in procs:
                await asyncio.to_thread(p.wait)
            await nc.close()
            await engine.dispose()
    for kind, gaps in results.items():
        if gaps:
            print(f"{kind}: longest gap {max(gaps):.2f} s over {len(gaps)} partitions")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
