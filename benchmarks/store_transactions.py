"""A fixed workload for instruction counts: N batch transactions of 64 messages through the store.

    python benchmarks/store_transactions.py URL setup
    python benchmarks/store_transactions.py URL KIND N

Each transaction is what a batch runs (eop.protocol.batch): open, the claim,
each message's handler with ``flush=False``, one flush, COMMIT, close, on
``PostgresStore`` against the database of URL (an asyncpg URL of a database of
your own: ``setup`` migrates it and makes the handlers' tables). No NATS. KIND
is the handler: ``s`` the bench's sync ORM handler (``eop.tools.bench.runs.record_sync``,
a row whose key it gives), ``sk`` the same row with a key the database makes
(the quickstart's ``AuditEntry`` style: the flush reads it back), ``o`` and
``ok`` the async ORM twins, ``c`` eop.Writes. Prints CPU µs a message.

Two KINDs run without eop, as a plain SQLAlchemy app would write the same rows
(``AsyncSession`` on asyncpg, a transaction of 64, no claim): ``po`` adds the
bench's ``Effect`` objects and flushes, ``pc`` executes the bench's INSERT with
the 64 rows' parameters. ``po`` minus ``pc`` is what the ORM itself costs a row,
whoever runs it; compare it with ``o`` minus ``c``.

Instructions a message, without start-up and imports: run it under callgrind
for two N and divide the difference by 64 times the difference of N::

    valgrind --tool=callgrind --callgrind-out-file=cg.10 python ... URL s 10
    valgrind --tool=callgrind --callgrind-out-file=cg.60 python ... URL s 60
"""

from __future__ import annotations

import asyncio
import datetime
import sys
import time

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Mapped, Session, mapped_column

import eop
from eop import handler
from eop import settings as settings_mod
from eop.pg import migrate, models
from eop.tools.bench import runs

BATCH = 64


class Keyed(runs._Base):
    """The bench's row with a key the database makes."""

    __tablename__ = "store_keyed"
    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    variant: Mapped[str] = mapped_column(sa.Text)
    seq: Mapped[int] = mapped_column(sa.BigInteger)
    stored_at: Mapped[datetime.datetime] = mapped_column(sa.DateTime(timezone=True))


def keyed(msg: eop.Message) -> Keyed:
    return Keyed(variant=msg.subscription, seq=msg.seq, stored_at=msg.timestamp)


def keyed_sync(msg: eop.Message, session: Session) -> None:
    """The quickstart's sync style: ``session.add`` of a row whose key the database makes."""
    session.add(keyed(msg))


async def keyed_async(msg: eop.Message, session: AsyncSession) -> None:
    """The same on the ``AsyncSession``."""
    session.add(keyed(msg))


HANDLERS: dict[str, handler.HandlerFunc] = {
    "s": runs.record_sync,
    "sk": keyed_sync,
    "o": runs.record_orm,
    "ok": keyed_async,
    "c": runs.record,
}


async def setup(url: str) -> None:
    """eop's tables, ``bench_effects`` and ``store_keyed``, empty."""
    await asyncio.to_thread(migrate.upgrade, url)
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        await conn.execute(sa.text("DROP TABLE IF EXISTS bench_effects, store_keyed"))
        await conn.execute(
            sa.text(
                "CREATE TABLE bench_effects (variant text NOT NULL, seq bigint NOT NULL,"
                " stored_at timestamptz NOT NULL)"
            )
        )
        await conn.execute(
            sa.text(
                "CREATE TABLE store_keyed (id bigserial PRIMARY KEY, variant text,"
                " seq bigint, stored_at timestamptz)"
            )
        )
    await engine.dispose()


async def run_plain(url: str, kind: str, count: int) -> None:
    """``count`` transactions of 64 rows through a plain ``AsyncSession``, no eop."""
    engine = create_async_engine(url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    now = datetime.datetime.now(datetime.timezone.utc)
    variant = f"plain-{kind}-{time.time_ns()}"
    started = 0.0
    # Two warm-up transactions first, as eop's store has its connection and
    # statements ready before the clock starts.
    for batch in range(count + 2):
        if batch == 2:
            started = time.process_time()
        seqs = range(batch * BATCH + 1, (batch + 1) * BATCH + 1)
        async with sessions() as session, session.begin():
            if kind == "po":
                for seq in seqs:
                    session.add(runs.Effect(variant=variant, seq=seq, stored_at=now))
                await session.flush()
            else:
                await session.execute(
                    runs.INSERT, [{"v": variant, "s": seq, "t": now} for seq in seqs]
                )
    spent = time.process_time() - started
    print(f"{kind}: {count} transactions, {spent / count / BATCH * 1e6:.1f} CPU µs a message")
    await engine.dispose()


async def run(url: str, kind: str, count: int) -> None:
    """``count`` batch transactions of 64 new messages, for a handler of its own name."""
    app = eop.App(settings=settings_mod.Settings(database_url=url))
    name = f"store-{kind}-{time.time_ns()}"
    app.handler(stream="S", subject="s", name=name)(HANDLERS[kind])
    spec = app.handlers[name]
    store = app.make_store()
    now = datetime.datetime.now(datetime.timezone.utc)
    started = time.process_time()
    for batch in range(count):
        msgs = [
            eop.Message(
                subscription=name,
                subject="s",
                data=b'{"id": 1}',
                headers={},
                stream="S",
                stream_epoch="e1",
                seq=batch * BATCH + i + 1,
                num_delivered=1,
                timestamp=now,
            )
            for i in range(BATCH)
        ]
        async with store.transaction(spec) as tx:
            claimed = await tx.claim_many(msgs, models.OUTCOME_PROCESSED)
            assert len(claimed) == BATCH, "a fresh handler name claims every message"
            for msg in msgs:
                await tx.run(msg, flush=False)
            await tx.flush()
            await tx.commit()
    spent = time.process_time() - started
    print(f"{kind}: {count} transactions, {spent / count / BATCH * 1e6:.1f} CPU µs a message")
    store.close()
    await app.dispose()


if __name__ == "__main__":
    if sys.argv[2] == "setup":
        asyncio.run(setup(sys.argv[1]))
    elif sys.argv[2] in ("po", "pc"):
        asyncio.run(run_plain(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    else:
        asyncio.run(run(sys.argv[1], sys.argv[2], int(sys.argv[3])))
