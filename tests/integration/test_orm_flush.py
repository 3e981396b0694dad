"""The ORM's flush on the engine eop makes: INSERTs of many rows, the ORM's behaviour kept.

eop's asyncpg engine sends an executemany INSERT without RETURNING as statements
of many rows (SQLAlchemy's insertmanyvalues, :func:`eop.pg.engines.rows_for_asyncpg`).
These run README-style ORM handlers, async and sync, through a real worker and check what
a user of the ORM relies on: every object's row once, the server's defaults,
keys the database makes, relationships, and the mapper and session events.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop

from .bed import STREAM, SUBJECT, drained, publish, running, wait_for
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


def _stamp() -> datetime.datetime:
    return datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


class _NoteColumns:
    """Every kind of column but a relationship."""

    id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, primary_key=True, autoincrement=False)
    body: orm.Mapped[str] = orm.mapped_column(sa.Text)
    state: orm.Mapped[str] = orm.mapped_column(sa.Text, server_default="fresh")
    at: orm.Mapped[datetime.datetime] = orm.mapped_column(
        sa.DateTime(timezone=True), default=_stamp
    )
    remark: orm.Mapped[str | None] = orm.mapped_column(sa.Text, nullable=True)
    kind: orm.Mapped[str] = orm.mapped_column("note_kind", sa.Text, server_default="plain")


class Note(_NoteColumns, _Base):
    """A plain model: its new objects alone are written as queued rows
    (:mod:`eop.pg.pending`), past the unit of work."""

    __tablename__ = "orm_notes"


class TwinNote(_NoteColumns, _Base):
    """The same model on a table of its own, written by a plain session's flush."""

    __tablename__ = "orm_twin_notes"


class Tally(_Base):
    """A plain model whose key the database makes."""

    __tablename__ = "orm_tallies"
    id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, primary_key=True)
    note_id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger)


def _notes(seq: int, body: str, note: type[_NoteColumns] = Note) -> list[Any]:
    """Odd messages set what even ones leave to the defaults, None included."""
    if seq % 2:
        return [note(id=seq, body=body, state=None, remark="r", kind="k")]
    return [note(id=seq, body=body), Tally(note_id=seq)]


_NOTE_ROWS = "SELECT id, body, state, at, remark, note_kind FROM {} ORDER BY id"


class _Seen:
    """The INSERTs an engine sent, and the ORM events that fired."""

    def __init__(self) -> None:
        self.statements: list[str] = []
        self.events = {"before_insert": 0, "before_flush": 0}

    def statement(
        self, conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> None:
        if statement.startswith("INSERT INTO orm_"):
            self.statements.append(statement)

    def counter(self, name: str) -> Any:
        def count(*args: Any) -> None:
            self.events[name] += 1

        return count

    @property
    def read_back(self) -> list[str]:
        """The INSERTs that read keys back: the unit of work's."""
        return [statement for statement in self.statements if "RETURNING" in statement]


@pytest.mark.parametrize("style", ["async", "sync"])
async def test_new_plain_objects_skip_the_unit_of_work_and_keep_what_it_would_write(
    style: str, database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """README-style handlers (async and sync) that only add plain objects: their rows are
    exactly those SQLAlchemy's own flush writes for the same objects (a None left to the
    server default, a Python default, a column named apart from its attribute, keys the
    database makes), sent without the unit of work (no RETURNING to read keys back).
    Then, with a before_insert listener on the model and a before_flush one on the
    session, the flush is SQLAlchemy's again: each listener fires, before_insert once an
    object."""
    async with engine.begin() as conn:
        await conn.run_sync(_Base.metadata.create_all)
    app = make_app(database_url, nats_url)
    seen = _Seen()
    added: list[Note | Tally] = []

    def add(msg: eop.Message, session: orm.Session | AsyncSession) -> None:
        objects = _notes(msg.seq, msg.text())
        session.add_all(objects)
        added.extend(objects)

    if style == "async":

        @app.handler(stream=STREAM, subject=SUBJECT, name="notes")
        async def notes(msg: eop.Message, session: AsyncSession) -> None:
            add(msg, session)

    else:

        @app.handler(stream=STREAM, subject=SUBJECT, name="notes")
        def sync_notes(msg: eop.Message, session: orm.Session) -> None:
            add(msg, session)

    await prepublish(js, [f"n{i}" for i in range(40)])
    async with running(app):
        await wait_for(lambda: drained(js, "eop-notes", engine=engine), what="the notes")
        # Nothing left them in a session: their rows went out as queued writes (those
        # of a table without a Python default on asyncpg's own connection).
        assert len(added) == 60
        assert all(sa.inspect(obj).transient for obj in added)
        listeners = [
            (Note, "before_insert", seen.counter("before_insert")),
            (orm.Session, "before_flush", seen.counter("before_flush")),
            (app.engine.sync_engine, "before_cursor_execute", seen.statement),
        ]
        for target, name, listener in listeners:
            sa.event.listen(target, name, listener)
        try:
            for i in range(40, 60):
                await publish(js, f"n{i}")
            await wait_for(
                lambda: drained(js, "eop-notes", engine=engine), what="the listened notes"
            )
        finally:
            for target, name, listener in listeners:
                sa.event.remove(target, name, listener)
    assert seen.events["before_insert"] == 20  # the unit of work's, once an object
    assert seen.events["before_flush"] >= 1
    assert seen.read_back  # the tallies' keys, read back by the unit of work
    assert not any(sa.inspect(obj).transient for obj in added[60:])
    # The same objects through a plain session, SQLAlchemy's flush: the same rows.
    async with AsyncSession(engine) as session, session.begin():
        for seq in range(1, 61):
            session.add_all(_notes(seq, f"n{seq - 1}", TwinNote))
    async with engine.connect() as conn:
        through_eop = (await conn.execute(sa.text(_NOTE_ROWS.format("orm_notes")))).all()
        through_orm = (await conn.execute(sa.text(_NOTE_ROWS.format("orm_twin_notes")))).all()
        tallies = (await conn.execute(sa.text("SELECT note_id FROM orm_tallies"))).all()
    assert len(through_eop) == 60
    assert through_eop == through_orm
    assert through_eop[0][2:] == ("fresh", _stamp(), "r", "k")  # seq 1: state=None
    assert through_eop[1][2:] == ("fresh", _stamp(), None, "plain")
    assert sorted(n for (n,) in tallies) == sorted([*range(2, 61, 2)] * 2)  # eop's, the twins'
