"""Which flushes eop writes as queued rows past the unit of work (:mod:`eop.pg.pending`), and
the rows it queues: the unit of work's own values, or no decision of its own at all."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import sqlalchemy as sa
from sqlalchemy import orm

import eop
from eop.pg import pending


class _Base(orm.DeclarativeBase):
    pass


def _stamp() -> datetime.datetime:
    return datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


class Note(_Base):
    """Every kind of column a plain model has: a key given, a server default, a Python
    default, a nullable column, an attribute named apart from its column."""

    __tablename__ = "notes"
    id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, primary_key=True, autoincrement=False)
    body: orm.Mapped[str] = orm.mapped_column(sa.Text)
    state: orm.Mapped[str] = orm.mapped_column(sa.Text, server_default="fresh")
    at: orm.Mapped[datetime.datetime] = orm.mapped_column(
        sa.DateTime(timezone=True), default=_stamp
    )
    remark: orm.Mapped[str | None] = orm.mapped_column(sa.Text, nullable=True)
    kind: orm.Mapped[str] = orm.mapped_column("note_kind", sa.Text, server_default="plain")
    extra: orm.Mapped[Any] = orm.mapped_column(sa.JSON(none_as_null=False), nullable=True)


class Tally(_Base):
    """A row whose key the database makes."""

    __tablename__ = "tallies"
    id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, primary_key=True)
    count: orm.Mapped[int] = orm.mapped_column(sa.Integer)


class Keyless(_Base):
    """A key nothing makes: the object must give it."""

    __tablename__ = "keyless"
    code: orm.Mapped[str] = orm.mapped_column(sa.Text, primary_key=True)


class Parent(_Base):
    __tablename__ = "parents"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    children: orm.Mapped[list[Child]] = orm.relationship()


class Child(_Base):
    __tablename__ = "children"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    parent_id: orm.Mapped[int] = orm.mapped_column(sa.ForeignKey("parents.id"))


class Owner(_Base):
    __tablename__ = "owners"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)


class Pet(_Base):
    """A foreign key and no relationship: the unit of work orders its rows its own way."""

    __tablename__ = "pets"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    owner_id: orm.Mapped[int] = orm.mapped_column(sa.ForeignKey("owners.id"))


class Versioned(_Base):
    __tablename__ = "versioned"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    version: orm.Mapped[int] = orm.mapped_column(sa.Integer)
    __mapper_args__: ClassVar[dict[str, Any]] = {"version_id_col": version}


@dataclasses.dataclass
class Point:
    x: int
    y: int


class Spot(_Base):
    """A composite attribute, whose columns the unit of work fills in from its value."""

    __tablename__ = "spots"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True, autoincrement=False)
    x: orm.Mapped[int] = orm.mapped_column()
    y: orm.Mapped[int] = orm.mapped_column()
    point: orm.Mapped[Point] = orm.composite("x", "y")


class _DataBase(orm.MappedAsDataclass, orm.DeclarativeBase):
    pass


class Card(_DataBase):
    __tablename__ = "cards"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True, autoincrement=False)
    title: orm.Mapped[str] = orm.mapped_column(default="untitled")


@pytest.fixture
def session() -> Iterator[orm.Session]:
    """A session bound to an engine that never connects: :func:`pending.queue` runs no SQL."""
    engine = sa.create_engine("postgresql+psycopg://x@localhost/x")
    with orm.Session(engine) as session:
        yield session


def _queued(session: orm.Session) -> tuple[bool, eop.Writes]:
    writes = eop.Writes(session)
    return pending.queue(session, writes), writes


def test_new_plain_objects_are_queued_with_the_unit_of_works_values(session: orm.Session) -> None:
    """A None is left out (the server default then applies), a column with no value and no
    default is NULL, a type that evaluates None gets it, a Python default and a key the
    database makes are left to the INSERT, the column's key stands for the attribute's;
    the objects leave the session, so its own flush has nothing to do."""
    notes = [
        Note(id=1, body="a"),
        Note(id=2, body="b", state=None, remark="r", kind="k", extra=None),
        Tally(count=3),
        Note(id=3, body="c"),
    ]
    session.add_all(notes)
    done, writes = _queued(session)
    assert done
    groups = writes.take()
    # Table by table, as the unit of work, each in the order added; one group a run of
    # rows with the same columns.
    assert [(g.table.name, rows) for g, rows in groups] == [  # type: ignore[attr-defined]
        ("notes", [{"id": 1, "body": "a", "remark": None}]),
        ("notes", [{"id": 2, "body": "b", "remark": "r", "note_kind": "k", "extra": None}]),
        ("notes", [{"id": 3, "body": "c", "remark": None}]),
        ("tallies", [{"count": 3}]),
    ]
    assert not session.new
    assert all(sa.inspect(note).transient for note in notes)


def test_tables_go_in_the_unit_of_works_order_not_the_order_added(session: orm.Session) -> None:
    """SQLAlchemy's flush orders tables it knows no dependency between by their models'
    module and name, whatever order the objects were added in: so do the queued rows, so
    that a foreign key only the database knows fails (or not) the same on both paths."""
    session.add_all([Tally(count=1), Note(id=1, body="a"), Tally(count=2)])
    done, writes = _queued(session)
    assert done
    tables = [(g.table.name, len(rows)) for g, rows in writes.take()]  # type: ignore[attr-defined]
    assert tables == [("notes", 1), ("tallies", 2)]


def test_rows_of_one_table_and_key_set_go_out_together(session: orm.Session) -> None:
    """Consecutive objects of one model with the same attributes set are one group: one
    statement for the batch."""
    session.add_all([Note(id=i, body=str(i)) for i in range(5)])
    done, writes = _queued(session)
    assert done
    [(_, rows)] = writes.take()
    assert [row["id"] for row in rows] == list(range(5))


@pytest.mark.parametrize(
    "objects",
    [
        pytest.param(lambda: [Parent(id=1)], id="relationship"),
        pytest.param(lambda: [Child(id=1, parent_id=1), Parent(id=1)], id="relationship-after"),
        pytest.param(lambda: [Owner(id=1), Pet(id=1, owner_id=1)], id="foreign-key-between"),
        pytest.param(lambda: [Versioned(id=1)], id="version-counter"),
        pytest.param(lambda: [Spot(id=1, point=Point(1, 2))], id="composite"),
        pytest.param(lambda: [Card(id=1)], id="dataclass"),
        pytest.param(lambda: [Keyless()], id="key-nothing-makes"),
        pytest.param(lambda: [Note(id=1, body=sa.func.upper("a"))], id="sql-expression"),
    ],
)
def test_objects_that_need_the_unit_of_work_leave_the_flush_to_it(
    session: orm.Session, objects: Any
) -> None:
    """A relationship, a foreign key between two new objects' tables, a composite, a version
    counter, a dataclass's defaults, a key left to nothing, a SQL expression as a value:
    nothing is queued and every object stays pending, for SQLAlchemy's flush."""
    made = objects()
    session.add_all([Note(id=99, body="plain"), *made])
    done, writes = _queued(session)
    assert not done
    assert not writes
    assert len(session.new) == len(made) + 1


def test_a_loaded_or_deleted_object_leaves_the_flush_to_the_unit_of_work(
    session: orm.Session,
) -> None:
    """An object in the identity map (loaded, maybe changed) is flushed in order with the
    new ones: the whole flush is SQLAlchemy's."""
    loaded = Note(id=7, body="loaded")
    orm.make_transient_to_detached(loaded)
    session.add(loaded)
    session.add(Note(id=8, body="new"))
    done, writes = _queued(session)
    assert not done
    assert not writes
    session.delete(loaded)
    done, writes = _queued(session)
    assert not done
    assert not writes


@pytest.mark.parametrize(
    ("target", "name"),
    [
        (Note, "before_insert"),
        (Note, "after_insert"),
        (Note, "refresh_flush"),
        (orm.Session, "before_flush"),
        (orm.Session, "after_flush"),
        (orm.Session, "after_flush_postexec"),
        (orm.Session, "pending_to_persistent"),
        (orm.Session, "pending_to_transient"),
        (orm.Session, "after_commit"),
    ],
)
def test_a_listener_of_the_flush_or_the_insert_gets_the_unit_of_work(
    session: orm.Session, target: Any, name: str
) -> None:
    """A mapper's insert events and the session's flush and lifecycle events are owed the
    unit of work: with a listener, nothing is queued."""

    def listener(*args: Any) -> None:
        pass

    sa.event.listen(target, name, listener)
    try:
        session.add(Note(id=1, body="a"))
        done, writes = _queued(session)
    finally:
        sa.event.remove(target, name, listener)
    assert not done
    assert not writes
    assert len(session.new) == 1


def test_a_model_bound_to_another_engine_gets_the_unit_of_work() -> None:
    """A session whose binds send a model to another engine: its rows are not eop's to
    send on the transaction's connection."""
    engine = sa.create_engine("postgresql+psycopg://x@localhost/x")
    other = sa.create_engine("postgresql+psycopg://y@localhost/y")
    with orm.Session(engine, binds={Tally: other}) as session:
        session.add_all([Note(id=1, body="a"), Tally(count=1)])
        done, writes = _queued(session)
    assert not done
    assert not writes


def test_a_shape_is_worked_out_once_a_mapper() -> None:
    """The mapper's decision and its columns are cached, not redone for each flush."""
    mapper = sa.inspect(Note)
    assert pending.shape(mapper) is pending.shape(mapper)
    assert pending.shape(sa.inspect(Parent)) is None
    assert dataclasses.is_dataclass(Card)


def test_a_backref_defined_after_the_shape_was_worked_out_gives_the_flush_back() -> None:
    """A model defined later whose relationship has a backref onto a cached model: that
    model's objects then need the unit of work (which sets their keys from the
    relationship), whatever the cache says."""

    class LaterBase(orm.DeclarativeBase):
        pass

    class Leaf(LaterBase):
        __tablename__ = "leaves"
        id: orm.Mapped[int] = orm.mapped_column(primary_key=True, autoincrement=False)
        tree_id: orm.Mapped[int | None] = orm.mapped_column(sa.ForeignKey("trees.id"))

    engine = sa.create_engine("postgresql+psycopg://x@localhost/x")
    with orm.Session(engine) as session:
        session.add(Leaf(id=1))
        assert _queued(session)[0]
    assert pending.shape(sa.inspect(Leaf)) is not None

    class Tree(LaterBase):
        __tablename__ = "trees"
        id: orm.Mapped[int] = orm.mapped_column(primary_key=True, autoincrement=False)
        leaves: orm.Mapped[list[Leaf]] = orm.relationship(backref="tree")

    assert sa.inspect(Tree).relationships  # configures the mappers: Leaf.tree appears
    with orm.Session(engine) as session:
        session.add(Leaf(id=2))
        done, writes = _queued(session)
    assert not done
    assert not writes
