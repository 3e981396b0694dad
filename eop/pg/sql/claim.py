"""The claim: one statement that inserts a batch's inbox rows, each whose key (and
msg-id) is free and which lies above its lane's watermark (the worker's hot path)."""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from eop.pg import models
from eop.pg.sql.base import DIGEST_SQL, timeouts_first

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
    yet is not inserted (:func:`eop.pg.sql.inbox.create_lanes`).
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


def _claim_sql(schema: str, p: dict[str, str], timeouts: str = "") -> str:
    """The claim statement, ``p`` naming each of :data:`CLAIM_PARAMS`'s placeholders;
    ``timeouts``, a :func:`~eop.pg.sql.base.timeouts_first` condition, or nothing.

    The msg-id guard's unique index holds the msg-id's digest
    (:func:`~eop.pg.sql.base.msg_id_digest`), computed here so that every claim,
    whatever its caller, fills it in; a taken digest is a conflict that ON
    CONFLICT DO NOTHING skips.
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
        f"{p['stream_epoch']})) {f'AND {timeouts} ' if timeouts else ''}FOR SHARE) AS w "
        f"JOIN unnest({arrays}) AS i({', '.join(row_names)}) "
        "ON i.stream_epoch IS NULL OR i.stream_epoch = w.stream_epoch "
        "WHERE i.stream_seq > w.watermark "
        "ON CONFLICT DO NOTHING RETURNING stream_seq"
    )


# Throughput: the batch claim on the driver's own connection.


@functools.cache
def claim_driver_text(schema: str, *, timeouts: bool = False) -> str:
    """:func:`claim` as plain SQL for the asyncpg connection under the session.

    The same statement, with positional parameters in the order of
    :data:`CLAIM_PARAMS`: passing the values straight to the driver skips
    SQLAlchemy's per-element bind processing of the arrays. With ``timeouts``
    it sets the transaction's local timeouts before it locks any row, from
    two more parameters (:attr:`eop.pg.sql.base.LocalTimeouts.values`): the
    transaction's first statement, it spares a round trip of its own.
    """
    n = len(_CLAIM_PARAMS)
    gate = timeouts_first(f"${n + 1}", f"${n + 2}") if timeouts else ""
    return _claim_sql(
        schema, {name: f"${i}::{pg}" for i, (name, _, pg) in enumerate(_CLAIM_PARAMS, 1)}, gate
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
