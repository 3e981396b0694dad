"""What every statement module shares: parameters and conditions of a message's key,
the session timeouts, the msg-id digest, and psycopg text for a statement."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect
from sqlalchemy.sql.compiler import SQLCompiler

from eop.pg import models


@functools.cache
def _psycopg() -> sa.Dialect:
    return psycopg_dialect.dialect()  # type: ignore[no-untyped-call]  # SQLAlchemy leaves it unannotated


def for_psycopg(
    stmt: sa.Executable, params: dict[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """``stmt`` as SQL text with ``%(name)s`` placeholders and its values, ready for a
    psycopg cursor's ``execute`` (or anything that hands both to one, as Django's does).

    ``params`` supplies the values the statement leaves unbound (an outbox row).
    The values go through the bind processing a SQLAlchemy session would give
    them on psycopg (a JSONB column's ``dict`` wrapped as ``Jsonb``), so the
    statement means the same on either path.
    """
    dialect = _psycopg()
    assert isinstance(stmt, sa.ClauseElement), "eop's statements are SQL expressions"
    compiled = stmt.compile(dialect=dialect, compile_kwargs={"render_postcompile": True})
    values = dict(compiled.construct_params(params) or {})
    assert isinstance(compiled, SQLCompiler)
    for name, bind in compiled.binds.items():
        process = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if process is not None and name in values:
            values[name] = process(values[name])
    return compiled.string, values


def in_epoch(c: Any, subscription: str, stream: str, epoch: str) -> tuple[Any, ...]:
    """The conditions selecting one subscription's rows of one stream incarnation.

    ``c`` is the columns of the dead letters, the retries or the watermarks:
    all carry (subscription, stream, stream_epoch). The inbox names them by
    their lane: :func:`in_lane`.
    """
    return (c.subscription == subscription, c.stream == stream, c.stream_epoch == epoch)


Bound = tuple[sa.Executable, dict[str, Any]]
"""A statement built once (per schema) and the values of its bind parameters for one call:
``session.execute(*bound)``. Statements run on every round of a loop (compaction, the
retry poll) are built once, so SQLAlchemy's cache key of each is computed once too. The
parameters' names start with ``p_``: an UPDATE takes a value named as a column for SET."""


def epoch_params(subscription: str, stream: str, epoch: str) -> dict[str, Any]:
    """The values of :func:`in_bound_epoch`'s parameters."""
    return {"p_subscription": subscription, "p_stream": stream, "p_epoch": epoch}


def in_bound_epoch(c: Any) -> tuple[Any, ...]:
    """:func:`in_epoch` with bind parameters ``p_subscription``, ``p_stream``, ``p_epoch``."""
    return (
        c.subscription == sa.bindparam("p_subscription", type_=sa.Text),
        c.stream == sa.bindparam("p_stream", type_=sa.Text),
        c.stream_epoch == sa.bindparam("p_epoch", type_=sa.Text),
    )


def lane_of(t: models.Tables, subscription: Any, stream: Any, epoch: Any) -> Any:
    """The lane of one subscription's stream incarnation: the integer of its watermark row,
    which the inbox is keyed by (docs/design.md, 'The inbox key'). A scalar subquery
    (PostgreSQL reads it once for the statement); NULL before the row exists, so a
    statement naming the lane then finds no inbox row. The arguments are values,
    columns or bind parameters."""
    w = t.watermarks.c
    return (
        sa.select(w.lane)
        .where(w.subscription == subscription, w.stream == stream, w.stream_epoch == epoch)
        # The row is the watermarks' own, never the enclosing statement's.
        .correlate(None)
        .scalar_subquery()
    )


def in_lane(t: models.Tables, subscription: str, stream: str, epoch: str) -> tuple[Any, ...]:
    """:func:`in_epoch` for the inbox: its rows of the lane of ``(subscription, stream, epoch)``."""
    return (t.inbox.c.lane == lane_of(t, subscription, stream, epoch),)


def in_bound_lane(t: models.Tables) -> tuple[Any, ...]:
    """:func:`in_lane` with bind parameters ``p_subscription``, ``p_stream``, ``p_epoch``."""
    return (
        t.inbox.c.lane
        == lane_of(
            t,
            sa.bindparam("p_subscription", type_=sa.Text),
            sa.bindparam("p_stream", type_=sa.Text),
            sa.bindparam("p_epoch", type_=sa.Text),
        ),
    )


def in_bound_inbox_key(t: models.Tables) -> tuple[Any, ...]:
    """One message's inbox row by its key: :func:`in_bound_lane` and ``p_seq``."""
    return (*in_bound_lane(t), t.inbox.c.stream_seq == sa.bindparam("p_seq", type_=sa.BigInteger))


def set_local_timeouts(lock_timeout_ms: int, statement_timeout_ms: int) -> sa.TextClause:
    """``SET LOCAL lock_timeout`` and ``statement_timeout`` for this transaction only.

    ``set_config(..., true)`` is the parameterisable form of ``SET LOCAL``.
    """
    lock, statement = timeout_values(lock_timeout_ms, statement_timeout_ms)
    return sa.text(
        "SELECT set_config('lock_timeout', :lock, true), "
        "set_config('statement_timeout', :stmt, true)"
    ).bindparams(lock=lock, stmt=statement)


def set_local_timeouts_text(lock_timeout_ms: int, statement_timeout_ms: int) -> str:
    """:func:`set_local_timeouts` as plain SQL without parameters, for the asyncpg connection
    under a session: sent as a simple query, it skips SQLAlchemy's execution path."""
    lock, statement = timeout_values(lock_timeout_ms, statement_timeout_ms)
    return (
        f"SELECT set_config('lock_timeout', '{lock}', true), "
        f"set_config('statement_timeout', '{statement}', true)"
    )


def timeout_values(lock_timeout_ms: int, statement_timeout_ms: int) -> tuple[str, str]:
    """The values of ``lock_timeout`` and ``statement_timeout``, as ``set_config`` takes them."""
    return f"{int(lock_timeout_ms)}ms", f"{int(statement_timeout_ms)}ms"


def timeouts_first(lock: str, statement: str) -> str:
    """A condition, always true, that sets the transaction's local timeouts to the values
    of the placeholders ``lock`` and ``statement`` (:func:`timeout_values`).

    A statement that carries it spares the round trip of its own ``SET LOCAL``.
    Its subquery names no column, so PostgreSQL runs it once, as an InitPlan,
    and the condition is a one-time filter: evaluated before the scan it
    guards reads a row, so before the statement locks or waits for any row,
    even when the scan finds none. The tables' own locks are taken before
    execution starts, under the connection's own timeouts.
    """
    return (
        f"(SELECT set_config('lock_timeout', {lock}, true) "
        f"|| set_config('statement_timeout', {statement}, true)) IS NOT NULL"
    )


def commits_unflushed() -> sa.TextClause:
    """A condition, always true, that lets its statement's transaction commit without
    waiting for the WAL to reach the disk: ``synchronous_commit`` off for that
    transaction alone (``set_config(..., true)``), set in an InitPlan as
    :func:`timeouts_first` sets the timeouts, so no round trip of its own.

    Only for a transaction whose loss in a crash harms nothing; the caller says why.
    """
    return sa.text("(SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL")


def waits_for_locks_at_most() -> sa.TextClause:
    """A condition, always true, that bounds its statement's lock waits: ``lock_timeout``
    for that transaction alone, from the bound parameter ``p_lock_wait`` (``'250ms'``),
    set in an InitPlan as :func:`commits_unflushed` sets its setting. The InitPlan runs
    before the statement locks its first row, so the wait for that row is bounded.
    """
    return sa.text("(SELECT set_config('lock_timeout', :p_lock_wait, true)) IS NOT NULL")


class LocalTimeouts(NamedTuple):
    """eop's local timeouts of one transaction, in each form a transaction sends them."""

    statement: sa.TextClause
    """:func:`set_local_timeouts`, for a session."""
    text: str
    """:func:`set_local_timeouts_text`, for a driver's own connection."""
    values: tuple[str, str]
    """:func:`timeout_values`, for a statement that carries :func:`timeouts_first`."""


def local_timeouts(lock_timeout_ms: int, statement_timeout_ms: int) -> LocalTimeouts:
    """eop's local timeouts, ``lock_timeout`` and ``statement_timeout`` in milliseconds."""
    return LocalTimeouts(
        set_local_timeouts(lock_timeout_ms, statement_timeout_ms),
        set_local_timeouts_text(lock_timeout_ms, statement_timeout_ms),
        timeout_values(lock_timeout_ms, statement_timeout_ms),
    )


#: The backend's process id, as PostgreSQL knows it. A pooler answers the
#: protocol's BackendKeyData with a pid of its own (it routes cancel requests),
#: so a difference between the two reveals one (:mod:`eop.pg.engines`).
BACKEND_PID = "SELECT pg_backend_pid()"


def backend_pid() -> sa.TextClause:
    """:data:`BACKEND_PID` as a statement."""
    return sa.text(BACKEND_PID)


# The SHA-256 of a msg-id's UTF-8 bytes. convert_to is only STABLE, so this
# cannot be an index expression: the claim stores it in inbox.msg_id_digest.
DIGEST_SQL = "sha256(convert_to({}, 'UTF8'))"


def msg_id_digest(msg_id: Any) -> sa.ColumnElement[bytes]:
    """The digest the inbox indexes for ``msg_id`` (a column or a value), as the claim computes it.

    Look-ups by msg-id compare this with ``inbox.msg_id_digest``, so that they
    use the guard's unique index, whatever the msg-id's length.
    """
    value = msg_id if isinstance(msg_id, sa.ColumnElement) else sa.literal(msg_id, sa.Text)
    return sa.func.sha256(
        sa.func.convert_to(value, sa.literal_column("'UTF8'")), type_=sa.LargeBinary
    )


def key_params(subscription: str, stream: str, epoch: str, seq: int) -> dict[str, Any]:
    """The values of :func:`in_bound_key`'s parameters."""
    return {**epoch_params(subscription, stream, epoch), "p_seq": seq}


def in_bound_key(c: Any) -> tuple[Any, ...]:
    """One message's row by its key: :func:`in_bound_epoch` and ``p_seq``."""
    return (*in_bound_epoch(c), c.stream_seq == sa.bindparam("p_seq", type_=sa.BigInteger))


# health (obs): the readiness probe's ping of an idle worker
def ping() -> sa.Select[tuple[int]]:
    """``SELECT 1``: the database answers."""
    return sa.select(sa.literal(1))
