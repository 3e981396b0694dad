"""The app the Spark tests run in Spark's Python workers (imported there by its path).

Its handlers write one effect row per message (see tests/integration/bed.py),
reject bodies starting with ``reject`` and always fail on ``poison``.
``spark_ordered`` handles each account's messages in stream order;
``spark_partitioned`` too, its accounts spread over 3 partitions (subject
``ORDERS.<account>.step``, which the stream stores as ``<partition>.ORDERS...``).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import eop
from tests.integration.bed import STREAM, SUBJECT

PATH = "tests.spark.sparkapp:app"

app = eop.App()
app.stream(STREAM, subjects=["ORDERS.>"])

_INSERT = sa.text("INSERT INTO effects (handler, msg_key, body) VALUES (:h, :k, :b)")


def _check(msg: eop.Message) -> str:
    body = msg.data.decode()
    if body.startswith("reject"):
        raise eop.Reject("the test rejects it")
    if body.startswith("poison"):
        raise RuntimeError("the test's handler always fails on it")
    return body


@app.handler(stream=STREAM, subject=SUBJECT, name="spark_sync")
def record_sync(msg: eop.Message, session: Session) -> None:
    """A sync handler: one effect row."""
    body = _check(msg)
    session.execute(_INSERT, {"h": "spark_sync", "k": msg.idempotency_key, "b": body})


@app.handler(stream=STREAM, subject=SUBJECT, name="spark_async")
async def record_async(msg: eop.Message, session: AsyncSession) -> None:
    """An async handler: one effect row."""
    body = _check(msg)
    await session.execute(_INSERT, {"h": "spark_async", "k": msg.idempotency_key, "b": body})


@app.handler(stream=STREAM, subject=SUBJECT, name="spark_ordered", order_by="header:X-Account")
def record_ordered(msg: eop.Message, session: Session) -> None:
    """One effect row, keyed by the account header (its id tells the order of application)."""
    key = f"{msg.headers.get('X-Account')}:{msg.seq}"
    session.execute(_INSERT, {"h": "spark_ordered", "k": key, "b": msg.data.decode()})


@app.handler(
    stream=STREAM,
    subject="ORDERS.*.step",
    name="spark_partitioned",
    order_by="subject:1",
    partitions=3,
)
def record_partitioned(msg: eop.Message, session: Session) -> None:
    """One effect row per message: its account and sequence, and the subject it was given."""
    key = f"{msg.subject.split('.')[1]}:{msg.seq}"
    session.execute(_INSERT, {"h": "spark_partitioned", "k": key, "b": msg.subject})
