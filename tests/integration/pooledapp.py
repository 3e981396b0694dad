"""The app the PgBouncer tests run in `eop worker` subprocesses: both engines and the relay.

An async handler records ``ORDERS.created`` and adds one ``ORDERS.shipped`` to
the outbox; a sync handler (eop's sync engine) records what the relay
published. Settings come from EOP_* variables.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncSession

import eop

from .bed import STREAM, SUBJECT, record_effect

SHIPPED = "ORDERS.shipped"

app = eop.App()
app.stream(STREAM, subjects=["ORDERS.>"])


@app.handler(stream=STREAM, subject=SUBJECT, name="created")
async def created(msg: eop.Message, session: AsyncSession) -> None:
    """Record the order and ship it through the outbox, in one transaction."""
    await record_effect(session, "created", msg)
    eop.outbox.add(session, SHIPPED, msg.data, msg_id=f"shipped-{msg.text()}")


@app.handler(stream=STREAM, subject=SHIPPED, name="shipped")
def shipped(msg: eop.Message, session: orm.Session) -> None:
    """Record the shipment, on the sync engine."""
    session.execute(
        sa.text("INSERT INTO effects (handler, msg_key, body) VALUES ('shipped', :k, :b)"),
        {"k": msg.idempotency_key, "b": msg.text()},
    )
