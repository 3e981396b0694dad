"""Instructions per failing parked run, counted by callgrind: a poison flood's retries.

    python benchmarks/retry_instructions.py --database-url postgresql+asyncpg://USER@HOST/DB \\
        [--messages 32] [--short 4] [--long 24] [--per-run]

Runs a fixed workload in-process, twice under ``valgrind --tool=callgrind``:
``--messages`` messages of a handler that always fails are parked (each
fetched delivery fails once, through the real protocol and store), then
``--short`` (then ``--long``) rounds of what the worker's retry loop does with
them: take the due ones (:func:`eop.pg.retries.take_due`) and run them, every
run failing again, counted and parked anew. By default a round's runs go as
the retry loop sends them (one transaction for the poll,
:class:`eop.protocol.retry_batch.RetryBatch`); ``--per-run`` runs each in a
transaction of its own, concurrently (:meth:`Processor.retry_parked`, what the
retry loop did before, and what the batch falls back to). The handler raises
``eop.Retry(delay_s=0)``, a counted failure due again at once, so no round
waits; ``max_attempts`` is high enough that nothing is dead-lettered. Both
callgrind runs pay the same start-up and parking; the difference of their
totals divided by ``(long - short) * messages`` is what one more failing run
costs, in eop's process (PostgreSQL's work is not counted). No NATS: fake
deliveries and epochs.

The database is the caller's (give it one of its own); eop's tables are
migrated into it. Each run uses a fresh handler name and stream, so it never
sees an earlier run's rows. ``--inner N`` runs the workload once, without
valgrind (what each callgrind run executes).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import eop
from eop import log
from eop import settings as settings_mod
from eop.pg import migrate, retries
from eop.pg.store import PostgresStore
from eop.protocol import processor
from eop.runtime import eventloop
from eop.testing import FakeDelivery, FakeEpochs
from eop.types import Outcome


async def _workload(database_url: str, rounds: int, messages: int, per_run: bool) -> None:
    app = eop.App(settings=settings_mod.Settings(database_url=database_url))
    name = f"parked_{uuid.uuid4().hex[:12]}"

    @app.handler(stream="INSTR", subject="instr.>", name=name, max_attempts=1_000_000)
    async def poison(msg: eop.Message, writes: eop.Writes) -> None:
        raise eop.Retry("poison", delay_s=0)

    log.configure(app.settings.log_format, app.settings.log_level)  # as `eop worker` does
    store = PostgresStore(app)
    spec = app.handlers[name]
    stream = f"INSTR_{uuid.uuid4().hex[:12]}"
    proc = processor.Processor(
        spec=spec, settings=app.settings, store=store, epochs=FakeEpochs({stream: "e1"})
    )
    for seq in range(1, messages + 1):
        fetched = FakeDelivery(subject="instr.x", data=b"x" * 100, stream=stream, seq=seq)
        if await proc.handle(fetched, proc.clock()) is not Outcome.RETRY:
            raise SystemExit("a fetched message was not parked")
    for _ in range(rounds):
        parked = await retries.take_due(store, spec, messages, proc.ack_wait_s)
        if len(parked) != messages:
            raise SystemExit(f"{len(parked)} parked messages due, not {messages}")
        if per_run:
            outcomes = list(await asyncio.gather(*(proc.retry_parked(p) for p in parked)))
        else:
            from eop.protocol import retry_batch  # absent before the batched retries

            outcomes = await retry_batch.RetryBatch(proc).run(parked)
        if any(o is not Outcome.RETRY for o in outcomes):
            raise SystemExit(f"unexpected outcomes: {sorted({o.name for o in outcomes})}")
    await app.engine.dispose()


def _callgrind(args: argparse.Namespace, rounds: int, out: Path) -> int:
    command = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        sys.executable,
        __file__,
        "--database-url",
        args.database_url,
        "--messages",
        str(args.messages),
        "--inner",
        str(rounds),
        *(["--per-run"] if args.per_run else []),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"callgrind run failed:\n{done.stderr[-3000:]}")
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise SystemExit(f"no instruction count in callgrind's output:\n{done.stderr[-3000:]}")
    return int(found.group(1))


def main() -> None:
    """Parse the arguments; run the workload (``--inner``) or count it under callgrind."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--messages", type=int, default=32)
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--long", type=int, default=24)
    parser.add_argument("--per-run", action="store_true")
    parser.add_argument("--inner", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--keep", type=Path, default=None, help="keep the long run's profile here")
    args = parser.parse_args()
    if args.inner is not None:
        eventloop.run(  # uvloop, as `eop worker` runs
            _workload(args.database_url, args.inner, args.messages, args.per_run)
        )
        return
    migrate.upgrade(args.database_url.replace("+asyncpg", "+psycopg"))
    asyncio.run(_workload(args.database_url, 1, args.messages, args.per_run))  # warm the tables
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        short = _callgrind(args, args.short, Path(tmp, "short.out"))
        long_out = args.keep or Path(tmp, "long.out")
        long = _callgrind(args, args.long, long_out)
    runs = (args.long - args.short) * args.messages
    print(
        f"{args.short} rounds: {short:,} instructions; {args.long}: {long:,}; "
        f"per failing parked run ({args.messages} a round): {(long - short) / runs:,.0f}; "
        f"{time.monotonic() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
