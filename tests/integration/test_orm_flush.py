"""The ORM's flush on the engine eop makes: INSERTs of many rows, the ORM's behaviour kept.

eop's asyncpg engine sends an executemany INSERT without RETURNING as statements
of many rows (SQLAlchemy's insertmanyvalues, :func:`eop.pg.engines.rows_for_asyncpg`).
These run README-style ORM handlers, async and sync, through a real worker and check what
a user of the ORM relies on: every object's row once, the server's defaults,
keys the database makes, relationships, and the mapper and session events.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop

from .bed import STREAM, SUBJECT, drained, running, wait_for
from .test_batch import make_app, prepublish


class _Base(orm.DeclarativeBase):
    pass


class Ledger(_Base):
    """A row whose key the handler gives, with server defaults and lines pointing at it."""

    __tablename__ = "orm_ledgers"
    id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, primary_key=True, autoincrement=False)
    body: orm.Mapped[str] = orm.mapped_column(sa.Text)
    state: orm.Mapped[str] = orm.mapped_column(sa.Text, server_default="fresh")
    lines: orm.Mapped[list[Line]] = orm.relationship(back_populates="ledger")


class Entry(_Base):
    """A row with its key given and nothing for the database to fill in: the flush sends it
    without RETURNING, the executemany the engine's setting turns into rows together."""

    __tablename__ = "orm_entries"
    ledger_id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, primary_key=True)
    body: orm.Mapped[str] = orm.mapped_column(sa.Text)


class Line(_Base):
    """A row whose key the database makes (the flush reads it back), pointing at a ledger."""

    __tablename__ = "orm_lines"
    id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, primary_key=True, autoincrement=True)
    ledger_id: orm.Mapped[int] = orm.mapped_column(sa.ForeignKey("orm_ledgers.id"))
    amount: orm.Mapped[int] = orm.mapped_column(sa.Integer)
    ledger: orm.Mapped[Ledger] = orm.relationship(back_populates="lines")


@pytest.mark.parametrize("style", ["async", "sync"])
async def test_an_orm_flush_sends_rows_together_and_keeps_the_orms_behaviour(
    style: str, database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """An async ORM handler, and a sync one (its ``Session`` the sync face of the async
    engine's, by default), each given 40 messages, each adding an entry (key given,
    nothing for the database to fill in), a ledger (key given, a server default) and two
    lines (keys made by the database): the entries, which the flush sends without
    RETURNING, go to PostgreSQL in statements of many rows, not one a row; every entry
    and ledger is there once, the ledger with its server default, every line points at
    its own ledger with a key read back, and before_insert, after_insert and
    before_flush fire for each object as with a statement a row."""
    async with engine.begin() as conn:
        await conn.run_sync(_Base.metadata.create_all)
    app = make_app(database_url, nats_url)
    events: dict[str, int] = {"before_insert": 0, "after_insert": 0, "before_flush": 0}
    statements: list[int] = []  # the rows of each INSERT INTO orm_entries
    added: list[Ledger] = []

    def add(msg: eop.Message, session: orm.Session | AsyncSession) -> None:
        ledger = Ledger(id=msg.seq, body=msg.text(), lines=[Line(amount=1), Line(amount=2)])
        session.add_all([ledger, Entry(ledger_id=msg.seq, body=msg.text())])
        added.append(ledger)

    if style == "async":

        @app.handler(stream=STREAM, subject=SUBJECT, name="ledgers")
        async def ledgers(msg: eop.Message, session: AsyncSession) -> None:
            add(msg, session)

    else:

        @app.handler(stream=STREAM, subject=SUBJECT, name="ledgers")
        def sync_ledgers(msg: eop.Message, session: orm.Session) -> None:
            assert isinstance(session, orm.Session)
            add(msg, session)

    def counted(name: str) -> Any:
        def count(*args: Any) -> None:
            events[name] += 1

        return count

    def before_cursor_execute(
        conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> None:
        if statement.startswith("INSERT INTO orm_entries"):
            statements.append(statement.count("), (") + 1)  # the rows the statement holds

    listeners = [
        (Ledger, "before_insert", counted("before_insert")),
        (Entry, "after_insert", counted("after_insert")),
        (orm.Session, "before_flush", counted("before_flush")),
        (app.engine.sync_engine, "before_cursor_execute", before_cursor_execute),
    ]
    for target, name, listener in listeners:
        sa.event.listen(target, name, listener)
    bodies = [f"l{i}" for i in range(40)]
    try:
        await prepublish(js, bodies)
        async with running(app):
            await wait_for(lambda: drained(js, "eop-ledgers", engine=engine), what="the ledgers")
    finally:
        for target, name, listener in listeners:
            sa.event.remove(target, name, listener)
    async with engine.connect() as conn:
        ledger_rows = (
            await conn.execute(sa.text("SELECT id, body, state FROM orm_ledgers ORDER BY id"))
        ).all()
        entries = (await conn.execute(sa.text("SELECT ledger_id, body FROM orm_entries"))).all()
        line_rows = (
            await conn.execute(
                sa.text("SELECT id, ledger_id, amount FROM orm_lines ORDER BY ledger_id, amount")
            )
        ).all()
    assert [tuple(r) for r in ledger_rows] == [(i + 1, b, "fresh") for i, b in enumerate(bodies)]
    assert sorted(tuple(r) for r in entries) == [(i + 1, b) for i, b in enumerate(bodies)]
    assert [(r[1], r[2]) for r in line_rows] == [(i, a) for i in range(1, 41) for a in (1, 2)]
    assert len({r[0] for r in line_rows}) == 80
    committed = {ledger.id: [line.id for line in ledger.lines] for ledger in added}
    assert {r[0]: r[1] for r in line_rows} == {
        line: ledger for ledger, lines in committed.items() for line in lines
    }
    assert events["before_insert"] == events["after_insert"] == 40
    assert events["before_flush"] >= 1
    # A statement or a few a batch, each of many rows (an executemany's statement has one).
    assert sum(statements) == 40
    assert 1 <= len(statements) < 40 // 4
