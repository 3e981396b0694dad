"""The ``pipeline`` target: two handlers chained through the outbox, and an order writer.

Stream A -> ``chaos-pipe-1`` -> outbox -> stream B -> ``chaos-pipe-2``. The first
handler writes an effect row and adds the message to the outbox in the same
transaction (``eop.outbox.add``); the relays of the workers publish it to
stream B, where the second handler writes an effect row of its own. Beside
the harness's publisher, a writer (:func:`write_orders`) plays a web service:
each "request" commits an order row and adds a message to stream A or B in one
transaction, and tries again after any failure until it knows the order is
committed, once (an order found already there was committed by an attempt
whose COMMIT's reply was lost).

Every logical message must take effect exactly once in each handler from the
stage it enters at (:attr:`eop.tools.chaos.Payload.stage`), whatever the relays
went through: a relay killed after publishing but before marking sends its
rows again, after stream B's short duplicate window, and the second handler's
msg-id guard must absorb them.

This module is also the app the worker processes run (``eop.tools.chaos.pipeline:app``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

import eop
from eop.tools.chaos.bank import (
    CANARY_PAYLOAD,
    DUPLICATE_WINDOW_S,
    create_tables,
    make_failing,
    mixed_payload,
)
from eop.tools.chaos.target import Payload, Stage, Target, WriterResult

STREAM_A = "CHAOSPA"
SUBJECT_A = "chaos.pipe.a.new"
STREAM_B = "CHAOSPB"
SUBJECT_B = "chaos.pipe.b.new"
HANDLER_1 = "chaos-pipe-1"
HANDLER_2 = "chaos-pipe-2"
KEY_HEADER = "Chaos-Key"
"""Carries the logical message's key on every outbox message."""

app = eop.App()
# Both windows short: a relay's re-send after a takeover lands past them.
app.stream(STREAM_A, subjects=["chaos.pipe.a.>"], duplicate_window_s=DUPLICATE_WINDOW_S)
app.stream(STREAM_B, subjects=["chaos.pipe.b.>"], duplicate_window_s=DUPLICATE_WINDOW_S)

# Deliberately without a unique key: a second effect must show, not be refused.
_EFFECTS_DDL = (
    "CREATE TABLE chaos_pipe_effects (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " stage integer NOT NULL, item_id text NOT NULL, pid integer NOT NULL,"
    " delivered integer NOT NULL)"
)
_ORDERS_DDL = (
    "CREATE TABLE chaos_pipe_orders (order_id text PRIMARY KEY,"
    " created_at timestamptz NOT NULL DEFAULT now())"
)
_EFFECT = sa.text(
    "INSERT INTO chaos_pipe_effects (stage, item_id, pid, delivered)"
    " VALUES (:stage, :id, :pid, :delivered)"
)
_ORDER = sa.text(
    "INSERT INTO chaos_pipe_orders (order_id) VALUES (:id)"
    " ON CONFLICT (order_id) DO NOTHING RETURNING order_id"
)
EFFECTS_1_SQL = "SELECT item_id, count(*) FROM chaos_pipe_effects WHERE stage = 1 GROUP BY item_id"
EFFECTS_2_SQL = "SELECT item_id, count(*) FROM chaos_pipe_effects WHERE stage = 2 GROUP BY item_id"


@app.handler(stream=STREAM_A, subject="chaos.pipe.a.>", name=HANDLER_1)
async def forward(msg: eop.Message, session: AsyncSession) -> None:
    """Record the first effect and pass the message on to stream B through the outbox."""
    item = msg.json()
    if not isinstance(item, dict) or item.get("kind") == "poison":
        raise eop.Reject("not an item")
    if item.get("kind") == "failing":
        raise RuntimeError("this item always fails")
    await session.execute(
        _EFFECT,
        {"stage": 1, "id": item["id"], "pid": os.getpid(), "delivered": msg.num_delivered},
    )
    # Long enough for crashes to land between the effect and the COMMIT.
    await asyncio.sleep(random.random() * 0.004)
    headers = {KEY_HEADER: str(item["id"])}
    if "Authorization" in msg.headers:
        # A secret travels on: neither the relay nor the next handler may log it.
        headers["Authorization"] = msg.headers["Authorization"]
    # No msg_id: eop chooses one, once, and every send of the row carries it.
    eop.outbox.add(session, SUBJECT_B, msg.data, headers=headers)


@app.handler(stream=STREAM_B, subject="chaos.pipe.b.>", name=HANDLER_2)
def settle(msg: eop.Message, session: Session) -> None:
    """Record the second effect (a sync handler: SQLAlchemy ``Session``, in a thread)."""
    item = msg.json()
    if not isinstance(item, dict):
        raise eop.Reject("not an item")
    session.execute(
        _EFFECT,
        {"stage": 2, "id": item["id"], "pid": os.getpid(), "delivered": msg.num_delivered},
    )


def make_item(key: str, rng: random.Random) -> Payload:
    """A good item with ``key``, published to stream A."""
    body = {"id": key, "amount": rng.randint(1, 1000), "memo": CANARY_PAYLOAD}
    return Payload(key=key, data=json.dumps(body).encode())


def make_payload(index: int, rng: random.Random) -> Payload:
    """The ``index``-th item for stream A; about one in 150 is poison of one of three kinds
    (a failing one fails on every delivery of the first handler)."""
    return mixed_payload(index, rng, make_item)


def setup(sync_url: str) -> None:
    """Create the effects and orders tables."""
    create_tables(sync_url, (_EFFECTS_DDL, _ORDERS_DDL))


# -- the order writer: a web service's requests


class _Orders:
    """Commits orders, each with its outbox message, as a web service's requests would."""

    def __init__(self, database_url: str, in_flight: int = 4) -> None:
        # A connection per request, closed after it: a request cut short by a fault
        # (a lost COMMIT reply, a reset) leaves nothing behind for the next one.
        self.engine = create_async_engine(
            database_url,
            poolclass=NullPool,
            connect_args={"timeout": 5, "command_timeout": 10},
        )
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self.requests = asyncio.Semaphore(in_flight)
        self.result = WriterResult(payloads=[])

    async def place(self, order: Payload, subject: str, give_up_at: float) -> None:
        """Commit ``order`` once: try again after every failure, until it is there."""
        async with self.requests:
            wait_s = 0.05
            attempt = 0
            while True:
                attempt += 1
                try:
                    inserted = await asyncio.wait_for(self._transaction(order, subject), 20)
                except Exception:  # under fire, anything may fail: that is the point
                    self.result.retries += 1
                    if time.monotonic() > give_up_at:
                        self.result.unfinished.append(order.key)
                        return
                    await asyncio.sleep(wait_s)
                    wait_s = min(wait_s * 2, 1.0)
                    continue
                if not inserted and attempt > 1:
                    # An earlier attempt committed, and its COMMIT's reply was lost.
                    self.result.found_committed += 1
                self.result.payloads.append(order)
                return

    async def _transaction(self, order: Payload, subject: str) -> bool:
        """The request's transaction; False when the order was there already."""
        async with self.sessions() as session, session.begin():
            row = (await session.execute(_ORDER, {"id": order.key})).first()
            if row is None:
                return False
            eop.outbox.add(session, subject, order.data, msg_id=order.key, headers=order.headers)
            return True


async def write_orders(database_url: str, count: int, spread_s: float, seed: int) -> WriterResult:
    """Commit ``count`` orders over ``spread_s`` seconds, half to stream A, half to B.

    Each order's message has the order's key as its msg-id. One sent to A takes
    both stages; one sent to B enters at the second (:attr:`Payload.stage` 1).
    """
    rng = random.Random(f"eop-chaos-orders:{seed}")
    orders = _Orders(database_url)
    started = time.monotonic()
    # Long enough to outlast any outage of the schedule; then it is a failure of the run.
    give_up_at = started + spread_s + 120.0
    tasks: list[asyncio.Task[None]] = []
    try:
        for index in range(count):
            delay = started + index * spread_s / max(count, 1) - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            key = f"w{index:06d}"
            to_a = rng.random() < 0.5
            body = {"id": key, "amount": rng.randint(1, 1000), "memo": CANARY_PAYLOAD}
            order = Payload(
                key=key,
                data=json.dumps(body).encode(),
                headers={KEY_HEADER: key},
                stage=0 if to_a else 1,
            )
            subject = SUBJECT_A if to_a else SUBJECT_B
            tasks.append(asyncio.create_task(orders.place(order, subject, give_up_at)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await orders.engine.dispose()
    orders.result.payloads.sort(key=lambda p: p.key)
    return orders.result


def target() -> Target:
    """The pipeline as a :class:`Target`."""
    return Target(
        app="eop.tools.chaos.pipeline:app",
        handler=HANDLER_1,
        effects_sql=EFFECTS_1_SQL,
        payloads=make_payload,
        setup=setup,
        subject=SUBJECT_A,
        make_good=make_item,
        make_failing=make_failing,
        downstream=(Stage(HANDLER_2, EFFECTS_2_SQL),),
        writer=write_orders,
        key_header=KEY_HEADER,
    )
