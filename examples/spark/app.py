"""Spark example: account balances from payment events, exactly once, on workers or on Spark.

The ``balances`` handler adds each settled payment to its account's balance.
A payment applied twice would be money created from nothing, so it relies on
eop's exactly-once outcome whether it runs in ``eop worker`` processes, in a
Spark backfill, or in both at once (they share the inbox: whoever claims a
payment first applies it, the other skips it).

Run it (NATS with JetStream and PostgreSQL reachable; ``pip install 'eop[spark]'``):

    export EOP_DATABASE_URL=postgresql+asyncpg://postgres@127.0.0.1:5432/postgres
    export EOP_NATS_URL=nats://127.0.0.1:4222
    eop db upgrade
    python -m examples.spark.app create-tables
    python -m examples.spark.app publish 10000

    # the history, in parallel on Spark (local[2] here; --master for a cluster)
    eop spark backfill examples.spark.app:app --handler balances
    # or as a streaming query that keeps up with the stream
    eop spark stream examples.spark.app:app --handler balances --checkpoint /tmp/eop-balances
    # live traffic on workers: what Spark applied is skipped, the rest applied
    eop worker examples.spark.app:app
"""

from __future__ import annotations

import asyncio
import json
import sys

import nats
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import eop
from eop.broker import jetstream


class Base(DeclarativeBase):
    """The application's own models (eop's tables live apart, in schema "eop")."""


class Balance(Base):
    """One row per account: the sum of its settled payments."""

    __tablename__ = "balances"
    account: Mapped[str] = mapped_column(primary_key=True)
    cents: Mapped[int]


app = eop.App()
app.stream("PAYMENTS", subjects=["PAYMENTS.>"])


@app.handler(stream="PAYMENTS", subject="PAYMENTS.settled", name="balances")
def add_payment(msg: eop.Message, session: Session) -> None:
    """Add the payment to its account, in the transaction that claims the message.

    A plain ``def``: on Spark it runs in the task's thread, on a worker in a thread.
    """
    payment = msg.json()  # garbage is dead-lettered at once, never retried
    upsert = postgresql.insert(Balance).values(account=payment["account"], cents=payment["cents"])
    session.execute(
        upsert.on_conflict_do_update(
            index_elements=[Balance.account], set_={"cents": Balance.cents + upsert.excluded.cents}
        )
    )


async def publish(count: int, nats_url: str | None = None, accounts: int = 100) -> None:
    """Publish ``count`` payments of 1 to 100 cents over ``accounts`` accounts, making the
    stream first when it does not exist (as a worker would: eop's epoch in its metadata)."""
    nc = await nats.connect(nats_url or app.settings.nats_url)
    js = nc.jetstream()
    await jetstream.ensure_stream(js, app.stream_spec("PAYMENTS"), create=True)
    for i in range(0, count, 500):
        batch = range(i, min(i + 500, count))
        await asyncio.gather(
            *(
                js.publish(
                    "PAYMENTS.settled",
                    json.dumps({"account": f"acct-{n % accounts}", "cents": n % 100 + 1}).encode(),
                    headers={"Nats-Msg-Id": f"payment-{n}"},
                )
                for n in batch
            )
        )
    await nc.close()


def expected_total(count: int) -> int:
    """The sum of all balances once every payment of :func:`publish` is applied once."""
    return sum(n % 100 + 1 for n in range(count))


async def _create_tables() -> None:
    async with app.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await app.dispose()


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "publish"
    if command == "create-tables":
        asyncio.run(_create_tables())
    else:
        asyncio.run(publish(int(sys.argv[2]) if len(sys.argv) > 2 else 1000))
