"""Apps in every handler style the README shows, for the tests of eop.testing.TestApp.

The same apps run on the in-memory fakes (tests/unit/test_testapp.py) and on
a real database (tests/integration/test_testapp.py).
"""

from __future__ import annotations

import dataclasses
import json

import pydantic
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import eop


class Base(DeclarativeBase):
    """The test apps' own tables."""


class Invoice(Base):
    """One row per order: the handlers' effect."""

    __tablename__ = "invoices"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[str]
    handler: Mapped[str]


INSERT = sa.text("INSERT INTO invoices (order_id, handler) VALUES (:order_id, :handler)")


@dataclasses.dataclass
class Order:
    """A typed payload."""

    id: str
    amount_cents: int


def orm_app() -> eop.App:
    """An async ORM handler, a sync Session one, and one that adds to the outbox."""
    app = eop.App(settings=eop.Settings(max_attempts=3))

    @app.handler(stream="ORDERS", subject="ORDERS.created", name="billing")
    async def bill(msg: eop.Message, session: AsyncSession) -> None:
        order = msg.json()
        if order.get("fail"):
            raise RuntimeError("the payment service is down")
        if order.get("reject"):
            raise eop.Reject("orders without lines are refused")
        session.add(Invoice(order_id=order["id"], handler="billing"))
        eop.outbox.add(session, "INVOICES.created", json.dumps({"order": order["id"]}))

    @app.handler(stream="ORDERS", subject="ORDERS.created", name="audit")
    def audit(msg: eop.Message, session: Session) -> None:
        session.add(Invoice(order_id=msg.json()["id"], handler="audit"))

    return app


def writes_app() -> eop.App:
    """``eop.Writes`` handlers, async and sync."""
    app = eop.App()

    @app.handler(stream="ORDERS", subject="ORDERS.paid", name="paid")
    async def paid(msg: eop.Message, writes: eop.Writes) -> None:
        writes.add(INSERT, {"order_id": msg.json()["id"], "handler": "paid"})
        eop.outbox.add(writes, "RECEIPTS.sent", msg.data)

    @app.handler(stream="ORDERS", subject="ORDERS.shipped", name="shipped")
    def shipped(msg: eop.Message, writes: eop.Writes) -> None:
        writes.add(INSERT, {"order_id": msg.json()["id"], "handler": "shipped"})

    return app


def batch_app() -> eop.App:
    """A batch handler (``list[eop.Message]``) and a typed batch handler (``list[Order]``)."""
    app = eop.App()

    @app.handler(stream="ORDERS", subject="ORDERS.bulk", name="bulk", batch=True)
    async def bulk(msgs: list[eop.Message], session: AsyncSession) -> None:
        for msg in msgs:
            order = msg.json()
            if order.get("fail"):
                raise RuntimeError(f"order {order['id']} is cursed")
            session.add(Invoice(order_id=order["id"], handler="bulk"))

    @app.handler(stream="ORDERS", subject="ORDERS.typed", name="typed", batch=True)
    def typed(orders: list[Order], writes: eop.Writes) -> None:
        for order in orders:
            writes.add(INSERT, {"order_id": order.id, "handler": "typed"})

    return app


def typed_app() -> eop.App:
    """A typed payload handler that also asks for the message."""
    app = eop.App()

    @app.handler(stream="ORDERS", subject="ORDERS.typed", name="typed_one")
    async def save(order: Order, session: AsyncSession, msg: eop.Message) -> None:
        session.add(Invoice(order_id=f"{order.id}:{msg.seq}", handler="typed_one"))

    return app


class Line(pydantic.BaseModel):
    """A typed payload validated by pydantic."""

    sku: str
    quantity: int


def pydantic_app(seen: list[Line]) -> eop.App:
    """A handler typed with a pydantic model; what it got goes to ``seen``."""
    app = eop.App()

    @app.handler(stream="ORDERS", subject="ORDERS.line", name="lines")
    async def lines(line: Line, session: AsyncSession) -> None:
        seen.append(line)

    return app


def ordered_app() -> eop.App:
    """An ``order_by`` handler: its failures are retried by redelivery, not parked."""
    app = eop.App()
    failures: list[int] = []

    @app.handler(stream="ORDERS", subject="ORDERS.*", name="ordered", order_by="subject:1")
    async def ordered(msg: eop.Message, session: AsyncSession) -> None:
        if msg.num_delivered < 2:
            failures.append(msg.seq)
            raise eop.Retry("not yet", delay_s=0.0)
        session.add(Invoice(order_id=msg.json()["id"], handler="ordered"))

    return app
