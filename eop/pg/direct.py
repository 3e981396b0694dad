"""Queued writes (:class:`eop.Writes`) sent on asyncpg's own connection, past SQLAlchemy.

SQLAlchemy's ``executemany`` builds, processes and reorders every row's
parameters in Python, and reaches the driver through a greenlet hop; for the
INSERT of a typical handler that was most of the cost of its writes. When a
statement, compiled for the session's dialect with the names of its rows'
values, asks nothing more of SQLAlchemy at execution than its bind processors
(no Python-side defaults, no expanding or literal parameters, no schema
translation) and no event listens to the engine, eop hands its SQL and each
row's values, in the compiled order and through those processors, to
asyncpg's ``executemany``: the call SQLAlchemy's adapter makes itself, with
the same text and values (so the same unnamed or cached statements behind a
pooler). Any other statement goes through the session, in order. A driver
error is translated as SQLAlchemy translates it (the same exception classes
and text, parameters hidden as the engine hides them), and a lost connection
is invalidated as SQLAlchemy would.

An INSERT whose only clause after ``VALUES`` is one row of placeholders (a
``text()`` or Core INSERT without ``ON CONFLICT`` or ``RETURNING``) goes out
as one statement of many rows instead (:class:`Rows`): PostgreSQL then
starts its executor once for the rows, not once a row, which was the larger
part of its CPU for a message of eop's default path. Each placeholder still
stands for its own value, in its column, so the values are typed as in the
one-row statement.
"""

from __future__ import annotations

import contextlib
import operator
import re
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc
from sqlalchemy.sql.compiler import SQLCompiler

from eop import log
from eop import writes as writes_mod

if TYPE_CHECKING:
    from sqlalchemy.engine.interfaces import DBAPIModule
    from sqlalchemy.ext.asyncio import AsyncSession


class Rows:
    """An ``INSERT ... VALUES`` of one row of placeholders, written for several rows.

    Rows go out in pages whose sizes are powers of two, at most :attr:`most`:
    a statement's texts stay few (a batch of 64 is one page, of 37 three), so
    asyncpg and PostgreSQL prepare and plan each once a connection.
    """

    __slots__ = ("_head", "_row", "_texts", "_width", "most")

    def __init__(self, head: str, row: str, width: int) -> None:
        self._head = head
        self._row = row
        self._width = width
        self._texts: dict[int, str] = {}
        # asyncpg takes at most 32,767 arguments a statement.
        self.most = 1 << min(10, (32767 // width).bit_length() - 1)

    def pages(self, count: int) -> list[int]:
        """The page sizes that send ``count`` rows, largest first."""
        sizes = []
        while count:
            size = min(self.most, 1 << (count.bit_length() - 1))
            sizes.append(size)
            count -= size
        return sizes

    def text(self, count: int) -> str:
        """The statement for ``count`` rows: the row's placeholders numbered on for each."""
        text = self._texts.get(count)
        if text is None:
            rows = [self._numbered(i * self._width) for i in range(count)]
            text = self._texts[count] = self._head + ", ".join(rows)
        return text

    def _numbered(self, after: int) -> str:
        return _PLACEHOLDER.sub(lambda found: f"${int(found.group(1)) + after}", self._row)


# A placeholder, with a cast of a plain type name as SQLAlchemy compiles one for asyncpg
# ($1::VARCHAR, $2::TIMESTAMP WITH TIME ZONE, $3::NUMERIC(10, 2), $4::INTEGER[]).
_ELEMENT = r"\$(\d+)(?:::[A-Za-z_][A-Za-z0-9_ ]*(?:\(\s*\d+\s*(?:,\s*\d+\s*)?\))?(?:\[\])*)?"
_PLACEHOLDER = re.compile(r"\$(\d+)")
_ONE_ROW = re.compile(
    rf"(?is)(\s*INSERT\s+INTO\s[^$;]*?\sVALUES\s*)(\(\s*{_ELEMENT}(?:\s*,\s*{_ELEMENT})*\s*\))\s*;?\s*"
)


def rows_of(text: str, width: int) -> Rows | None:
    """``text`` as a :class:`Rows` if it is an INSERT of one row of ``width`` placeholders,
    ``$1`` to ``$width`` in order and nothing else, with no clause after it (a ``;`` at
    most); else None.

    A row holding anything else (an expression, a subquery that would see the
    statement's earlier rows when run row by row) or followed by a clause
    (``ON CONFLICT``, ``RETURNING``) keeps the statement as it is.
    """
    found = _ONE_ROW.fullmatch(text)
    if found is None:
        return None
    numbers = [int(n) for n in _PLACEHOLDER.findall(found.group(2))]
    if numbers != list(range(1, width + 1)):
        return None
    return Rows(found.group(1), found.group(2), width)


class Plan(NamedTuple):
    """How eop sends a queued statement's parameter sets on asyncpg."""

    text: str
    """The statement as compiled for asyncpg."""
    values: Callable[[dict[str, Any]], tuple[Any, ...]]
    """A parameter set's values in the order of its placeholders."""
    rows: Rows | None
    """The statement as an INSERT of several rows, or None: an ``executemany``."""


# A plan, or None: not for the driver.
_Plan = Plan | None

_PLANS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, tuple[str, ...]], _Plan]] = (
    weakref.WeakKeyDictionary()
)
"""Plans by statement (held weakly: a statement built per call is not kept alive), then by
dialect and parameter names."""


def plan(statement: sa.Executable, dialect: sa.Dialect, keys: tuple[str, ...]) -> _Plan:
    """How to send ``statement`` with parameter sets named ``keys`` on the driver, or None."""
    try:
        by_keys = _PLANS.setdefault(statement, {})
    except TypeError:  # not weakly referenceable
        return None
    key = (dialect, keys)
    if key not in by_keys:
        by_keys[key] = _compile(statement, dialect, keys)
    return by_keys[key]


def _compile(statement: sa.Executable, dialect: sa.Dialect, keys: tuple[str, ...]) -> _Plan:
    if dialect.driver != "asyncpg" or not isinstance(statement, sa.ClauseElement):
        return None
    if getattr(statement, "_execution_options", None):
        return None
    try:
        compiled = statement.compile(
            dialect=dialect, column_keys=sorted(keys), for_executemany=True
        )
    except sa_exc.SQLAlchemyError:
        return None  # the session raises it, as before
    if not isinstance(compiled, SQLCompiler):
        return None
    names = compiled.positiontup
    if (
        not compiled.positional
        or not names
        or compiled.insert_prefetch
        or compiled.update_prefetch
        or compiled.literal_execute_params
        or compiled.post_compile_params
        or compiled.escaped_bind_names
        or compiled.returning
        or not set(names) <= set(keys)
    ):
        return None
    rows = rows_of(compiled.string, len(names))
    processors = compiled._bind_processors
    if any(name in processors for name in names):
        # What SQLAlchemy's execution does to each value (a bytea column's, the
        # outbox's headers and payload: the DBAPI's Binary). A tuple-typed bind's
        # processors (a sequence) are the session's to apply.
        each: list[tuple[str, Callable[[Any], Any] | None]] = []
        for name in names:
            process = processors.get(name)
            if process is not None and not callable(process):
                return None
            each.append((name, process))
        return Plan(
            compiled.string,
            lambda row: tuple(
                row[name] if process is None else process(row[name]) for name, process in each
            ),
            rows,
        )
    getter = operator.itemgetter(*names)
    if len(names) == 1:
        return Plan(compiled.string, lambda row: (getter(row),), rows)
    return Plan(compiled.string, getter, rows)


# The dialect events of an execution (eop's own engines listen to do_connect only).
_EXECUTION_EVENTS = ("do_executemany", "do_execute", "do_execute_no_params", "handle_error")


def _engine_plain(engine: sa.Engine) -> bool:
    """No event listens to the engine's executions and no option changes its statements."""
    dispatch = engine.dialect.dispatch
    return not (
        getattr(engine, "_has_events", True)
        or any(getattr(dispatch, name, True) for name in _EXECUTION_EVENTS)
        or engine.get_execution_options().get("schema_translate_map")
    )


_EXPLAINED: weakref.WeakSet[Any] = weakref.WeakSet()
"""The binds whose writes were said, once each, to go through the session."""


def _through_session(bind: object) -> None:
    """Say once per engine why none of its writes goes out on asyncpg's connection: a
    listener (an instrumentation, say) costs every ``eop.Writes`` handler SQLAlchemy's
    execution path, which is most of their writes' cost otherwise spared."""
    try:
        if bind in _EXPLAINED:
            return
        _EXPLAINED.add(bind)
    except TypeError:  # not weakly referenceable: said each time would be too often
        return
    if not isinstance(bind, sa.Engine):
        reason = "the session is bound to a connection, not an engine"
    elif bind.get_execution_options().get("schema_translate_map"):
        reason = "the engine translates schemas (schema_translate_map)"
    else:
        reason = "an event listens to the engine's executions (a listener or instrumentation)"
    log.get_logger().info(log.Event.WRITES_THROUGH_SESSION, reason=reason)


async def send(writes: writes_mod.Writes, session: AsyncSession, adapter: Any) -> None:
    """Send the queued writes of ``writes``: on asyncpg's connection (under ``adapter``,
    SQLAlchemy's DBAPI connection of the session's transaction) those it can, in order,
    the rest through the session from the first one it cannot send on."""
    groups = writes.take()
    engine = session.get_bind()
    if not isinstance(engine, sa.Engine) or not _engine_plain(engine):
        _through_session(engine)
        await session.run_sync(writes_mod.send_groups, groups)
        return
    driver = adapter.driver_connection
    for i, (statement, rows) in enumerate(groups):
        sent = plan(statement, engine.dialect, tuple(rows[0]))
        if sent is None or not driver.is_in_transaction():
            await session.run_sync(writes_mod.send_groups, groups[i:])
            return
        text, values, many = sent
        try:
            if many is None or len(rows) == 1:
                await driver.executemany(text, [values(row) for row in rows])
            else:
                start = 0
                for size in many.pages(len(rows)):
                    text = many.text(size)
                    page = rows[start : start + size]
                    await driver.execute(text, *[v for row in page for v in values(row)])
                    start += size
        except Exception as exc:
            error, wrapped = await _translated(exc, text, rows, engine, session, adapter)
            if wrapped is None:
                raise
            raise wrapped from error


async def _translated(
    exc: Exception,
    text: str,
    rows: list[dict[str, Any]],
    engine: sa.Engine,
    session: AsyncSession,
    adapter: Any,
) -> tuple[Exception, sa_exc.StatementError | None]:
    """``exc`` as SQLAlchemy's execution would have raised it: the adapter's DBAPI error and
    the ``sqlalchemy.exc.DBAPIError`` wrapping it (None: raised as it is, not a database
    error); a connection it lost is invalidated."""
    dialect = engine.dialect
    dbapi_error: type[Exception] = dialect.loaded_dbapi.Error
    error: Exception = exc
    try:
        adapter._handle_exception(exc)  # raises the DBAPI's own error for a driver error
    except Exception as raised:
        error = raised
    if not isinstance(error, dbapi_error):
        return exc, None
    # An instance of the DBAPI's Error, as checked above: what the dialect is typed to take.
    lost = bool(dialect.is_disconnect(cast("DBAPIModule.Error", error), adapter, None))
    wrapped = sa_exc.DBAPIError.instance(
        text,
        rows,
        error,
        dbapi_error,
        hide_parameters=engine.hide_parameters,
        connection_invalidated=lost,
        dialect=dialect,
        ismulti=len(rows) > 1,
    )
    if lost:
        with contextlib.suppress(Exception):
            await (await session.connection()).invalidate(wrapped)
    return error, wrapped
