"""All of eop's SQL, in one place.

Statements are built with SQLAlchemy Core from :mod:`eop.models`, so they
follow the configured schema and run unchanged on async and sync sessions.
"""

from __future__ import annotations

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


def claim(t: models.Tables, row: dict[str, Any]) -> sa.Insert:
    """Insert the inbox row unless its key (or its msg-id) is taken; RETURNING tells which.

    A concurrent transaction holding the same key makes this wait on the
    unique index until that one ends: then it inserts nothing.
    """
    return (
        postgresql.insert(t.inbox)
        .values(**row)
        .on_conflict_do_nothing()
        .returning(t.inbox.c.stream_seq)
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
