"""All of eop's SQL, in one place.

Statements are built with SQLAlchemy Core from :mod:`eop.models`, so they
follow the configured schema and run unchanged on async and sync sessions.
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from eop import models


def set_local_timeouts(lock_timeout_ms: int, statement_timeout_ms: int) -> sa.TextClause:
    """``SET LOCAL lock_timeout`` and ``statement_timeout`` for this transaction only.

    ``set_config(..., true)`` is the parameterisable form of ``SET LOCAL``.
    """
    return sa.text(
        "SELECT set_config('lock_timeout', :lock, true), "
        "set_config('statement_timeout', :stmt, true)"
    ).bindparams(lock=f"{lock_timeout_ms}ms", stmt=f"{statement_timeout_ms}ms")


_CLAIM_COLUMNS = (
    ("subscription", sa.Text, "text"),
    ("stream", sa.Text, "text"),
    ("stream_epoch", sa.Text, "text"),
    ("stream_seq", sa.BigInteger, "bigint"),
    ("fingerprint", sa.LargeBinary, "bytea"),
    ("msg_id", sa.Text, "text"),
    ("subject", sa.Text, "text"),
    ("outcome", sa.Text, "text"),
    ("delivery_count", sa.Integer, "integer"),
)


def claim(t: models.Tables, rows: list[dict[str, Any]]) -> sa.TextClause:
    """Insert the inbox rows whose key (or msg-id) is free and which lie above the watermark.

    One statement for a whole batch, its rows passed as one array per column
    (``unnest``): the SQL text never changes with the batch, so it is compiled
    and prepared once. RETURNING names the claimed sequences. A concurrent
    transaction holding one of the keys makes this wait on the unique index
    until that one ends: then that row is not inserted.

    The watermark is read FOR SHARE: compaction raises it (an UPDATE of that
    row) only once no claim that read the old value is still open, and deletes
    rows only after that, so no claim can slip between the raise and the delete.
    """
    return _claim_text(t.schema).bindparams(
        *(
            sa.bindparam(name, [row[name] for row in rows], type_=postgresql.ARRAY(kind))
            for name, kind, _ in _CLAIM_COLUMNS
        )
    )


@functools.cache
def _claim_text(schema: str) -> sa.TextClause:
    names = ", ".join(name for name, _, _ in _CLAIM_COLUMNS)
    arrays = ", ".join(f"CAST(:{name} AS {pg}[])" for name, _, pg in _CLAIM_COLUMNS)
    # The schema name is checked to be an identifier by Settings; quoting keeps
    # it literal.
    return sa.text(
        f'INSERT INTO "{schema}".inbox ({names}) '
        f"SELECT i.* FROM unnest({arrays}) AS i({names}) "
        "WHERE i.stream_seq > COALESCE(("
        f'SELECT w.watermark FROM "{schema}".watermarks AS w '
        "WHERE w.subscription = i.subscription AND w.stream = i.stream "
        "AND w.stream_epoch = i.stream_epoch FOR SHARE), 0) "
        "ON CONFLICT DO NOTHING RETURNING stream_seq"
    )


# Throughput (issue 4): the batch claim on the driver's own connection.


@functools.cache
def claim_driver_text(schema: str) -> str:
    """:func:`claim` as plain SQL for the asyncpg connection under the session.

    The same statement, with positional array parameters in the order of
    :data:`CLAIM_COLUMNS`: passing the arrays straight to the driver skips
    SQLAlchemy's per-element bind processing of nine arrays per batch.
    """
    names = ", ".join(name for name, _, _ in _CLAIM_COLUMNS)
    arrays = ", ".join(f"${i}::{pg}[]" for i, (_, _, pg) in enumerate(_CLAIM_COLUMNS, 1))
    return (
        f'INSERT INTO "{schema}".inbox ({names}) '
        f"SELECT i.* FROM unnest({arrays}) AS i({names}) "
        "WHERE i.stream_seq > COALESCE(("
        f'SELECT w.watermark FROM "{schema}".watermarks AS w '
        "WHERE w.subscription = i.subscription AND w.stream = i.stream "
        "AND w.stream_epoch = i.stream_epoch FOR SHARE), 0) "
        "ON CONFLICT DO NOTHING RETURNING stream_seq"
    )


CLAIM_COLUMNS: tuple[str, ...] = tuple(name for name, _, _ in _CLAIM_COLUMNS)
"""The columns of a claimed inbox row, in the order of the claim's parameters."""


def watermark(
    t: models.Tables, subscription: str, stream: str, epoch: str
) -> sa.Select[tuple[int]]:
    """The watermark of a subscription on one stream epoch."""
    w = t.watermarks.c
    return sa.select(w.watermark).where(
        w.subscription == subscription, w.stream == stream, w.stream_epoch == epoch
    )


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
    and released at once (see :meth:`eop.compaction.Compactor.prepare`).
    """
    return sa.text(f'LOCK TABLE "{t.schema}".inbox IN SHARE MODE')


def advance_watermark(
    t: models.Tables, subscription: str, stream: str, epoch: str, value: int
) -> sa.Executable:
    """Raise the watermark to ``value``; it never goes backwards. RETURNING the new value."""
    w = t.watermarks.c
    return (
        sa.update(t.watermarks)
        .where(w.subscription == subscription, w.stream == stream, w.stream_epoch == epoch)
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
) -> sa.Executable:
    """Delete up to ``limit`` inbox rows at or below ``value`` (one bounded chunk).

    Rows carrying a msg-id stay for ``msg_id_retention_s``: they are the guard
    against a republish after the server's duplicate window.
    """
    c = t.inbox.c
    cutoff = sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, msg_id_retention_s)
    chunk: sa.Select[Any] = (
        sa.select(sa.literal_column("ctid"))
        .select_from(t.inbox)
        .where(
            c.subscription == subscription,
            c.stream == stream,
            c.stream_epoch == epoch,
            c.stream_seq <= value,
            sa.or_(c.msg_id.is_(None), c.processed_at < cutoff),
        )
        .limit(limit)
    )
    return (
        sa.delete(t.inbox)
        .where(sa.literal_column("ctid") == sa.any_(sa.func.array(chunk.scalar_subquery())))
        .returning(c.stream_seq)
    )


def count_inbox(t: models.Tables, subscription: str | None = None) -> sa.Select[Any]:
    """Inbox rows, of one subscription or all."""
    stmt = sa.select(sa.func.count()).select_from(t.inbox)
    if subscription is not None:
        stmt = stmt.where(t.inbox.c.subscription == subscription)
    return stmt


def unclaim(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int
) -> sa.Executable:
    """Drop a claim made earlier in this transaction (its handler failed in a batch)."""
    c = t.inbox.c
    return (
        sa.delete(t.inbox)
        .where(
            c.subscription == subscription,
            c.stream == stream,
            c.stream_epoch == epoch,
            c.stream_seq == seq,
        )
        .returning(c.stream_seq)
    )


def find_by_key(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int
) -> sa.Select[tuple[bytes, str]]:
    """The fingerprint and outcome stored under an inbox key."""
    c = t.inbox.c
    return sa.select(c.fingerprint, c.outcome).where(
        c.subscription == subscription,
        c.stream == stream,
        c.stream_epoch == epoch,
        c.stream_seq == seq,
    )


def find_by_msg_id(
    t: models.Tables, subscription: str, msg_id: str
) -> sa.Select[tuple[str, str, int, str]]:
    """The key and outcome of the message this subscription processed with ``msg_id``."""
    c = t.inbox.c
    return sa.select(c.stream, c.stream_epoch, c.stream_seq, c.outcome).where(
        c.subscription == subscription, c.msg_id == msg_id
    )


def find_dead_letter(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int, fingerprint: bytes
) -> sa.Select[tuple[int]]:
    """The id of the dead letter recorded for one message (key and fingerprint)."""
    c = t.dead_letters.c
    return sa.select(c.id).where(
        c.subscription == subscription,
        c.stream == stream,
        c.stream_epoch == epoch,
        c.stream_seq == seq,
        c.fingerprint == fingerprint,
    )


def insert_dead_letter(t: models.Tables, row: dict[str, Any]) -> sa.Insert:
    """Record a dead letter; a second one for the same message is dropped."""
    return (
        postgresql.insert(t.dead_letters)
        .values(**row)
        .on_conflict_do_nothing()
        .returning(t.dead_letters.c.id)
    )


def count_effects(t: models.Tables, subscription: str) -> sa.Select[tuple[str, int]]:
    """Inbox rows of a subscription by outcome."""
    c = t.inbox.c
    return (
        sa.select(c.outcome, sa.func.count())
        .where(c.subscription == subscription)
        .group_by(c.outcome)
    )


def list_dead_letters(t: models.Tables, subscription: str | None = None) -> sa.Select[Any]:
    """Dead letters, newest first, optionally of one subscription."""
    c = t.dead_letters.c
    stmt = sa.select(
        c.id, c.subscription, c.stream, c.stream_seq, c.subject, c.reason, c.error, c.created_at
    ).order_by(c.id.desc())
    if subscription is not None:
        stmt = stmt.where(c.subscription == subscription)
    return stmt
