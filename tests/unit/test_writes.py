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
    sql_text, values = sent
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
