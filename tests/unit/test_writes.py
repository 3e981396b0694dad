"""eop.Writes: what it queues, how it groups writes, what it refuses; who gets one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa

import eop
from eop import errors
from eop.handler import HandlerSpec

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

T = sa.table("t", sa.column("a"), sa.column("b"))
INSERT = sa.text("INSERT INTO t (a) VALUES (:a)")


class Recorder:
    """A stand-in sync Session whose connection records what it executes."""

    def __init__(self) -> None:
        self.executed: list[tuple[Any, Any]] = []

    def connection(self) -> Recorder:
        return self

    def execute(self, statement: Any, params: Any) -> None:
        self.executed.append((statement, params))


def test_consecutive_writes_of_one_statement_and_keys_are_sent_as_one_executemany() -> None:
    """Runs of the same statement object with the same parameter names share one call;
    order is kept, so a different statement in between splits the run."""
    writes = eop.Writes(session=None)  # type: ignore[arg-type]
    other = sa.insert(T)
    writes.add(INSERT, {"a": 1})
    writes.add(INSERT, {"a": 2})
    writes.add(other, {"a": 3, "b": 4})
    writes.add(INSERT, {"a": 5})
    writes.add(INSERT, {"a": 6, "extra": 0})  # other names: an executemany would drop them
    assert len(writes) == 5
    session = Recorder()
    writes.send(session)  # type: ignore[arg-type]
    assert session.executed == [
        (INSERT, [{"a": 1}, {"a": 2}]),
        (other, {"a": 3, "b": 4}),
        (INSERT, {"a": 5}),
        (INSERT, {"a": 6, "extra": 0}),
    ]
    assert not writes
    writes.send(session)  # type: ignore[arg-type]
    assert len(session.executed) == 4  # sent once


def test_writes_copy_their_parameters_and_discard_forgets_them() -> None:
    """A handler reusing its dict cannot change a queued write; discard empties the queue."""
    writes = eop.Writes(session=None)  # type: ignore[arg-type]
    params = {"a": 1}
    writes.add(INSERT, params)
    params["a"] = 2
    writes.add(INSERT, params)
    session = Recorder()
    writes.send(session)  # type: ignore[arg-type]
    assert session.executed == [(INSERT, [{"a": 1}, {"a": 2}])]
    writes.add(INSERT, {"a": 3})
    writes.discard()
    assert len(writes) == 0


@pytest.mark.parametrize(
    "statement",
    [sa.select(T), sa.insert(T).returning(T.c.a), "INSERT INTO t VALUES (1)"],
    ids=["select", "returning", "plain-string"],
)
def test_writes_refuse_statements_whose_results_would_be_lost(statement: Any) -> None:
    """Queries, RETURNING and raw strings are refused with the way out in the message."""
    writes = eop.Writes(session=None)  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigurationError, match=r"writes\.session"):
        writes.add(statement)


async def _takes_writes(msg: eop.Message, writes: eop.Writes) -> None: ...


async def _takes_session(msg: eop.Message, session: AsyncSession) -> None: ...


def _typed_with_writes(msg: eop.Message, writes: eop.Writes, *, extra: int = 0) -> None: ...


def _unannotated(msg, session):  # type: ignore[no-untyped-def]
    ...


@pytest.mark.parametrize(
    ("func", "expected"),
    [
        (_takes_writes, True),
        (_typed_with_writes, True),
        (_takes_session, False),  # AsyncSession is imported under TYPE_CHECKING here
        (_unannotated, False),
    ],
)
def test_the_second_parameter_annotation_decides_writes_or_session(
    func: Any, expected: bool
) -> None:
    """eop.Writes (even unresolvable, by name) gets the queue; anything else the session."""
    spec = HandlerSpec(func=func, name="h", stream="S", subject="s.x", durable="d")
    assert spec.takes_writes is expected


def test_only_statements_needing_nothing_of_sqlalchemy_at_execution_go_to_asyncpg() -> None:
    """eop sends a queued statement on asyncpg itself only when SQLAlchemy's execution would
    add nothing but its bind processors: no Python-side default, no expanding IN; the
    values in the compiled placeholders' order, through the processors SQLAlchemy would
    apply (JSONB's serializer). Every other statement goes through the session."""
    from sqlalchemy.dialects.postgresql import JSONB
    from sqlalchemy.dialects.postgresql import asyncpg as asyncpg_dialect

    from eop.pg import direct

    dialect = asyncpg_dialect.dialect()  # type: ignore[no-untyped-call]
    metadata = sa.MetaData()
    table = sa.Table(
        "t",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("doc", JSONB),
        sa.Column("n", sa.Integer, default=5),
    )
    text = sa.text("INSERT INTO effects (a, b) VALUES (:b, :a)")
    sent = direct.plan(text, dialect, ("a", "b"))
    assert sent is not None
    sql_text, values, _ = sent
    assert sql_text == "INSERT INTO effects (a, b) VALUES ($1, $2)"
    assert values({"a": 1, "b": 2}) == (2, 1)
    assert direct.plan(sa.insert(table), dialect, ("id", "n")) is not None
    with_doc = direct.plan(sa.insert(table), dialect, ("id", "doc", "n"))
    assert with_doc is not None
    assert with_doc[1]({"id": 1, "doc": {"a": [1]}, "n": 2}) == (1, '{"a": [1]}', 2)
    assert direct.plan(sa.insert(table), dialect, ("id",)) is None  # n's default
    expanding = sa.delete(table).where(table.c.id.in_(sa.bindparam("ids", expanding=True)))
    assert direct.plan(expanding, dialect, ("ids",)) is None
    psycopg = sa.create_engine("postgresql+psycopg://x@localhost/x").dialect
    assert direct.plan(text, psycopg, ("a", "b")) is None


@pytest.mark.parametrize(
    ("text", "rows"),
    [
        ("INSERT INTO effects (a, b) VALUES ($1, $2)", True),
        ("insert into s.t (a, b)\nvalues ($1::NUMERIC(10, 2), $2::TIMESTAMP WITH TIME ZONE)", True),
        ("INSERT INTO t VALUES ($1::INTEGER[], $2)", True),
        ("INSERT INTO values_log (a) VALUES ($1)", True),
        ("INSERT INTO t (a) VALUES ($1) ON CONFLICT DO NOTHING", False),
        ("INSERT INTO t (a) VALUES ($1) RETURNING a", False),
        ("INSERT INTO t (a, b) VALUES ($1, now())", False),
        ("INSERT INTO t (a) VALUES ((SELECT count(*) FROM t) + $1)", False),
        ("INSERT INTO t (a, b) VALUES ($2, $1)", False),
        ("INSERT INTO t (a) VALUES ($1), ($2)", False),
        ("INSERT INTO t (a) VALUES ($1);\n", True),
        ("INSERT INTO t (a) VALUES ($1); DELETE FROM t", False),
        ("WITH n AS (SELECT 1) INSERT INTO t (a) VALUES ($1)", False),
        ("UPDATE t SET a = $1 WHERE b = $2", False),
    ],
)
def test_only_an_insert_of_one_row_of_placeholders_is_sent_as_many_rows(
    text: str, rows: bool
) -> None:
    """An INSERT whose VALUES hold one row of placeholders, each once and in order, casts
    allowed, with nothing after it, becomes one statement of many rows; an expression, a
    subquery (which, run row by row, would see the earlier rows), ON CONFLICT, RETURNING
    or anything else keeps the statement a row."""
    from eop.pg import direct

    assert (direct.rows_of(text, text.count("$")) is not None) is rows


def test_many_rows_go_in_pages_of_powers_of_two_numbered_on() -> None:
    """A statement of many rows numbers each row's placeholders after the previous row's;
    rows go in pages whose sizes are powers of two (few statement texts to prepare), none
    with more than asyncpg's 32,767 arguments."""
    from eop.pg import direct

    rows = direct.rows_of("INSERT INTO t (a, b) VALUES ($1, $2::BIGINT)", 2)
    assert rows is not None
    assert (
        rows.text(3)
        == "INSERT INTO t (a, b) VALUES ($1, $2::BIGINT), ($3, $4::BIGINT), ($5, $6::BIGINT)"
    )
    assert rows.pages(64) == [64]
    assert rows.pages(37) == [32, 4, 1]
    assert rows.pages(3000) == [1024, 1024, 512, 256, 128, 32, 16, 8]
    wide = direct.rows_of(
        "INSERT INTO t VALUES (" + ", ".join(f"${i}" for i in range(1, 101)) + ")", 100
    )
    assert wide is not None
    assert wide.most == 256
    assert max(wide.pages(1000)) * 100 <= 32767


def test_a_plain_insert_is_planned_as_many_rows_and_other_writes_are_not() -> None:
    """The plan of a queued text or Core INSERT carries its many-row form; an UPDATE's, or
    an INSERT's with ON CONFLICT, does not (an executemany, a statement a row)."""
    from sqlalchemy.dialects.postgresql import asyncpg as asyncpg_dialect
    from sqlalchemy.dialects.postgresql import insert as pg_insert

    from eop.pg import direct

    dialect = asyncpg_dialect.dialect()  # type: ignore[no-untyped-call]
    table = sa.table("t", sa.column("a", sa.Integer), sa.column("b", sa.Text))
    text = direct.plan(sa.text("INSERT INTO t (a, b) VALUES (:a, :b)"), dialect, ("a", "b"))
    core = direct.plan(sa.insert(table), dialect, ("a", "b"))
    update = direct.plan(sa.update(table).values(b=sa.bindparam("b")), dialect, ("b",))
    upsert = direct.plan(pg_insert(table).on_conflict_do_nothing(), dialect, ("a", "b"))
    assert text is not None
    assert text.rows is not None
    assert core is not None
    assert core.rows is not None
    assert (
        core.rows.text(2)
        == "INSERT INTO t (a, b) VALUES ($1::INTEGER, $2::VARCHAR), ($3::INTEGER, $4::VARCHAR)"
    )
    assert update is not None
    assert update.rows is None
    assert upsert is not None
    assert upsert.rows is None
