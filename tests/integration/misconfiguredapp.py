"""The app the misconfiguration tests run in `eop worker` subprocesses.

An async handler (eop's async engine) records ``ORDERS.created``, a sync
handler (eop's sync engine, psycopg) records ``ORDERS.shipped``, each in the
``effects`` table, which a test may leave uncreated. Settings come from EOP_*
variables.
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
    """Record the order, on the async engine."""
    await record_effect(session, "created", msg)


@app.handler(stream=STREAM, subject=SHIPPED, name="shipped")
def shipped(msg: eop.Message, session: orm.Session) -> None:
    """Record the shipment, on the sync engine."""
    session.execute(
        sa.text("INSERT INTO effects (handler, msg_key, body) VALUES ('shipped', :k, :b)"),
        {"k": msg.idempotency_key, "b": msg.text()},
    )
