"""All of eop's SQL, in one place.

Statements are built with SQLAlchemy Core from :mod:`eop.pg.models`, so they
follow the configured schema and run unchanged on async and sync sessions;
:func:`for_psycopg` turns one into text and values for a psycopg cursor that
no SQLAlchemy session owns (Django's, in :mod:`eop.contrib.django`).
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
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


def _in_epoch(c: Any, subscription: str, stream: str, epoch: str) -> tuple[Any, ...]:
    """The conditions selecting one subscription's rows of one stream incarnation.

    ``c`` is the columns of the inbox, the dead letters or the watermarks:
    all carry (subscription, stream, stream_epoch).
    """
    return (c.subscription == subscription, c.stream == stream, c.stream_epoch == epoch)


Bound = tuple[sa.Executable, dict[str, Any]]
"""A statement built once (per schema) and the values of its bind parameters for one call:
``session.execute(*bound)``. Statements run on every round of a loop (compaction, the
retry poll) are built once, so SQLAlchemy's cache key of each is computed once too. The
parameters' names start with ``p_``: an UPDATE takes a value named as a column for SET."""


def _epoch_params(subscription: str, stream: str, epoch: str) -> dict[str, Any]:
    """The values of :func:`_in_bound_epoch`'s parameters."""
    return {"p_subscription": subscription, "p_stream": stream, "p_epoch": epoch}


def _in_bound_epoch(c: Any) -> tuple[Any, ...]:
    """:func:`_in_epoch` with bind parameters ``p_subscription``, ``p_stream``, ``p_epoch``."""
    return (
        c.subscription == sa.bindparam("p_subscription", type_=sa.Text),
        c.stream == sa.bindparam("p_stream", type_=sa.Text),
        c.stream_epoch == sa.bindparam("p_epoch", type_=sa.Text),
    )


def set_local_timeouts(lock_timeout_ms: int, statement_timeout_ms: int) -> sa.TextClause:
    """``SET LOCAL lock_timeout`` and ``statement_timeout`` for this transaction only.

    ``set_config(..., true)`` is the parameterisable form of ``SET LOCAL``.
    """
    return sa.text(
        "SELECT set_config('lock_timeout', :lock, true), "
        "set_config('statement_timeout', :stmt, true)"
    ).bindparams(lock=f"{lock_timeout_ms}ms", stmt=f"{statement_timeout_ms}ms")


#: The backend's process id, as PostgreSQL knows it. A pooler answers the
#: protocol's BackendKeyData with a pid of its own (it routes cancel requests),
#: so a difference between the two reveals one (:mod:`eop.pg.engines`).
BACKEND_PID = "SELECT pg_backend_pid()"


def backend_pid() -> sa.TextClause:
    """:data:`BACKEND_PID` as a statement."""
    return sa.text(BACKEND_PID)


def set_local_timeouts_text(lock_timeout_ms: int, statement_timeout_ms: int) -> str:
    """:func:`set_local_timeouts` as plain SQL without parameters, for the asyncpg connection
    under a session: sent as a simple query, it skips SQLAlchemy's execution path."""
    return (
        f"SELECT set_config('lock_timeout', '{int(lock_timeout_ms)}ms', true), "
        f"set_config('statement_timeout', '{int(statement_timeout_ms)}ms', true)"
    )


# The SHA-256 of a msg-id's UTF-8 bytes. convert_to is only STABLE, so this
# cannot be an index expression: the claim stores it in inbox.msg_id_digest.
_DIGEST_SQL = "sha256(convert_to({}, 'UTF8'))"


def msg_id_digest(msg_id: Any) -> sa.ColumnElement[bytes]:
    """The digest the inbox indexes for ``msg_id`` (a column or a value), as the claim computes it.

    Look-ups by msg-id compare this with ``inbox.msg_id_digest``, so that they
    use the guard's unique index, whatever the msg-id's length.
    """
    value = msg_id if isinstance(msg_id, sa.ColumnElement) else sa.literal(msg_id, sa.Text)
    return sa.func.sha256(
        sa.func.convert_to(value, sa.literal_column("'UTF8'")), type_=sa.LargeBinary
    )


# The claim's parameters, in order: (name, SQLAlchemy type, PostgreSQL type).
# A batch shares its subscription, stream and outcome: those are scalars. Each
# row has its own sequence and fingerprint: those are arrays. The other columns
# are usually the same for the whole batch (one epoch, one subject, a first
# delivery, no msg-id when the guard is off), so each is a pair: a scalar that
# holds the batch's value when every row has it (the array then empty), else
# NULL beside the array of every row's value (see :func:`claim_arguments`).
# asyncpg checks every array element against three ABCs before encoding it,
# which made nine arrays of a batch's values most of the claim's client cost.
_CLAIM_SCALARS = (
    ("subscription", sa.Text, "text"),
    ("stream", sa.Text, "text"),
    ("outcome", sa.Text, "text"),
)
_CLAIM_ARRAYS = (
    ("stream_seq", sa.BigInteger, "bigint"),
    ("fingerprint", sa.LargeBinary, "bytea"),
)
_CLAIM_SHARED = (
    ("stream_epoch", sa.Text, "text"),
    ("subject", sa.Text, "text"),
    ("delivery_count", sa.Integer, "integer"),
    ("msg_id", sa.Text, "text"),
)
_CLAIM_PARAMS: tuple[tuple[str, Any, str], ...] = (
    *_CLAIM_SCALARS,
    *((name, postgresql.ARRAY(kind), f"{pg}[]") for name, kind, pg in _CLAIM_ARRAYS),
    *(
        param
        for name, kind, pg in _CLAIM_SHARED
        for param in ((name, kind, pg), (f"{name}_each", postgresql.ARRAY(kind), f"{pg}[]"))
    ),
)

CLAIM_PARAMS: tuple[str, ...] = tuple(name for name, _, _ in _CLAIM_PARAMS)
"""The claim's parameters, in the order of :func:`claim_arguments` (and of
:func:`claim_driver_text`'s placeholders)."""


def claim_arguments(
    subscription: str,
    stream: str,
    outcome: str,
    seqs: list[int],
    fingerprints: list[bytes],
    epochs: list[str],
    subjects: list[str],
    delivery_counts: list[int],
    msg_ids: list[str | None],
) -> tuple[Any, ...]:
    """The claim's parameter values for a batch, one list per column, in :data:`CLAIM_PARAMS`
    order: a column whose rows all hold one value is sent as that scalar."""
    return (
        subscription,
        stream,
        outcome,
        seqs,
        fingerprints,
        *_shared_or_each(epochs),
        *_shared_or_each(subjects),
        *_shared_or_each(delivery_counts),
        *_shared_or_each(msg_ids),
    )


def _shared_or_each(values: list[Any]) -> tuple[Any, list[Any]]:
    """``(value, [])`` when every one of ``values`` is ``value``, else ``(None, values)``.

    The claim reads a row's value as ``COALESCE(each, shared)``: the array,
    shorter than the others, is padded with NULLs by ``unnest``.
    """
    # list.count compares in C: cheaper than encoding the array it may spare.
    if values and values.count(values[0]) == len(values):
        return values[0], []
    return None, values


def claim(t: models.Tables, arguments: tuple[Any, ...]) -> sa.TextClause:
    """Insert the inbox rows whose key (or msg-id) is free and which lie above the watermark.

    One statement for a whole batch, its rows passed as arrays and shared
    values (``arguments``, from :func:`claim_arguments`): the SQL text never
    changes with the batch, so it is compiled and prepared once. RETURNING
    names the claimed sequences. A concurrent transaction holding one of the
    keys makes this wait on the unique index until that one ends: then that
    row is not inserted.

    The watermark is read FOR SHARE: compaction raises it (an UPDATE of that
    row) only once no claim that read the old value is still open, and deletes
    rows only after that, so no claim can slip between the raise and the delete.
    """
    return _claim_text(t.schema).bindparams(
        *(
            sa.bindparam(name, value, type_=kind)
            for (name, kind, _), value in zip(_CLAIM_PARAMS, arguments, strict=True)
        )
    )


@functools.cache
def _claim_text(schema: str) -> sa.TextClause:
    return sa.text(
        _claim_sql(schema, {name: f"CAST(:{name} AS {pg})" for name, _, pg in _CLAIM_PARAMS})
    )


def _claim_sql(schema: str, p: dict[str, str]) -> str:
    """The claim statement, ``p`` naming each of :data:`CLAIM_PARAMS`'s placeholders.

    The msg-id guard's unique index holds the msg-id's digest (:func:`msg_id_digest`),
    computed here so that every claim, whatever its caller, fills it in; a
    taken digest is a conflict that ON CONFLICT DO NOTHING skips.
    """
    row_names = [name for name, _, _ in (*_CLAIM_ARRAYS, *_CLAIM_SHARED)]
    arrays = ", ".join(
        [p[name] for name, _, _ in _CLAIM_ARRAYS]
        + [p[f"{name}_each"] for name, _, _ in _CLAIM_SHARED]
    )
    values = {name: p[name] for name, _, _ in _CLAIM_SCALARS}
    values.update({name: f"i.{name}" for name, _, _ in _CLAIM_ARRAYS})
    values.update({name: f"COALESCE(i.{name}, {p[name]})" for name, _, _ in _CLAIM_SHARED})
    columns = [name for name, _, _ in (*_CLAIM_SCALARS, *_CLAIM_ARRAYS, *_CLAIM_SHARED)]
    # The schema name is checked to be an identifier by Settings; quoting keeps
    # it literal.
    return (
        f'INSERT INTO "{schema}".inbox ({", ".join(columns)}, msg_id_digest) '
        f"SELECT {', '.join(values[c] for c in columns)}, "
        f"{_DIGEST_SQL.format(values['msg_id'])} "
        f"FROM unnest({arrays}) AS i({', '.join(row_names)}) "
        "WHERE i.stream_seq > COALESCE(("
        f'SELECT w.watermark FROM "{schema}".watermarks AS w '
        f"WHERE w.subscription = {values['subscription']} AND w.stream = {values['stream']} "
        f"AND w.stream_epoch = {values['stream_epoch']} FOR SHARE), 0) "
        "ON CONFLICT DO NOTHING RETURNING stream_seq"
    )


# Throughput: the batch claim on the driver's own connection.


@functools.cache
def claim_driver_text(schema: str) -> str:
    """:func:`claim` as plain SQL for the asyncpg connection under the session.

    The same statement, with positional parameters in the order of
    :data:`CLAIM_PARAMS`: passing the values straight to the driver skips
    SQLAlchemy's per-element bind processing of the arrays.
    """
    return _claim_sql(
        schema, {name: f"${i}::{pg}" for i, (name, _, pg) in enumerate(_CLAIM_PARAMS, 1)}
    )


@functools.cache
def claim_pyformat_text(schema: str) -> str:
    """:func:`claim` as plain SQL with psycopg's named placeholders (``%(name)s``), for the
    psycopg connection under a sync session; its values come from
    :func:`claim_pyformat_parameters`."""
    return _claim_sql(schema, {name: f"CAST(%({name})s AS {pg})" for name, _, pg in _CLAIM_PARAMS})


def claim_pyformat_parameters(arguments: tuple[Any, ...]) -> dict[str, Any]:
    """:func:`claim_arguments`' values by name for :func:`claim_pyformat_text`, each array
    as the text of a PostgreSQL array, which the statement casts.

    psycopg adapts a list element by element in Python: the claim's two arrays
    of a 64-message batch cost 30,000 instructions a message (callgrind); with
    the text made here the whole sync claim costs 41,000. An array holding a
    NULL (a batch mixing messages with and without a msg-id) stays a list: an
    unquoted ``NULL`` in an array's text means NULL only while the server's
    ``array_nulls`` is on.
    """
    params = dict(zip(CLAIM_PARAMS, arguments, strict=True))
    for name, value in params.items():
        if isinstance(value, list) and value and None not in value:
            params[name] = _array_text(value)
    return params


def _array_text(values: list[Any]) -> str:
    """The text of a one-dimensional PostgreSQL array of ``values``: all ints, all bytes
    (bytea, as hex) or all str (quoted, ``\\`` and ``"`` escaped)."""
    first = values[0]
    if isinstance(first, int):
        items = list(map(str, values))
    elif isinstance(first, bytes):
        # "\\x..." is \x... once the array's own escapes are read: bytea's hex input.
        items = ['"\\\\x' + v.hex() + '"' for v in values]
    else:
        items = ['"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values]
    return "{" + ",".join(items) + "}"


def watermark(t: models.Tables, subscription: str, stream: str, epoch: str) -> sa.Select[int]:
    """The watermark of a subscription on one stream epoch."""
    w = t.watermarks.c
    return sa.select(w.watermark).where(*_in_epoch(w, subscription, stream, epoch))


def create_watermark(t: models.Tables, subscription: str, stream: str, epoch: str) -> sa.Insert:
    """Make sure the watermark row exists (at 0), so raising it is always an UPDATE.

    RETURNING yields a row only when this call created it.
    """
    return (
        postgresql.insert(t.watermarks)
        .values(subscription=subscription, stream=stream, stream_epoch=epoch, watermark=0)
        .on_conflict_do_nothing()
        .returning(t.watermarks.c.watermark)
    )


def lock_inbox_shared(t: models.Tables) -> sa.TextClause:
    """A SHARE lock on the inbox table: granted once every transaction writing to it ended.

    New claims wait behind it, so it is taken only with a short lock timeout
    and released at once (see :meth:`eop.protocol.compaction.Compactor.prepare`).
    """
    return sa.text(f'LOCK TABLE "{t.schema}".inbox IN SHARE MODE')


def advance_watermark(
    t: models.Tables, subscription: str, stream: str, epoch: str, value: int
) -> Bound:
    """Raise the watermark to ``value``; it never goes backwards. RETURNING the new value."""
    return _advance_watermark(t), {**_epoch_params(subscription, stream, epoch), "p_value": value}


@functools.cache
def _advance_watermark(t: models.Tables) -> sa.Executable:
    w = t.watermarks.c
    value = sa.bindparam("p_value", type_=sa.BigInteger)
    return (
        sa.update(t.watermarks)
        .where(*_in_bound_epoch(w))
        .values(watermark=sa.func.greatest(w.watermark, value), updated_at=sa.func.now())
        .returning(w.watermark)
    )


def delete_below_watermark(
    t: models.Tables,
    subscription: str,
    stream: str,
    epoch: str,
    value: int,
    limit: int,
    msg_id_retention_s: float,
    after: int = 0,
) -> Bound:
    """Delete up to ``limit`` inbox rows above ``after`` and at or below ``value`` (one
    bounded chunk).

    Rows carrying a msg-id stay for ``msg_id_retention_s``: they are the guard
    against a republish after the server's duplicate window. ``after`` bounds
    the index scan from below: the entries of deleted rows stay in the primary
    key's index until a VACUUM, and a scan from the epoch's first sequence
    walks all of them (docs/design.md, 'The watermark').
    """
    params = {
        **_epoch_params(subscription, stream, epoch),
        "p_after": after,
        "p_value": value,
        "p_limit": limit,
        "p_retention_s": msg_id_retention_s,
    }
    return _delete_below_watermark(t), params


@functools.cache
def _delete_below_watermark(t: models.Tables) -> sa.Executable:
    c = t.inbox.c
    retention_s = sa.bindparam("p_retention_s", type_=sa.Float)
    cutoff = sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, retention_s)
    chunk: sa.Select[Any] = (
        sa.select(sa.literal_column("ctid"))
        .select_from(t.inbox)
        .where(
            *_in_bound_epoch(c),
            c.stream_seq > sa.bindparam("p_after", type_=sa.BigInteger),
            c.stream_seq <= sa.bindparam("p_value", type_=sa.BigInteger),
            sa.or_(c.msg_id.is_(None), c.processed_at < cutoff),
            # A retrying row was acked (the ack floor passed it) but has no outcome:
            # it is the claim of a retry held in the retries table.
            c.outcome != models.OUTCOME_RETRYING,
        )
        .limit(sa.bindparam("p_limit", type_=sa.Integer))
    )
    # No RETURNING: the worker needs the count only (rowcount), not a row per deleted row.
    return sa.delete(t.inbox).where(
        sa.literal_column("ctid") == sa.any_(sa.func.array(chunk.scalar_subquery()))
    )


def _key_params(subscription: str, stream: str, epoch: str, seq: int) -> dict[str, Any]:
    """The values of :func:`_in_bound_key`'s parameters."""
    return {**_epoch_params(subscription, stream, epoch), "p_seq": seq}


def _in_bound_key(c: Any) -> tuple[Any, ...]:
    """One message's row by its key: :func:`_in_bound_epoch` and ``p_seq``."""
    return (*_in_bound_epoch(c), c.stream_seq == sa.bindparam("p_seq", type_=sa.BigInteger))


def unclaim(t: models.Tables, subscription: str, stream: str, epoch: str, seq: int) -> Bound:
    """Drop a claim made earlier in this transaction (its handler failed in a batch)."""
    return _unclaim(t), _key_params(subscription, stream, epoch, seq)


@functools.cache
def _unclaim(t: models.Tables) -> sa.Executable:
    c = t.inbox.c
    return sa.delete(t.inbox).where(*_in_bound_key(c)).returning(c.stream_seq)


def find_by_key(t: models.Tables, subscription: str, stream: str, epoch: str, seq: int) -> Bound:
    """The fingerprint and outcome stored under an inbox key."""
    return _find_by_key(t), _key_params(subscription, stream, epoch, seq)


@functools.cache
def _find_by_key(t: models.Tables) -> sa.Executable:
    c = t.inbox.c
    return sa.select(c.fingerprint, c.outcome).where(*_in_bound_key(c))


def find_by_keys(
    t: models.Tables, subscription: str, stream: str, epoch: str, seqs: list[int]
) -> sa.Select[tuple[int, bytes, str]]:
    """The sequence, fingerprint and outcome of each of ``seqs`` the inbox holds (one query)."""
    c = t.inbox.c
    return sa.select(c.stream_seq, c.fingerprint, c.outcome).where(
        *_in_epoch(c, subscription, stream, epoch),
        c.stream_seq == sa.any_(sa.literal(seqs, postgresql.ARRAY(sa.BigInteger))),
    )


def find_by_msg_id(t: models.Tables, subscription: str, msg_id: str) -> Bound:
    """The key and outcome of the message this subscription processed with ``msg_id``."""
    return _find_by_msg_id(t), {"p_subscription": subscription, "p_msg_id": msg_id}


@functools.cache
def _find_by_msg_id(t: models.Tables) -> sa.Executable:
    c = t.inbox.c
    return sa.select(c.stream, c.stream_epoch, c.stream_seq, c.outcome).where(
        c.subscription == sa.bindparam("p_subscription", type_=sa.Text),
        c.msg_id_digest == msg_id_digest(sa.bindparam("p_msg_id", type_=sa.Text)),
    )


def find_dead_letter(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int, fingerprint: bytes
) -> Bound:
    """The id of the dead letter recorded for one message (key and fingerprint)."""
    params = _key_params(subscription, stream, epoch, seq)
    return _find_dead_letter(t), {**params, "p_fingerprint": fingerprint}


@functools.cache
def _find_dead_letter(t: models.Tables) -> sa.Executable:
    c = t.dead_letters.c
    fingerprint = sa.bindparam("p_fingerprint", type_=sa.LargeBinary)
    return sa.select(c.id).where(*_in_bound_key(c), c.fingerprint == fingerprint)


_DEAD_LETTER_COLUMNS = (
    "subscription",
    "stream",
    "stream_epoch",
    "stream_seq",
    "fingerprint",
    "msg_id",
    "subject",
    "headers",
    "payload",
    "reason",
    "error",
    "traceback",
    "delivery_count",
)


def insert_dead_letter(t: models.Tables, row: dict[str, Any]) -> Bound:
    """Record a dead letter (``row``: a value for each of its columns the protocol sets); a
    second one for the same message is dropped."""
    if row.keys() != set(_DEAD_LETTER_COLUMNS):
        raise ValueError(f"a dead letter row has exactly the columns {_DEAD_LETTER_COLUMNS}")
    return _insert_dead_letter(t), {f"p_{name}": value for name, value in row.items()}


@functools.cache
def _insert_dead_letter(t: models.Tables) -> sa.Executable:
    c = t.dead_letters.c
    values = {name: sa.bindparam(f"p_{name}", type_=c[name].type) for name in _DEAD_LETTER_COLUMNS}
    return postgresql.insert(t.dead_letters).values(values).on_conflict_do_nothing().returning(c.id)


# --- Dead letters (`eop dlq`) and handler status (`eop status`) -------------


def dead_letter_where(
    t: models.Tables,
    *,
    ids: Sequence[int] = (),
    handler: str | None = None,
    reason: str | None = None,
    since: datetime.datetime | None = None,
    until: datetime.datetime | None = None,
) -> list[sa.ColumnElement[bool]]:
    """The conditions selecting dead letters: by id, handler, reason or error text, time.

    ``reason`` matches as a case-insensitive substring of the reason or the
    error, its ``%`` and ``_`` taken literally.
    """
    c = t.dead_letters.c
    where: list[sa.ColumnElement[bool]] = []
    if ids:
        where.append(c.id.in_(list(ids)))
    if handler is not None:
        where.append(c.subscription == handler)
    if reason:
        pattern = "%" + reason.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        where.append(
            sa.or_(c.reason.ilike(pattern, escape="\\"), c.error.ilike(pattern, escape="\\"))
        )
    if since is not None:
        where.append(c.created_at >= since)
    if until is not None:
        where.append(c.created_at < until)
    return where


def select_dead_letters(
    t: models.Tables, where: Sequence[sa.ColumnElement[bool]], limit: int | None = None
) -> sa.Select[Any]:
    """Dead letters matching ``where``, newest first: every column but the payload, its size."""
    c = t.dead_letters.c
    columns = [col for col in t.dead_letters.columns if col.name != "payload"]
    stmt = (
        sa.select(*columns, sa.func.octet_length(c.payload).label("payload_size"))
        .where(*where)
        .order_by(c.id.desc())
    )
    return stmt.limit(limit) if limit is not None else stmt


def dead_letter_ids(t: models.Tables, where: Sequence[sa.ColumnElement[bool]]) -> sa.Select[Any]:
    """The ids of the dead letters matching ``where``, oldest first (replay order)."""
    c = t.dead_letters.c
    return sa.select(c.id).where(*where).order_by(c.id)


def lock_dead_letter(t: models.Tables, dead_letter_id: int) -> sa.Select[Any]:
    """One whole dead letter, payload included, locked until the transaction ends.

    Concurrent replays of one dead letter queue here, so each sees the
    bookkeeping the one before it committed.
    """
    return sa.select(t.dead_letters).where(t.dead_letters.c.id == dead_letter_id).with_for_update()


def dead_letter_payload(t: models.Tables, dead_letter_id: int) -> sa.Select[Any]:
    """The payload of one dead letter."""
    c = t.dead_letters.c
    return sa.select(c.payload).where(c.id == dead_letter_id)


def start_replay(
    t: models.Tables,
    dead_letter_id: int,
    *,
    generation: int,
    mode: str,
    msg_id: str | None,
    done: bool,
) -> sa.Executable:
    """Record a new replay generation: its intent (and, when ``done``, its completion)."""
    values: dict[str, Any] = {
        "replay_generation": generation,
        "replay_mode": mode,
        "replay_msg_id": msg_id,
        "replay_requested_at": sa.func.now(),
        "replayed_at": sa.func.now() if done else None,
        "replay_stream_seq": None,
    }
    c = t.dead_letters.c
    return sa.update(t.dead_letters).where(c.id == dead_letter_id).values(values).returning(c.id)


def finish_replay(t: models.Tables, dead_letter_id: int, msg_id: str, stream_seq: int) -> sa.Update:
    """Mark a published replay done; matches nothing if another run finished it first."""
    c = t.dead_letters.c
    return (
        sa.update(t.dead_letters)
        .where(c.id == dead_letter_id, c.replay_msg_id == msg_id, c.replayed_at.is_(None))
        .values(replayed_at=sa.func.now(), replay_stream_seq=stream_seq)
        .returning(c.id)
    )


def settle_rerun_inbox(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int, fingerprint: bytes
) -> sa.Executable:
    """A dead-lettered inbox row becomes processed once a rerun of its handler commits.

    Matching the fingerprint leaves alone the row of another message that
    reused the sequence (a quarantined dead letter); a compacted row is simply
    not there.
    """
    c = t.inbox.c
    return (
        sa.update(t.inbox)
        .where(
            *_in_epoch(c, subscription, stream, epoch),
            c.stream_seq == seq,
            c.fingerprint == fingerprint,
            c.outcome == models.OUTCOME_DEAD_LETTERED,
        )
        .values(outcome=models.OUTCOME_PROCESSED, processed_at=sa.func.now())
        .returning(c.stream_seq)
    )


def purge_dead_letters(t: models.Tables, where: Sequence[sa.ColumnElement[bool]]) -> sa.Executable:
    """Delete the dead letters matching ``where``; RETURNING their ids."""
    return sa.delete(t.dead_letters).where(*where).returning(t.dead_letters.c.id)


def count_dead_letters(t: models.Tables, where: Sequence[sa.ColumnElement[bool]]) -> sa.Select[Any]:
    """How many dead letters match ``where``."""
    return sa.select(sa.func.count()).select_from(t.dead_letters).where(*where)


def inbox_summary(t: models.Tables, subscription: str) -> sa.Executable:
    """Inbox rows of a subscription and its latest outcome time.

    Cheap: compaction keeps the inbox down to the rows above the watermark.
    """
    c = t.inbox.c
    return sa.select(sa.func.count(), sa.func.max(c.processed_at)).where(
        c.subscription == subscription
    )


def dead_letter_summary(t: models.Tables, subscription: str) -> sa.Executable:
    """Dead letters of a subscription: all of them, and those never replayed."""
    c = t.dead_letters.c
    return sa.select(sa.func.count(), sa.func.count().filter(c.replayed_at.is_(None))).where(
        c.subscription == subscription
    )


# --- audit (eop audit): range reads of one subscription's inbox and dead letters ---
# Each read is bounded to one (subscription, stream, epoch) so it walks the
# primary key (inbox) or dead_letters_message_key in sequence order.


def audit_inbox_rows(
    t: models.Tables,
    subscription: str,
    stream: str,
    epoch: str,
    lo: int,
    hi: int | None,
    limit: int | None = None,
) -> sa.Select[Any]:
    """Inbox rows of one epoch with ``lo <= stream_seq <= hi`` (no upper bound when None)."""
    c = t.inbox.c
    stmt = sa.select(c.stream_seq, c.fingerprint, c.msg_id, c.outcome, c.delivery_count)
    return (
        stmt.where(*_in_range(c, subscription, stream, epoch, lo, hi))
        .order_by(c.stream_seq)
        .limit(limit)
    )


#: How much of a dead letter's error the audit reads.
AUDIT_ERROR_CHARS = 200


def audit_dead_letters(
    t: models.Tables,
    subscription: str,
    stream: str,
    epoch: str,
    lo: int,
    hi: int | None,
    limit: int | None = None,
) -> sa.Select[Any]:
    """Dead letters of one epoch with ``lo <= stream_seq <= hi`` (no upper bound when None).

    With the first characters of each one's error only: enough for the audit
    to tell a dead letter that infrastructure caused, never a whole traceback.
    """
    c = t.dead_letters.c
    error = sa.func.left(c.error, AUDIT_ERROR_CHARS)
    stmt = sa.select(c.stream_seq, c.fingerprint, c.id, c.reason, error)
    return (
        stmt.where(*_in_range(c, subscription, stream, epoch, lo, hi))
        .order_by(c.stream_seq, c.id)
        .limit(limit)
    )


def _in_range(
    c: Any, subscription: str, stream: str, epoch: str, lo: int, hi: int | None
) -> list[sa.ColumnElement[bool]]:
    """One epoch's rows with ``lo <= stream_seq <= hi`` (no upper bound when None)."""
    conditions = [*_in_epoch(c, subscription, stream, epoch), c.stream_seq >= lo]
    if hi is not None:
        conditions.append(c.stream_seq <= hi)
    return conditions


def audit_by_msg_ids(t: models.Tables, subscription: str, msg_ids: list[str]) -> sa.Select[Any]:
    """The inbox rows (any stream, any epoch) holding one of ``msg_ids`` for a subscription."""
    c = t.inbox.c
    ids = sa.func.unnest(sa.literal(msg_ids, postgresql.ARRAY(sa.Text)))
    wanted = ids.table_valued("id").render_derived(name="wanted")
    return sa.select(c.msg_id, c.stream, c.stream_epoch, c.stream_seq, c.outcome).where(
        c.subscription == subscription,
        c.msg_id_digest.in_(sa.select(msg_id_digest(wanted.c.id))),
    )


def audit_epochs(t: models.Tables, subscription: str, stream: str) -> sa.CompoundSelect[Any]:
    """Every epoch of a stream that the subscription's inbox, dead letters or watermarks name."""
    parts = [
        sa.select(table.c.stream_epoch).where(
            table.c.subscription == subscription, table.c.stream == stream
        )
        for table in (t.inbox, t.dead_letters, t.watermarks)
    ]
    return sa.union(*parts)


def audit_count_inbox(
    t: models.Tables, subscription: str, stream: str, epoch: str, lo: int, hi: int
) -> sa.Select[Any]:
    """How many inbox rows one epoch holds between ``lo`` and ``hi``."""
    c = t.inbox.c
    return (
        sa.select(sa.func.count())
        .select_from(t.inbox)
        .where(
            *_in_epoch(c, subscription, stream, epoch),
            c.stream_seq.between(lo, hi),
        )
    )


# health (obs): the readiness probe's ping of an idle worker
def ping() -> sa.Select[tuple[int]]:
    """``SELECT 1``: the database answers."""
    return sa.select(sa.literal(1))


# --- Handler failures and retries held in the database ----------------------


_FAILURE_COLUMNS = (
    "subscription",
    "stream",
    "stream_epoch",
    "stream_seq",
    "last_error",
    "parked",
    "subject",
    "headers",
    "payload",
    "stored_at",
)


_RUN_COLUMNS = tuple(c for c in _FAILURE_COLUMNS if c not in ("last_error", "parked"))


def count_run(t: models.Tables, row: dict[str, Any]) -> Bound:
    """Count one run of a redelivered message before its handler starts; RETURNING its
    runs without an outcome (runs less failures), or no row when it has its outcome.

    Committed on its own, before the handler's transaction: a run that kills its
    process still counts (docs/design.md, 'Crash loops'). ``row`` carries the key
    and the message (subject, headers, payload, stored_at), kept in the row as a
    failure's are.
    """
    if row.keys() != set(_RUN_COLUMNS):
        raise ValueError(f"a run row has exactly the columns {_RUN_COLUMNS}")
    return _count_run(t), {f"p_{name}": value for name, value in row.items()}


@functools.cache
def _count_run(t: models.Tables) -> sa.Executable:
    c, i = t.retries.c, t.inbox.c
    values = {name: sa.bindparam(f"p_{name}", type_=c[name].type) for name in _RUN_COLUMNS}
    settled = sa.exists().where(
        i.subscription == values["subscription"],
        i.stream == values["stream"],
        i.stream_epoch == values["stream_epoch"],
        i.stream_seq == values["stream_seq"],
    )
    fresh = {
        **values,
        "failures": sa.literal(0),
        "runs": sa.literal(1),
        "parked": sa.false(),
        "due_at": sa.func.now(),
        "last_error": sa.literal(""),
    }
    insert = postgresql.insert(t.retries).from_select(
        list(fresh), sa.select(*fresh.values()).where(~settled)
    )
    return insert.on_conflict_do_update(
        index_elements=["subscription", "stream", "stream_epoch", "stream_seq"],
        set_={"runs": c.runs + 1, "updated_at": sa.func.now()},
    ).returning(c.runs - c.failures)


def count_failure(t: models.Tables, row: dict[str, Any]) -> Bound:
    """Add one handler failure to a message's count (the row holds the message); RETURNING it.

    ``row`` carries the key, ``last_error``, ``parked``, ``due_in_s`` and the
    message (subject, headers, payload, stored_at); a first failure inserts it.
    """
    if row.keys() != {*_FAILURE_COLUMNS, "due_in_s"}:
        raise ValueError(f"a failure row has exactly the columns {_FAILURE_COLUMNS}, due_in_s")
    return _count_failure(t), {f"p_{name}": value for name, value in row.items()}


def _due_in(parameter: str) -> sa.ColumnElement[Any]:
    """now() plus the seconds of ``parameter``."""
    seconds = sa.bindparam(parameter, type_=sa.Float)
    return sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, seconds)


@functools.cache
def _count_failure(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    values = {name: sa.bindparam(f"p_{name}", type_=c[name].type) for name in _FAILURE_COLUMNS}
    insert = postgresql.insert(t.retries).values(
        {**values, "failures": 1, "due_at": _due_in("p_due_in_s")}
    )
    return insert.on_conflict_do_update(
        index_elements=["subscription", "stream", "stream_epoch", "stream_seq"],
        set_={
            "failures": c.failures + 1,
            "last_error": insert.excluded.last_error,
            "parked": insert.excluded.parked,
            "due_at": insert.excluded.due_at,
            "updated_at": sa.func.now(),
        },
    ).returning(c.failures)


def reschedule(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int, due_in_s: float
) -> Bound:
    """Set when a parked message is next run."""
    params = _key_params(subscription, stream, epoch, seq)
    return _reschedule(t), {**params, "p_due_in_s": due_in_s}


@functools.cache
def _reschedule(t: models.Tables) -> sa.Executable:
    return (
        sa.update(t.retries)
        .where(*_in_bound_key(t.retries.c))
        .values(due_at=_due_in("p_due_in_s"), updated_at=sa.func.now())
    )


def forget_failures(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int
) -> Bound:
    """Delete a message's failure count (it has its outcome now)."""
    return _forget_failures(t), _key_params(subscription, stream, epoch, seq)


@functools.cache
def _forget_failures(t: models.Tables) -> sa.Executable:
    return sa.delete(t.retries).where(*_in_bound_key(t.retries.c))


def take_due(t: models.Tables, subscription: str, limit: int, lease_s: float) -> Bound:
    """Lease up to ``limit`` parked messages that are due; RETURNING them.

    Each one's ``runs`` goes up and its ``due_at`` moves a lease ahead, so
    another worker does not take it meanwhile, and a run that dies without an
    outcome is still counted (the crash-loop bound). SKIP LOCKED: workers
    taking at the same time never wait for each other.
    """
    return _take_due(t), {"p_subscription": subscription, "p_limit": limit, "p_lease_s": lease_s}


@functools.cache
def _take_due(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    due = (
        sa.select(c.subscription, c.stream, c.stream_epoch, c.stream_seq)
        .where(
            c.subscription == sa.bindparam("p_subscription", type_=sa.Text),
            c.parked,
            c.due_at <= sa.func.now(),
        )
        .order_by(c.due_at)
        .limit(sa.bindparam("p_limit", type_=sa.Integer))
        .with_for_update(skip_locked=True)
    )
    lease_s = sa.bindparam("p_lease_s", type_=sa.Float)
    lease = sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, lease_s)
    return (
        sa.update(t.retries)
        .where(sa.tuple_(c.subscription, c.stream, c.stream_epoch, c.stream_seq).in_(due))
        .values(runs=c.runs + 1, due_at=lease, updated_at=sa.func.now())
        .returning(
            c.stream,
            c.stream_epoch,
            c.stream_seq,
            c.failures,
            c.runs,
            c.subject,
            c.headers,
            c.payload,
            c.stored_at,
        )
    )


def renew_run(
    t: models.Tables,
    subscription: str,
    stream: str,
    epoch: str,
    seq: int,
    runs: int,
    lease_s: float,
) -> Bound:
    """Move a parked message's lease ahead while this run (``runs``) holds it.

    SKIP LOCKED: a row this run's own transaction has locked needs no renewal
    (:func:`take_due` skips it too), and the renewal must never wait on it.
    """
    params = {**_key_params(subscription, stream, epoch, seq), "p_runs": runs}
    return _renew_run(t), {**params, "p_lease_s": lease_s}


@functools.cache
def _renew_run(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    runs = sa.bindparam("p_runs", type_=sa.Integer)
    held = (
        sa.select(c.subscription, c.stream, c.stream_epoch, c.stream_seq)
        .where(*_in_bound_key(c), c.parked, c.runs == runs)
        .with_for_update(skip_locked=True)
    )
    lease_s = sa.bindparam("p_lease_s", type_=sa.Float)
    return (
        sa.update(t.retries)
        .where(sa.tuple_(c.subscription, c.stream, c.stream_epoch, c.stream_seq).in_(held))
        .values(due_at=sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, lease_s))
    )


def lock_run(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int, runs: int
) -> Bound:
    """Lock a parked message for this run; no row when another run took it since."""
    return _lock_run(t), {**_key_params(subscription, stream, epoch, seq), "p_runs": runs}


@functools.cache
def _lock_run(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    runs = sa.bindparam("p_runs", type_=sa.Integer)
    return (
        sa.select(c.failures).where(*_in_bound_key(c), c.parked, c.runs == runs).with_for_update()
    )


def settle_retrying(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int, outcome: str
) -> Bound:
    """Turn a retrying inbox row into its outcome; RETURNING it only when it was retrying."""
    params = _key_params(subscription, stream, epoch, seq)
    return _settle_retrying(t), {**params, "p_outcome": outcome}


@functools.cache
def _settle_retrying(t: models.Tables) -> sa.Executable:
    c = t.inbox.c
    return (
        sa.update(t.inbox)
        .where(*_in_bound_key(c), c.outcome == models.OUTCOME_RETRYING)
        .values(outcome=sa.bindparam("p_outcome", type_=sa.Text), processed_at=sa.func.now())
        .returning(c.stream_seq)
    )


# --- The due retries of one poll, in one transaction (eop.protocol.retrying) -------
#
# Each statement takes the parked messages of one subscription, stream and epoch,
# one array element per message: one statement for the poll, not one per run.


def _seqs() -> sa.BindParameter[Any]:
    return sa.bindparam("p_seqs", type_=postgresql.ARRAY(sa.BigInteger))


def lock_runs(
    t: models.Tables, subscription: str, stream: str, epoch: str, seqs: list[int], runs: list[int]
) -> Bound:
    """Lock the parked messages ``seqs`` for the runs that took them (``runs``, element by
    element); RETURNING the sequences locked.

    :func:`lock_run` for a poll's runs at once: a message another run took
    since (its ``runs`` moved on) or that settled is not locked. A row another
    transaction holds is waited for, as :func:`lock_run` waits (``lock_timeout``
    bounds it), not skipped: the holder is mostly the next poll's
    :func:`take_due`, whose SKIP LOCKED scan locks a row it then finds not due
    for an instant, and a row skipped here would wait out its whole lease.
    """
    params = {**_epoch_params(subscription, stream, epoch), "p_seqs": seqs, "p_runs": runs}
    return _lock_runs(t), params


@functools.cache
def _lock_runs(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    taken = (
        sa.func.unnest(_seqs(), sa.bindparam("p_runs", type_=postgresql.ARRAY(sa.Integer)))
        .table_valued("seq", "runs")
        .render_derived()
    )
    return (
        sa.select(c.stream_seq)
        .where(
            *_in_bound_epoch(c),
            c.parked,
            c.stream_seq == sa.any_(_seqs()),
            sa.tuple_(c.stream_seq, c.runs).in_(sa.select(taken.c.seq, taken.c.runs)),
        )
        .with_for_update(of=t.retries)
    )


def count_parked_failures(
    t: models.Tables,
    subscription: str,
    stream: str,
    epoch: str,
    seqs: list[int],
    last_errors: list[str],
    due_in_s: list[float],
) -> Bound:
    """Add one handler failure to each of the parked messages ``seqs`` (locked by this
    transaction), with its error and its next run ``due_in_s`` from now; RETURNING each
    one's sequence and new count.

    :func:`count_failure` for rows that exist: a parked message's row is its
    copy, and the run holds its lock, so an UPDATE does.
    """
    params = {
        **_epoch_params(subscription, stream, epoch),
        "p_seqs": seqs,
        "p_errors": last_errors,
        "p_due_in_s": due_in_s,
    }
    return _count_parked_failures(t), params


@functools.cache
def _count_parked_failures(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    failed = (
        sa.func.unnest(
            _seqs(),
            sa.bindparam("p_errors", type_=postgresql.ARRAY(sa.Text)),
            sa.bindparam("p_due_in_s", type_=postgresql.ARRAY(sa.Float)),
        )
        .table_valued("seq", "error", "due_in_s")
        .render_derived()
    )
    due_at = sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, failed.c.due_in_s)
    return (
        sa.update(t.retries)
        .where(*_in_bound_epoch(c), c.stream_seq == failed.c.seq)
        .values(
            failures=c.failures + 1,
            last_error=failed.c.error,
            due_at=due_at,
            updated_at=sa.func.now(),
        )
        .returning(c.stream_seq, c.failures)
    )


def settle_retrying_many(
    t: models.Tables,
    subscription: str,
    stream: str,
    epoch: str,
    seqs: list[int],
    outcomes: list[str],
) -> Bound:
    """Turn the retrying inbox rows ``seqs`` into their ``outcomes``; RETURNING the
    sequences of those that were retrying (:func:`settle_retrying` for many)."""
    params = {**_epoch_params(subscription, stream, epoch), "p_seqs": seqs, "p_outcomes": outcomes}
    return _settle_retrying_many(t), params


@functools.cache
def _settle_retrying_many(t: models.Tables) -> sa.Executable:
    c = t.inbox.c
    settled = (
        sa.func.unnest(_seqs(), sa.bindparam("p_outcomes", type_=postgresql.ARRAY(sa.Text)))
        .table_valued("seq", "outcome")
        .render_derived()
    )
    return (
        sa.update(t.inbox)
        .where(
            *_in_bound_epoch(c),
            c.stream_seq == settled.c.seq,
            c.outcome == models.OUTCOME_RETRYING,
        )
        .values(outcome=settled.c.outcome, processed_at=sa.func.now())
        .returning(c.stream_seq)
    )


def forget_failures_many(
    t: models.Tables, subscription: str, stream: str, epoch: str, seqs: list[int]
) -> Bound:
    """Delete the failure counts (and parked copies) of the messages ``seqs``."""
    return _forget_failures_many(t), {**_epoch_params(subscription, stream, epoch), "p_seqs": seqs}


@functools.cache
def _forget_failures_many(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    return sa.delete(t.retries).where(*_in_bound_epoch(c), c.stream_seq == sa.any_(_seqs()))


def insert_dead_letters(t: models.Tables) -> sa.Executable:
    """:func:`insert_dead_letter` without RETURNING, to run with many rows (an executemany);
    each row's parameters are those :func:`insert_dead_letter` gives."""
    return _insert_dead_letters(t)


@functools.cache
def _insert_dead_letters(t: models.Tables) -> sa.Executable:
    c = t.dead_letters.c
    values = {name: sa.bindparam(f"p_{name}", type_=c[name].type) for name in _DEAD_LETTER_COLUMNS}
    return postgresql.insert(t.dead_letters).values(values).on_conflict_do_nothing()


def count_parked(t: models.Tables, subscription: str) -> sa.Select[Any]:
    """Messages of a subscription whose retry is held in the database."""
    c = t.retries.c
    return sa.select(sa.func.count()).where(c.subscription == subscription, c.parked)


# --- The test kit (eop.testing.TestApp) -------------------------------------


def hurry_parked(t: models.Tables, subscription: str) -> sa.Update:
    """Make every parked message of a subscription due now: a test runs its retries at once."""
    c = t.retries.c
    return (
        sa.update(t.retries)
        .where(c.subscription == subscription, c.parked)
        .values(due_at=sa.func.now())
    )


def dead_letters_after(t: models.Tables, after_id: int) -> sa.Select[Any]:
    """Dead letters with an id above ``after_id``, oldest first: the message, why, and its id."""
    c = t.dead_letters.c
    return (
        sa.select(
            c.id,
            c.subscription,
            c.stream,
            c.stream_epoch,
            c.stream_seq,
            c.fingerprint,
            c.msg_id,
            c.subject,
            c.headers,
            c.payload,
            c.reason,
            c.error,
            c.traceback,
            c.delivery_count,
        )
        .where(c.id > after_id)
        .order_by(c.id)
    )


def max_ids(t: models.Tables) -> sa.Select[Any]:
    """The highest dead letter and outbox ids (0 when empty): where a test's reading starts."""
    return sa.select(
        sa.select(sa.func.coalesce(sa.func.max(t.dead_letters.c.id), 0)).scalar_subquery(),
        sa.select(sa.func.coalesce(sa.func.max(t.outbox.c.id), 0)).scalar_subquery(),
    )


def add_spark_report(t: models.Tables, row: dict[str, Any]) -> sa.Executable:
    """A Spark write's counts under its report id; a commit run again keeps the first."""
    return postgresql.insert(t.spark_reports).values(row).on_conflict_do_nothing()


def purge_spark_reports(t: models.Tables, older_than_s: float) -> sa.Executable:
    """Reports nobody took (their caller died) once older than ``older_than_s``."""
    r = t.spark_reports
    age = sa.func.make_interval(0, 0, 0, 0, 0, 0, older_than_s)
    return sa.delete(r).where(r.c.created_at < sa.func.now() - age)


def take_spark_reports(t: models.Tables, report_id: str) -> sa.Executable:
    """The counts left under ``report_id``, deleted as they are read, by batch id."""
    r = t.spark_reports
    counted = [r.c.processed, r.c.duplicates, r.c.dead_lettered, r.c.quarantined, r.c.skipped]
    return sa.delete(r).where(r.c.report_id == report_id).returning(r.c.batch_id, *counted)
