"""Typed payloads on a real worker: valid ones processed once, invalid ones dead-lettered."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pydantic
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

import eop

from .bed import (
    STREAM,
    SUBJECT,
    bed_settings,
    create_effects_table,
    drained,
    effects_by_body,
    running,
    wait_for,
)

INSERT = sa.text("INSERT INTO effects (handler, msg_key, body) VALUES (:h, :k, :b)")


@dataclasses.dataclass(frozen=True)
class Item:
    sku: str
    qty: int


@dataclasses.dataclass(frozen=True)
class Order:
    id: int
    items: list[Item]
    note: str | None = None


class Payment(pydantic.BaseModel):
    id: int
    amount: float


def make_app(database_url: str, nats_url: str, **changes: Any) -> eop.App:
    app = eop.App(settings=bed_settings(database_url, nats_url, **changes))
    app.stream(STREAM, subjects=["ORDERS.>"], storage="file")
    return app


async def dead_letters(engine: AsyncEngine) -> list[Any]:
    async with engine.connect() as conn:
        result = await conn.execute(
            sa.text("SELECT reason, error, payload, delivery_count FROM eop.dead_letters")
        )
        return list(result)


async def test_dataclass_handler_processes_valid_and_dead_letters_invalid_at_first_delivery(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A valid order takes effect once; an invalid one is dead-lettered at delivery 1, no retry."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url, max_attempts=5)
    seen: list[Order] = []

    @app.handler(stream=STREAM, subject=SUBJECT, name="orders")
    async def save(order: Order, session: AsyncSession, msg: eop.Message) -> None:
        seen.append(order)
        body = f"order-{order.id}-{sum(i.qty for i in order.items)}"
        await session.execute(INSERT, {"h": "orders", "k": msg.idempotency_key, "b": body})

    valid = {"id": 1, "items": [{"sku": "a", "qty": 2}, {"sku": "b", "qty": 3}]}
    invalid = {"id": 2, "items": [{"sku": "a", "qty": "two"}]}
    async with running(app):
        await js.publish(SUBJECT, json.dumps(valid).encode())
        await js.publish(SUBJECT, json.dumps(invalid).encode())
        await js.publish(SUBJECT, b"not json")
        await wait_for(lambda: drained(js, "eop-orders", engine=engine), what="all three messages")
    # Only the valid order reaches the handler. It may reach it twice when the
    # invalid one shared its batch (the batch is rerun with a savepoint per
    # message, see eop.protocol.batch); its effect counts once either way.
    expected = Order(id=1, items=[Item("a", 2), Item("b", 3)])
    assert seen
    assert all(order == expected for order in seen)
    assert await effects_by_body(engine) == {"order-1-5": 1}
    dead = sorted(await dead_letters(engine), key=lambda r: r.error)
    assert [(r.reason, r.delivery_count) for r in dead] == [("undecodable", 1)] * 2
    assert "items[0].qty: Input should be a valid integer" in dead[0].error
    assert "not valid JSON" in dead[1].error
    info = await js.consumer_info(STREAM, "eop-orders")
    assert info.num_redelivered == 0


async def test_batch_handler_with_pydantic_models_dead_letters_only_the_invalid_one(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """list[Model] in a batch: the valid payments commit together, the bad one is dead-lettered."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url, batch=16, concurrency=16)

    @app.handler(stream=STREAM, subject=SUBJECT, name="payments", batch=True)
    async def save_all(
        payments: list[Payment], session: AsyncSession, msgs: list[eop.Message]
    ) -> None:
        for payment, msg in zip(payments, msgs, strict=True):
            body = f"pay-{payment.id}"
            await session.execute(INSERT, {"h": "payments", "k": msg.idempotency_key, "b": body})

    # Published before the worker starts, so they arrive as one fetched batch.
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    for i in range(6):
        data = {"id": i, "amount": 1.5} if i != 3 else {"id": i, "amount": "lots"}
        await js.publish(SUBJECT, json.dumps(data).encode())
    async with running(app):
        await wait_for(lambda: drained(js, "eop-payments", engine=engine), what="the batch")
    assert await effects_by_body(engine) == {f"pay-{i}": 1 for i in range(6) if i != 3}
    [dead] = await dead_letters(engine)
    assert dead.reason == "undecodable"
    assert dead.delivery_count == 1
    assert "amount: Input should be a valid number" in dead.error
    assert json.loads(bytes(dead.payload)) == {"id": 3, "amount": "lots"}


async def test_sync_typed_handler_gets_the_decoded_dataclass(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A plain ``def`` handler annotated with a dataclass runs in a thread with the value."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url)

    @app.handler(stream=STREAM, subject=SUBJECT, name="sync-orders")
    def save(order: Order, session: Session, msg: eop.Message) -> None:
        session.execute(INSERT, {"h": "s", "k": msg.idempotency_key, "b": f"sync-{order.id}"})

    async with running(app):
        await js.publish(SUBJECT, json.dumps({"id": 9, "items": []}).encode())
        await wait_for(lambda: drained(js, "eop-sync-orders", engine=engine), what="the message")
    assert await effects_by_body(engine) == {"sync-9": 1}
    assert await dead_letters(engine) == []
