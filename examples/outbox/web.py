"""The outbox example's endpoint: ``POST /orders`` stores the order and announces it, at once.

    uvicorn examples.outbox.web:api

FastAPI is the example's choice, not one of eop's dependencies: any framework
that gives a view an ``AsyncSession`` (or a sync ``Session``) does the same.
"""

from __future__ import annotations

import sqlalchemy as sa
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

import eop
from examples.outbox.app import app, create_order


class OrderIn(BaseModel):
    """The request body."""

    id: str
    total_cents: int


def make_api(orders: eop.App = app) -> FastAPI:
    """The endpoint on ``orders``'s database (the example's app by default)."""
    web = FastAPI(title="orders")

    @web.post("/orders", status_code=201)
    async def post_order(order: OrderIn) -> dict[str, str]:
        # The order and its ORDERS.created message commit together, or neither does.
        try:
            async with orders.sessionmaker() as session, session.begin():
                await create_order(session, order.id, order.total_cents)
        except sa.exc.IntegrityError:
            # A retried request: the order is stored and announced already.
            raise HTTPException(409, f"order {order.id} exists") from None
        return {"id": order.id}

    return web


api = make_api()
