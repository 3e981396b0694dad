"""Outbox: an order endpoint and a chain of two handlers, every message published exactly once.

- ``POST /orders`` (a FastAPI view, :mod:`examples.outbox.web`) commits the order and adds
  ``ORDERS.created`` to the outbox, in one transaction: the message goes out
  if and only if the order is stored.
- ``reserve`` (on ``ORDERS.created``) reserves the stock and adds
  ``SHIPMENTS.requested`` to the outbox, in the transaction that claims the
  message.
- ``ship`` (on ``SHIPMENTS.requested``) records the shipment.

The relay that ``eop worker`` runs publishes what the transactions committed.
Run it (a NATS server with JetStream and PostgreSQL reachable, see the README):

    export EOP_DATABASE_URL=postgresql+asyncpg://postgres@127.0.0.1:5432/postgres
    export EOP_NATS_URL=nats://127.0.0.1:4222
    eop db upgrade
    python -m examples.outbox.app create-tables
    eop worker examples.outbox.app:app            # the handlers and the relay
    python -m examples.outbox.app post 100         # 100 orders, as the endpoint takes them
    python -m examples.outbox.app report           # orders, reservations, shipments

or serve the endpoint of :mod:`examples.outbox.web` (``pip install fastapi uvicorn``)::

    uvicorn examples.outbox.web:api
    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"id": "web-1", "total_cents": 1200}'
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import eop


class Base(DeclarativeBase):
    """The application's own models (eop's tables live apart, in schema "eop")."""


class Order(Base):
    """An order, as the endpoint stores it."""

    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(primary_key=True)
    total_cents: Mapped[int]


class Reservation(Base):
    """Stock reserved for an order: ``reserve``'s effect."""

    __tablename__ = "reservations"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[str]


class Shipment(Base):
    """A shipment: ``ship``'s effect."""

    __tablename__ = "shipments"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[str]


app = eop.App()
app.stream("ORDERS", subjects=["ORDERS.>"])
app.stream("SHIPMENTS", subjects=["SHIPMENTS.>"])


async def create_order(session: AsyncSession, order_id: str, total_cents: int) -> None:
    """What the endpoint does: store the order and announce it, in the caller's transaction."""
    session.add(Order(id=order_id, total_cents=total_cents))
    # The order's id as the Nats-Msg-Id: a client that retries the request gets a
    # primary-key error here, and the stream would drop a second copy anyway.
    eop.outbox.add(
        session,
        "ORDERS.created",
        json.dumps({"id": order_id, "total_cents": total_cents}),
        msg_id=f"order-created:{order_id}",
    )


@app.handler(stream="ORDERS", subject="ORDERS.created", name="reserve")
async def reserve(msg: eop.Message, session: AsyncSession) -> None:
    """Reserve the stock and request the shipment: both or neither."""
    order = msg.json()
    session.add(Reservation(order_id=order["id"]))
    eop.outbox.add(session, "SHIPMENTS.requested", json.dumps({"order_id": order["id"]}))


@app.handler(stream="SHIPMENTS", subject="SHIPMENTS.requested", name="ship")
async def ship(msg: eop.Message, session: AsyncSession) -> None:
    """Record the shipment."""
    session.add(Shipment(order_id=msg.json()["order_id"]))


async def post(count: int) -> None:
    """Take ``count`` new orders, each in its own transaction, as the endpoint would."""
    run = uuid.uuid4().hex[:8]  # new order ids on every run
    for i in range(count):
        async with app.sessionmaker() as session, session.begin():
            await create_order(session, f"order-{run}-{i}", 100 + i)
    await app.dispose()


async def report() -> dict[str, int]:
    """How many orders, reservations and shipments (and distinct orders among them)."""
    counts = {}
    async with app.engine.connect() as conn:
        for table in ("orders", "reservations", "shipments"):
            column = "id" if table == "orders" else "order_id"
            total, distinct = (
                await conn.execute(
                    sa.text(f"SELECT count(*), count(DISTINCT {column}) FROM {table}")
                )
            ).one()
            counts[table], counts[f"{table}_distinct"] = int(total), int(distinct)
    await app.dispose()
    return counts


async def _create_tables() -> None:
    async with app.engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await app.dispose()


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "post"
    if command == "create-tables":
        asyncio.run(_create_tables())
    elif command == "report":
        print(json.dumps(asyncio.run(report())))
    else:
        asyncio.run(post(int(sys.argv[2]) if len(sys.argv) > 2 else 10))
