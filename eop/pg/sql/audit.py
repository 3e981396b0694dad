"""Range reads of one subscription's inbox and dead letters, for `eop audit`."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from eop.pg import models
from eop.pg.sql.base import in_epoch, in_lane, msg_id_digest

# --- audit (eop audit): range reads of one subscription's inbox and dead letters ---
# Each read is bounded to one (subscription, stream, epoch), the inbox's by its
# lane, so it walks the primary key (inbox) or dead_letters_message_key in
# sequence order.


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
        stmt.where(*in_lane(t, subscription, stream, epoch), *_in_range(c, lo, hi))
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
        stmt.where(*in_epoch(c, subscription, stream, epoch), *_in_range(c, lo, hi))
        .order_by(c.stream_seq, c.id)
        .limit(limit)
    )


def _in_range(c: Any, lo: int, hi: int | None) -> list[sa.ColumnElement[bool]]:
    """The rows with ``lo <= stream_seq <= hi`` (no upper bound when None)."""
    conditions = [c.stream_seq >= lo]
    if hi is not None:
        conditions.append(c.stream_seq <= hi)
    return conditions


def audit_by_msg_ids(t: models.Tables, subscription: str, msg_ids: list[str]) -> sa.Select[Any]:
    """The inbox rows (any stream, any epoch) holding one of ``msg_ids`` for a subscription."""
    c, w = t.inbox.c, t.watermarks.c
    ids = sa.func.unnest(sa.literal(msg_ids, postgresql.ARRAY(sa.Text)))
    wanted = ids.table_valued("id").render_derived(name="wanted")
    return (
        sa.select(c.msg_id, w.stream, w.stream_epoch, c.stream_seq, c.outcome)
        .join_from(t.inbox, t.watermarks, w.lane == c.lane)
        .where(
            c.subscription == subscription,
            c.msg_id_digest.in_(sa.select(msg_id_digest(wanted.c.id))),
        )
    )


def audit_epochs(t: models.Tables, subscription: str, stream: str) -> sa.CompoundSelect[Any]:
    """Every epoch of a stream that the subscription's inbox, dead letters or watermarks name
    (an inbox row's epoch is its lane's watermark row's)."""
    parts = [
        sa.select(table.c.stream_epoch).where(
            table.c.subscription == subscription, table.c.stream == stream
        )
        for table in (t.dead_letters, t.watermarks)
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
            *in_lane(t, subscription, stream, epoch),
            c.stream_seq.between(lo, hi),
        )
    )
