"""Quickstart: bill every created order exactly once.

Run it (a NATS server with JetStream and PostgreSQL reachable, see the README):

    export EOP_DATABASE_URL=postgresql+asyncpg://postgres@127.0.0.1:5432/postgres
    export EOP_NATS_URL=nats://127.0.0.1:4222
    eop db upgrade
    python -m examples.quickstart.app create-tables
    eop worker examples.quickstart.app:app --concurrency 8
    python -m examples.quickstart.app publish 100
"""

from __future__ import annotations

import asyncio
import json
import sys

import nats
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import eop


class Base(DeclarativeBase):
    """The application's own models (eop's tables live apart, in schema "eop")."""


class Invoice(Base):
    """One invoice per order: the handler's effect."""

    __tablename__ = "invoices"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[str]
    amount_cents: Mapped[int]


class AuditEntry(Base):
    """Written by the sync handler, to show that plain `def` handlers work too."""

    __tablename__ = "audit_entries"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[str]


# Settings come from EOP_* variables; App(engine=...) plugs into an existing engine.
app = eop.App()
app.stream("ORDERS", subjects=["ORDERS.>"], duplicate_window_s=120)


@app.handler(stream="ORDERS", subject="ORDERS.created", name="billing")
async def bill(msg: eop.Message, session: AsyncSession) -> None:
    """Create the order's invoice, in the transaction that claims the message."""
    order = msg.json()  # garbage is dead-lettered at once, never retried
    session.add(Invoice(order_id=order["id"], amount_cents=order["amount_cents"]))


@app.handler(stream="ORDERS", subject="ORDERS.created", name="audit")
def audit(msg: eop.Message, session: Session) -> None:
    """A sync handler: runs in a worker thread with a sync Session."""
    session.add(AuditEntry(order_id=msg.json()["id"]))


async def publish(count: int, nats_url: str | None = None) -> None:
    """Publish ``count`` orders (their ids as Nats-Msg-Id)."""
    nc = await nats.connect(nats_url or app.settings.nats_url)
    js = nc.jetstream()
    for i in range(count):
        order = {"id": f"order-{i}", "amount_cents": 100 + i}
        # Nats-Msg-Id lets the server drop a duplicate publish (a retried send).
        await js.publish(
            "ORDERS.created", json.dumps(order).encode(), headers={"Nats-Msg-Id": order["id"]}
        )
    await nc.close()


async def _create_tables() -> None:
    async with app.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await app.dispose()


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "publish"
    if command == "create-tables":
        asyncio.run(_create_tables())
    else:
        asyncio.run(publish(int(sys.argv[2]) if len(sys.argv) > 2 else 10))
