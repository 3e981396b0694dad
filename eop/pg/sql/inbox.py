"""The inbox: the claim, the watermark and its compaction, look-ups by key and msg-id,
and the dead letter a worker writes (the worker's hot path)."""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from eop.pg import models
from eop.pg.sql.base import (
    DIGEST_SQL,
    Bound,
    epoch_params,
    in_bound_epoch,
    in_bound_inbox_key,
    in_bound_key,
    in_bound_lane,
    in_epoch,
    in_lane,
    key_params,
    msg_id_digest,
)

# The claim's parameters, in order: (name, SQLAlchemy type, PostgreSQL type).
# A batch shares its subscription, stream and outcome: those are scalars. Each
# row has its own sequence and fingerprint: those are arrays. The other columns
# are usually the same for the whole batch (one epoch, a first delivery, no
# msg-id when the guard is off), so each is a pair: a scalar that
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

    The watermark row of each epoch of the batch is read once, FOR SHARE: the
    watermark and the lane that keys the rows. Compaction raises the watermark
    (an UPDATE of that row) only once no claim that read the old value is still
    open, and deletes rows only after that, so no claim can slip between the
    raise and the delete. A message whose epoch has no watermark row (no lane)
    yet is not inserted (:func:`create_lanes`).
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
    values = {
        "lane": "w.lane",
        "subscription": p["subscription"],
        "outcome": p["outcome"],
        "stream_seq": "i.stream_seq",
        "fingerprint": "i.fingerprint",
        "delivery_count": f"COALESCE(i.delivery_count, {p['delivery_count']})",
        "msg_id": f"COALESCE(i.msg_id, {p['msg_id']})",
    }
    values["msg_id_digest"] = DIGEST_SQL.format(values["msg_id"])
    # The watermark rows of the batch's one epoch (the shared value, the array empty,
    # each row's NULL) or of each row's (the shared value NULL), in a subquery that
    # names no inbox row: PostgreSQL reads each once. The schema name is checked to
    # be an identifier by Settings; quoting keeps it literal.
    return (
        f'INSERT INTO "{schema}".inbox ({", ".join(values)}) '
        f"SELECT {', '.join(values.values())} "
        "FROM (SELECT w.lane, w.stream_epoch, w.watermark "
        f'FROM "{schema}".watermarks AS w '
        f"WHERE w.subscription = {p['subscription']} AND w.stream = {p['stream']} "
        f"AND w.stream_epoch = ANY(array_append({p['stream_epoch_each']}, "
        f"{p['stream_epoch']})) FOR SHARE) AS w "
        f"JOIN unnest({arrays}) AS i({', '.join(row_names)}) "
        "ON i.stream_epoch IS NULL OR i.stream_epoch = w.stream_epoch "
        "WHERE i.stream_seq > w.watermark "
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
    return sa.select(w.watermark).where(*in_epoch(w, subscription, stream, epoch))


def create_watermark(t: models.Tables, subscription: str, stream: str, epoch: str) -> Bound:
    """Make sure the watermark row exists (at 0), so raising it is always an UPDATE;
    RETURNING a row only when this call created it."""
    return create_lanes(t, subscription, stream, [epoch])


def create_lanes(t: models.Tables, subscription: str, stream: str, epochs: list[str]) -> Bound:
    """:func:`create_watermark` of ``epochs``, in a claim's transaction that found their lanes
    missing (no compactor prepared them: the test kit, Spark, Django, a stream recreated
    under a worker); RETURNING a row per row created. Until COMMIT the row is the claim's:
    compaction's raise waits for it as for a claim that read it FOR SHARE."""
    params = {"p_subscription": subscription, "p_stream": stream, "p_epochs": epochs}
    return _create_lanes(t), params


@functools.cache
def _create_lanes(t: models.Tables) -> sa.Executable:
    w = t.watermarks.c
    sub, stream = (sa.bindparam(n, type_=sa.Text) for n in ("p_subscription", "p_stream"))
    epochs = sa.func.unnest(sa.bindparam("p_epochs", type_=postgresql.ARRAY(sa.Text)))
    epoch = epochs.table_valued("epoch").render_derived(name="e").c.epoch
    # Only the rows missing: a row's lane is taken from its identity's sequence before
    # ON CONFLICT finds the row there, and a claim finding some of its rows taken (every
    # duplicate) would use up a lane each time.
    there = sa.exists().where(w.subscription == sub, w.stream == stream, w.stream_epoch == epoch)
    rows = sa.select(sub, stream, epoch, sa.literal(0)).where(~there)
    columns = ["subscription", "stream", "stream_epoch", "watermark"]
    insert = postgresql.insert(t.watermarks).from_select(columns, rows)
    return insert.on_conflict_do_nothing().returning(w.lane)


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
    return _advance_watermark(t), {**epoch_params(subscription, stream, epoch), "p_value": value}


@functools.cache
def _advance_watermark(t: models.Tables) -> sa.Executable:
    w = t.watermarks.c
    value = sa.bindparam("p_value", type_=sa.BigInteger)
    return (
        sa.update(t.watermarks)
        .where(*in_bound_epoch(w))
        .values(watermark=sa.func.greatest(w.watermark, value), updated_at=sa.func.now())
        .returning(w.watermark)
    )


def first_to_delete(
    t: models.Tables,
    subscription: str,
    stream: str,
    epoch: str,
    value: int,
    msg_id_retention_s: float,
    after: int = 0,
) -> Bound:
    """The lowest sequence above ``after`` and at or below ``value`` whose inbox row may be
    deleted (NULL when there is none): where compaction's next chunk starts.

    One walk of the primary key's index from ``after``, stopping at the first
    row that may go: the rows that must stay (:func:`delete_below_watermark`)
    are passed over here once, not swept by a delete for every chunk of
    their sequences (:func:`delete_below_watermark`'s ``limit``).
    """
    params = {
        **epoch_params(subscription, stream, epoch),
        "p_after": after,
        "p_value": value,
        "p_retention_s": msg_id_retention_s,
    }
    return _first_to_delete(t), params


@functools.cache
def _first_to_delete(t: models.Tables) -> sa.Executable:
    c = t.inbox.c
    # ORDER BY ... LIMIT 1, not min(): the index scan stops at the first row that may go.
    # PostgreSQL turns a min() into that only when its estimates favour it, and a generic
    # plan's (a prepared statement's, after five runs) did not: it aggregated every row
    # of the range.
    return (
        sa.select(c.stream_seq)
        .where(
            *in_bound_lane(t),
            c.stream_seq > sa.bindparam("p_after", type_=sa.BigInteger),
            c.stream_seq <= sa.bindparam("p_value", type_=sa.BigInteger),
            *_may_go(c),
        )
        .order_by(c.stream_seq)
        .limit(1)
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
    """Delete the inbox rows that may go among the ``limit`` sequences above ``after``, up to
    ``value``: one bounded chunk, at most ``limit`` rows as sequences are unique in an epoch.

    Rows carrying a msg-id stay for ``msg_id_retention_s``: they are the guard
    against a republish after the server's duplicate window. Retrying rows stay:
    they are the claims of parked retries. ``after`` bounds the index scan from
    below: the entries of deleted rows stay in the primary key's index until a
    VACUUM, and a scan from the epoch's first sequence walks all of them
    (docs/design.md, 'The watermark').
    """
    params = {
        **epoch_params(subscription, stream, epoch),
        "p_after": after,
        "p_value": value,
        "p_limit": limit,
        "p_retention_s": msg_id_retention_s,
    }
    return _delete_below_watermark(t), params


@functools.cache
def _delete_below_watermark(t: models.Tables) -> sa.Executable:
    c = t.inbox.c
    after = sa.bindparam("p_after", type_=sa.BigInteger)
    upto = sa.func.least(
        sa.bindparam("p_value", type_=sa.BigInteger),
        after + sa.bindparam("p_limit", type_=sa.Integer),
        type_=sa.BigInteger,
    )
    # Bounded by the key, not by a LIMIT: PostgreSQL deletes the rows as its index scan
    # finds them. Selecting `limit` ctids first and deleting by them read every row twice
    # (compaction cost 6,500 instructions a message that way, 5,100 this way:
    # benchmarks/pg_instructions.py).
    # No RETURNING: the worker needs the count only (rowcount), not a row per deleted row.
    return sa.delete(t.inbox).where(
        *in_bound_lane(t), c.stream_seq > after, c.stream_seq <= upto, *_may_go(c)
    )


def _may_go(c: Any) -> tuple[Any, ...]:
    """The conditions of an inbox row at or below the watermark that compaction may delete:
    no msg-id, or one past its retention; not retrying."""
    retention_s = sa.bindparam("p_retention_s", type_=sa.Float)
    cutoff = sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, retention_s)
    return (
        sa.or_(c.msg_id.is_(None), c.processed_at < cutoff),
        # A retrying row was acked (the ack floor passed it) but has no outcome:
        # it is the claim of a retry held in the retries table.
        c.outcome != models.OUTCOME_RETRYING,
    )


def unclaim(t: models.Tables, subscription: str, stream: str, epoch: str, seq: int) -> Bound:
    """Drop a claim made earlier in this transaction (its handler failed in a batch)."""
    return _unclaim(t), key_params(subscription, stream, epoch, seq)


@functools.cache
def _unclaim(t: models.Tables) -> sa.Executable:
    c = t.inbox.c
    return sa.delete(t.inbox).where(*in_bound_inbox_key(t)).returning(c.stream_seq)


def find_by_key(t: models.Tables, subscription: str, stream: str, epoch: str, seq: int) -> Bound:
    """The fingerprint and outcome stored under an inbox key."""
    return _find_by_key(t), key_params(subscription, stream, epoch, seq)


@functools.cache
def _find_by_key(t: models.Tables) -> sa.Executable:
    c = t.inbox.c
    return sa.select(c.fingerprint, c.outcome).where(*in_bound_inbox_key(t))


def find_by_keys(
    t: models.Tables, subscription: str, stream: str, epoch: str, seqs: list[int]
) -> sa.Select[tuple[int, bytes, str]]:
    """The sequence, fingerprint and outcome of each of ``seqs`` the inbox holds (one query)."""
    c = t.inbox.c
    return sa.select(c.stream_seq, c.fingerprint, c.outcome).where(
        *in_lane(t, subscription, stream, epoch),
        c.stream_seq == sa.any_(sa.literal(seqs, postgresql.ARRAY(sa.BigInteger))),
    )


def find_by_msg_id(t: models.Tables, subscription: str, msg_id: str) -> Bound:
    """The key and outcome of the message this subscription processed with ``msg_id``."""
    return _find_by_msg_id(t), {"p_subscription": subscription, "p_msg_id": msg_id}


@functools.cache
def _find_by_msg_id(t: models.Tables) -> sa.Executable:
    c, w = t.inbox.c, t.watermarks.c
    # The lane's watermark row names the stream and epoch (it is never deleted).
    return (
        sa.select(w.stream, w.stream_epoch, c.stream_seq, c.outcome)
        .join_from(t.inbox, t.watermarks, w.lane == c.lane)
        .where(
            c.subscription == sa.bindparam("p_subscription", type_=sa.Text),
            c.msg_id_digest == msg_id_digest(sa.bindparam("p_msg_id", type_=sa.Text)),
        )
    )


def find_dead_letter(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int, fingerprint: bytes
) -> Bound:
    """The id of the dead letter recorded for one message (key and fingerprint)."""
    params = key_params(subscription, stream, epoch, seq)
    return _find_dead_letter(t), {**params, "p_fingerprint": fingerprint}


@functools.cache
def _find_dead_letter(t: models.Tables) -> sa.Executable:
    c = t.dead_letters.c
    fingerprint = sa.bindparam("p_fingerprint", type_=sa.LargeBinary)
    return sa.select(c.id).where(*in_bound_key(c), c.fingerprint == fingerprint)


DEAD_LETTER_COLUMNS = (
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
    if row.keys() != set(DEAD_LETTER_COLUMNS):
        raise ValueError(f"a dead letter row has exactly the columns {DEAD_LETTER_COLUMNS}")
    return _insert_dead_letter(t), {f"p_{name}": value for name, value in row.items()}


@functools.cache
def _insert_dead_letter(t: models.Tables) -> sa.Executable:
    c = t.dead_letters.c
    values = {name: sa.bindparam(f"p_{name}", type_=c[name].type) for name in DEAD_LETTER_COLUMNS}
    return postgresql.insert(t.dead_letters).values(values).on_conflict_do_nothing().returning(c.id)
