"""The outbox example's endpoint: ``POST /orders`` stores the order and announces it, at once.

    uvicorn examples.outbox.web:api              # the endpoint; `eop worker` runs the handlers
    uvicorn examples.outbox.web:api_with_worker  # the endpoint and the handlers, one process

The second runs an :class:`eop.Worker` in the application's lifespan: it starts
with the server and, when uvicorn stops (SIGTERM, Ctrl-C), finishes the
messages in flight before the process exits. It installs no signal handler of
its own: uvicorn's are the process's.

FastAPI is the example's choice, not one of eop's dependencies: any framework
that gives a view an ``AsyncSession`` (or a sync ``Session``) does the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import sqlalchemy as sa
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

import eop
from examples.outbox.app import app, create_order


class OrderIn(BaseModel):
    """The request body."""

    id: str
    total_cents: int


def make_api(orders: eop.App = app, *, worker: bool = False) -> FastAPI:
    """The endpoint on ``orders``'s database (the example's app by default).

    With ``worker``, the app's handlers and its outbox relay run in the same
    process, in the application's lifespan.
    """

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not worker:
            yield
            return
        # Serving starts at once, the worker connecting beside it (wait=False), so
        # that uvicorn acts on a SIGTERM even while a server is unreachable. Leaving
        # the lifespan stops it gracefully: in-flight messages finish, every COMMIT
        # is acked.
        async with eop.Worker(orders).running(wait=False):
            yield

    web = FastAPI(title="orders", lifespan=lifespan)

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
"""The endpoint alone (``eop worker examples.outbox.app:app`` runs the handlers)."""

api_with_worker = make_api(worker=True)
"""The endpoint, the handlers and the relay in one process."""
