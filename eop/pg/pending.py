"""A flush's new ORM objects written as queued rows, past SQLAlchemy's unit of work.

Most ORM handlers only add objects (``session.add(Invoice(...))``). eop
flushes a batch's objects once, after its handlers ran and before COMMIT,
and then commits and closes the session. SQLAlchemy's unit of work still
sorts them, builds each row's parameters, reads keys the database makes
back and registers every object as persistent: a third of an async ORM
message's instructions, for objects nobody reads again.

When that flush holds only new objects that ask nothing of the unit of work
(:func:`shape`, :func:`queue`), eop queues each one's row on the
transaction's :class:`eop.Writes`, with the values and the rules the unit of
work would have used for its INSERT (a None left to the server default, a
column with neither a value nor a default sent as NULL, Python defaults
applied by the INSERT), in the unit of work's order, then takes the objects
out of the session. So they end transient, not detached,
and a key the database made is not read back onto them: a handler that
needs it flushes first (``await session.flush()``), which is SQLAlchemy's
flush as before. Anything else leaves the whole flush to SQLAlchemy: an
object loaded or deleted in the session, a relationship, an inheritance, a
version counter, a dataclass model, a SQL expression as a value, a key
nothing makes, two new objects' tables joined by a foreign key, a mapper
bound to another engine, or a listener of the insert (``refresh_flush``
included), of the flush, of the objects' passage through the session or of
the commit.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.orm import exc as orm_exc

if TYPE_CHECKING:
    from sqlalchemy.orm import Mapper, Session

    from eop.writes import Writes

# Session events a flush or an object leaving the session would fire, and after_commit,
# where a listener may read what the flush read back: their listeners are owed the unit
# of work. (eop's outbox listens to other events of the session.)
_SESSION_EVENTS = (
    "before_flush",
    "after_flush",
    "after_flush_postexec",
    "pending_to_persistent",
    "pending_to_transient",
    "before_attach",
    "after_attach",
    "after_commit",
)


class Shape(NamedTuple):
    """How a mapper's new object becomes a row of its table's INSERT."""

    insert: sa.Insert
    """``INSERT INTO`` the table: one object a mapper, so that its rows go out together."""
    columns: tuple[tuple[str, str, bool], ...]
    """For each mapped column: its attribute's key, its column's key, and whether None is
    a value to send (the type evaluates None) rather than a value left out."""
    as_none: tuple[str, ...]
    """Columns sent as NULL when the object has no value for them, as the unit of work
    does: no key part, no default of either side, a type that does not evaluate None."""
    key_needed: tuple[str, ...]
    """Key columns with nothing to make their value: the object must give it."""
    order: str
    """Where the unit of work puts the table's rows among those of tables it knows no
    dependency between: by its model's module and name."""


_SHAPES: weakref.WeakKeyDictionary[Mapper[Any], Shape | None] = weakref.WeakKeyDictionary()


def shape(mapper: Mapper[Any]) -> Shape | None:
    """``mapper``'s :class:`Shape`, or None when its objects need the unit of work: a table
    of its own (no inheritance, no join, no polymorphism), no relationship, no composite,
    no version counter, not a dataclass (whose ORM-level defaults the unit of work
    applies)."""
    try:
        return _SHAPES[mapper]
    except KeyError:
        pass
    found = _SHAPES[mapper] = _shape(mapper)
    return found


def _shape(mapper: Mapper[Any]) -> Shape | None:
    table = mapper.local_table
    if (
        not isinstance(table, sa.Table)
        or mapper.persist_selectable is not table
        or mapper.inherits is not None
        or mapper.polymorphic_on is not None
        or mapper.relationships
        or mapper.composites
        or mapper.version_id_col is not None
        or dataclasses.is_dataclass(mapper.class_)
    ):
        return None
    columns = []
    for column in table.columns:
        try:
            prop = mapper.get_property_by_column(column)
        except orm_exc.UnmappedColumnError:
            continue
        columns.append((prop.key, column.key, bool(column.type.should_evaluate_none)))
    mapped = {key for _, key, _ in columns}
    as_none = tuple(
        column.key
        for column in table.columns
        if column.key in mapped
        and not column.primary_key
        and column.server_default is None
        and column.default is None
        and not column.type.should_evaluate_none
    )
    key_needed = tuple(
        column.key
        for column in table.primary_key.columns
        if column.default is None
        and column.server_default is None
        and column is not table.autoincrement_column
    )
    # inline(): a row alone would otherwise read its key back (RETURNING), unread here.
    order = f"{mapper.class_.__module__}.{mapper.class_.__name__}"
    return Shape(sa.insert(table).inline(), tuple(columns), as_none, key_needed, order)


def queue(session: Session, writes: Writes) -> bool:
    """Queue ``session``'s new objects as rows on ``writes`` and take them out of the session,
    when they are all its flush holds and none needs the unit of work; whether it did.

    As the unit of work orders them: table by table, tables by their models' module and
    name (no table here refers to another's rows, :func:`_refer`), and in each table the
    objects in the order they were added.
    """
    if session.identity_map or session.deleted:
        return False  # loaded objects: changed ones are flushed with the new, in order
    dispatch = session.dispatch
    if any(getattr(dispatch, name) for name in _SESSION_EVENTS):
        return False
    bind = session.bind
    if bind is None:
        return False
    tables: dict[Mapper[Any], tuple[Shape, list[dict[str, Any]]]] = {}
    for obj in session.new:
        state = sa.inspect(obj)
        mapper = state.mapper
        table = tables.get(mapper)
        if table is None:
            found = shape(mapper)
            if (
                found is None
                # A backref a model defined since gives this mapper a relationship.
                or mapper.relationships
                or mapper.dispatch.before_insert
                or mapper.dispatch.after_insert
                or mapper.class_manager.dispatch.refresh_flush
                or session.get_bind(mapper) is not bind
            ):
                return False
            table = tables[mapper] = (found, [])
        row = _row(table[0], state.dict)
        if row is None:
            return False
        table[1].append(row)
    if len(tables) > 1 and _refer([found for found, _ in tables.values()]):
        return False
    for found, rows in sorted(tables.values(), key=lambda table: table[0].order):
        for row in rows:
            writes.add(found.insert, row)
    session.expunge_all()
    return True


def _refer(shapes: list[Shape]) -> bool:
    """Whether a table of ``shapes`` has a foreign key to another's rows: the unit of work
    orders such tables by the relationships between them, which these mappers have none
    of, so their order is the unit of work's to make, not eop's."""
    tables = {found.insert.table for found in shapes}
    return any(
        key.column.table in tables and key.column.table is not table
        for table in tables
        for key in getattr(table, "foreign_keys", ())
    )


def _row(found: Shape, values: dict[str, Any]) -> dict[str, Any] | None:
    """The INSERT's parameters for an object whose attributes are ``values``, by the unit of
    work's rules: a None is left out unless the type evaluates it, a column with no value
    and nothing to make one is NULL. None when a value is a SQL expression or a key
    column is left without one (the unit of work says why)."""
    row: dict[str, Any] = {}
    for attribute, column, evaluates_none in found.columns:
        if attribute in values:
            value = values[attribute]
            if value is None and not evaluates_none:
                continue
            if isinstance(value, sa.ClauseElement) or hasattr(value, "__clause_element__"):
                return None
            row[column] = value
    for column in found.as_none:
        row.setdefault(column, None)
    for column in found.key_needed:
        if column not in row:
            return None
    return row
