"""The app of the stuck-delivery tests: each message adds one to the account it names.

A transaction outside the worker that holds an account's row keeps that
account's message delivered and unacknowledged (its worker renews the lease
while the handler waits on the row), while the other accounts' messages are
acked. `eop worker`, `eop audit` and `eop status` subprocesses load it (settings
from EOP_* variables); the in-process tests register :func:`post` on an app of
their own.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop

from .bed import STREAM, SUBJECT

ACCOUNTS_DDL = "CREATE TABLE accounts (id text PRIMARY KEY, n bigint NOT NULL)"
HOT = "hot"
"""The account whose row the tests hold."""

app = eop.App()
app.stream(STREAM, subjects=["ORDERS.>"], storage="file")


@app.handler(stream=STREAM, subject=SUBJECT, name="ledger")
async def post(msg: eop.Message, session: AsyncSession) -> None:
    """Add one to the account named by the message's body (waiting for its row's lock)."""
    await session.execute(
        sa.text(
            "INSERT INTO accounts (id, n) VALUES (:id, 1) "
            "ON CONFLICT (id) DO UPDATE SET n = accounts.n + 1"
        ),
        {"id": msg.data.decode()},
    )


async def create_accounts(engine: AsyncEngine) -> None:
    """The accounts table, with the row of :data:`HOT` (at 0) for the tests to hold."""
    async with engine.begin() as conn:
        await conn.execute(sa.text(ACCOUNTS_DDL))
        await conn.execute(sa.text("INSERT INTO accounts (id, n) VALUES (:id, 0)"), {"id": HOT})
