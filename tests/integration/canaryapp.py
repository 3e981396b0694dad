"""The app of the canary test (test_no_payload_in_output): handlers that hand payload
text to PostgreSQL where the driver or the server refuses it, in three styles.

A body ``KIND:VALUE`` writes VALUE into the sink table as KIND says: ``int``
into an integer column, ``long`` into a varchar(8), ``text`` into a text column
(a NUL byte in VALUE is refused), ``key`` into a unique column (a seeded row
holds the canary key already), ``ok`` a row that succeeds.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncSession

import eop

STREAM = "CANARY"
STYLES = ("orm", "sync", "writes")

SINK_DDL = (
    "CREATE TABLE sink (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, handler text,"
    " msg_key text NOT NULL, n integer, v varchar(8), s text, u text UNIQUE)"
)


class Base(orm.DeclarativeBase):
    """The ORM's base of the sink table."""


class Sink(Base):
    """One row per handled message."""

    __tablename__ = "sink"
    id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    handler: orm.Mapped[str | None] = orm.mapped_column(sa.Text)
    msg_key: orm.Mapped[str] = orm.mapped_column(sa.Text)
    n: orm.Mapped[int | None] = orm.mapped_column(sa.Integer)
    v: orm.Mapped[str | None] = orm.mapped_column(sa.String(8))
    s: orm.Mapped[str | None] = orm.mapped_column(sa.Text)
    u: orm.Mapped[str | None] = orm.mapped_column(sa.Text, unique=True)


_COLUMN = {"int": "n", "long": "v", "text": "s", "key": "u", "ok": "s"}


def row(handler: str, msg: eop.Message) -> dict[str, Any]:
    """The sink row ``msg`` asks for: its value (any type: the database decides) in its column."""
    kind, _, value = msg.data.decode().partition(":")
    return {"handler": handler, "msg_key": msg.idempotency_key, _COLUMN[kind]: value}


app = eop.App()
app.stream(STREAM, subjects=[f"{STREAM}.>"])


@app.handler(stream=STREAM, subject=f"{STREAM}.orm", name="orm")
async def by_orm(msg: eop.Message, session: AsyncSession) -> None:
    """The async ORM: asyncpg encodes the values."""
    session.add(Sink(**row("orm", msg)))
    await session.flush()


@app.handler(stream=STREAM, subject=f"{STREAM}.sync", name="sync")
def by_sync_session(msg: eop.Message, session: orm.Session) -> None:
    """A sync Session: psycopg sends the values, PostgreSQL refuses them."""
    session.add(Sink(**row("sync", msg)))
    session.flush()


@app.handler(stream=STREAM, subject=f"{STREAM}.writes", name="writes")
async def by_writes(msg: eop.Message, writes: eop.Writes) -> None:
    """eop.Writes: eop runs the statement in the message's transaction."""
    writes.add(_INSERT, row("writes", msg))


_INSERT = sa.insert(Sink)
