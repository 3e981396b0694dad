"""The app the misconfiguration tests run in `eop worker` subprocesses.

An async handler (eop's async engine) records ``ORDERS.created``, a sync
handler (eop's sync engine, psycopg) records ``ORDERS.shipped``, each in the
``effects`` table, which a test may leave uncreated. Settings come from EOP_*
variables. With ``MISCONFIGURED_OWN_ENGINE`` set, the app is given its own async engine on
``EOP_DATABASE_URL``, as an app embedding eop would: ``plain`` with asyncpg's default
statement caches, ``uncached`` with the connect arguments docs/pgbouncer.md names.
"""

from __future__ import annotations

import os

import sqlalchemy as sa
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import eop

from .bed import STREAM, SUBJECT, record_effect

SHIPPED = "ORDERS.shipped"

_OWN_ENGINE = os.environ.get("MISCONFIGURED_OWN_ENGINE")
if _OWN_ENGINE:
    _UNCACHED = {"statement_cache_size": 0, "prepared_statement_cache_size": 0}
    app = eop.App(
        engine=create_async_engine(
            os.environ["EOP_DATABASE_URL"],
            connect_args=_UNCACHED if _OWN_ENGINE == "uncached" else {},
        )
    )
else:
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
