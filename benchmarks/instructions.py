"""Instructions per batch transaction of an ``eop.Writes`` handler, counted by callgrind.

    python benchmarks/instructions.py --database-url postgresql+asyncpg://USER@HOST/DB \\
        [--messages 64] [--short 10] [--long 90] [--outbox]

Runs a fixed workload in-process, twice under ``valgrind --tool=callgrind``:
``--short`` then ``--long`` batch transactions, each of ``--messages``
messages of one ``eop.Writes`` handler (one queued INSERT each, the
``eop bench`` handler's), through the real protocol and store
(``BatchProcessor.handle_batch`` on a ``PostgresStore``: claim, handlers,
writes, COMMIT), with fake deliveries and epochs (no NATS). Both runs pay the
same start-up and warm-up; the difference of their totals divided by
``long - short`` is what one more transaction costs, start-up excluded. The
load of the machine does not change the count (a wall clock would move with
it). Prints instructions per transaction and per message.

The database is the caller's (give it one of its own); eop's tables are
migrated into it and a table ``instr_effects`` is created there. Each run uses
a fresh stream name, so its claims never collide with an earlier run's.
``--outbox`` also adds one outbox row per message (``eop.outbox.add``);
``--store-only`` drives the store alone, as the batch path does (claim,
handlers, flush, COMMIT: no acks, no epochs, no logging of outcomes).
``--inner N`` runs the workload once, without valgrind (what each
callgrind run executes).
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

import sqlalchemy as sa

import eop
from eop import log, message
from eop import settings as settings_mod
from eop.handler import HandlerSpec
from eop.pg import migrate, models
from eop.pg.store import PostgresStore
from eop.protocol import batch, processor
from eop.runtime import eventloop
from eop.testing import FakeDelivery, FakeEpochs
from eop.types import Outcome

INSERT = sa.text("INSERT INTO instr_effects (variant, seq, stored_at) VALUES (:v, :s, :t)")
_DDL = (
    "CREATE TABLE IF NOT EXISTS instr_effects (variant text NOT NULL, seq bigint NOT NULL,"
    " stored_at timestamptz)"
)


def _app(database_url: str, outbox: bool) -> eop.App:
    app = eop.App(settings=settings_mod.Settings(database_url=database_url))

    @app.handler(stream="INSTR", subject="instr.>", name="instr")
    async def record(msg: eop.Message, writes: eop.Writes) -> None:
        writes.add(INSERT, {"v": msg.subscription, "s": msg.seq, "t": msg.timestamp})
        if outbox:
            eop.outbox.add(writes, "instr.out", msg.data)

    return app


async def _workload(
    database_url: str, transactions: int, messages: int, outbox: bool, store_only: bool
) -> None:
    app = _app(database_url, outbox)
    log.configure(app.settings.log_format, app.settings.log_level)  # as `eop worker` does
    async with app.engine.begin() as conn:
        await conn.execute(sa.text(_DDL))
    store = PostgresStore(app)
    spec = app.handlers["instr"]
    stream = f"INSTR_{uuid.uuid4().hex[:12]}"
    single = processor.Processor(
        spec=spec, settings=app.settings, store=store, epochs=FakeEpochs({stream: "e1"})
    )
    runner = batch.BatchProcessor(single)
    seq = 0
    for _ in range(transactions):
        deliveries = []
        for _ in range(messages):
            seq += 1
            deliveries.append(
                FakeDelivery(subject="instr.x", data=b"x" * 100, stream=stream, seq=seq)
            )
        if store_only:
            await _store_transaction(store, spec, stream, deliveries)
            continue
        outcomes = await runner.handle_batch(deliveries, single.clock())
        if len(outcomes) != messages or any(o is not Outcome.PROCESSED for o in outcomes):
            raise SystemExit(f"unexpected outcomes: {sorted({o.name for o in outcomes})}")
    await app.engine.dispose()


async def _store_transaction(
    store: PostgresStore, spec: HandlerSpec, stream: str, deliveries: list[FakeDelivery]
) -> None:
    """What the batch path asks of the store for a batch (``--store-only``): no protocol."""
    msgs = [message.from_nats(d, subscription=spec.name, stream_epoch="e1") for d in deliveries]
    async with store.transaction(spec) as tx:
        claimed = await tx.claim_many(msgs, models.OUTCOME_PROCESSED)
        if len(claimed) != len(msgs):
            raise SystemExit("a claim was refused")
        for msg in msgs:
            await tx.run(msg, flush=False)
        await tx.flush()
        await tx.commit()


def _callgrind(args: argparse.Namespace, transactions: int, out: Path) -> int:
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
        str(transactions),
        *(["--outbox"] if args.outbox else []),
        *(["--store-only"] if args.store_only else []),
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
    parser.add_argument("--messages", type=int, default=64)
    parser.add_argument("--short", type=int, default=10)
    parser.add_argument("--long", type=int, default=90)
    parser.add_argument("--outbox", action="store_true")
    parser.add_argument("--store-only", action="store_true")
    parser.add_argument("--inner", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--keep", type=Path, default=None, help="keep the long run's profile here")
    args = parser.parse_args()
    if args.inner is not None:
        eventloop.run(  # uvloop, as `eop worker` runs
            _workload(args.database_url, args.inner, args.messages, args.outbox, args.store_only)
        )
        return
    migrate.upgrade(args.database_url.replace("+asyncpg", "+psycopg"))
    asyncio.run(_workload(args.database_url, 1, args.messages, args.outbox, False))  # tables
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        short = _callgrind(args, args.short, Path(tmp, "short.out"))
        long_out = args.keep or Path(tmp, "long.out")
        long = _callgrind(args, args.long, long_out)
    per_tx = (long - short) / (args.long - args.short)
    print(
        f"{args.short} transactions: {short:,} instructions; {args.long}: {long:,}; "
        f"per transaction of {args.messages} messages: {per_tx:,.0f} "
        f"({per_tx / args.messages:,.0f} a message); {time.monotonic() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
