"""Dead letters for `eop dlq` (list, show, replay, purge) and the counts `eop status`
shows."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from eop.pg import models
from eop.pg.sql.base import in_lane

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
            *in_lane(t, subscription, stream, epoch),
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

    Cheap: compaction keeps the inbox down to the rows above the watermark, and the
    subscription's lanes bound the scan of the primary key to its own rows.
    """
    c, w = t.inbox.c, t.watermarks.c
    lanes = sa.select(w.lane).where(w.subscription == subscription)
    return sa.select(sa.func.count(), sa.func.max(c.processed_at)).where(c.lane.in_(lanes))


def dead_letter_summary(t: models.Tables, subscription: str) -> sa.Executable:
    """Dead letters of a subscription: all of them, and those never replayed."""
    c = t.dead_letters.c
    return sa.select(sa.func.count(), sa.func.count().filter(c.replayed_at.is_(None))).where(
        c.subscription == subscription
    )
