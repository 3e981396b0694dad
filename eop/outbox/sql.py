"""The outbox's SQL: adding rows, the relay's reads and marks, its lease, and the operators'.

Rows are published in ``id`` order by the one relay holding the lease (see
docs/design.md, 'The outbox'), so none of these statements locks rows for a
relay: a second relay never reads while the first holds the lease.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from eop.pg import models

#: The outbox row's columns a relay reads to publish it.
PENDING_COLUMNS = ("id", "msg_id", "subject", "headers", "payload", "attempts")


@functools.cache
def insert(t: models.Tables) -> sa.TextClause:
    """INSERT one outbox row (``msg_id``, ``subject``, ``headers``, ``payload``).

    One statement object per schema: :class:`eop.Writes` sends consecutive
    rows of the same statement object together (on asyncpg, as one INSERT of
    many rows: :func:`eop.pg.direct.rows_of`). Plain text, so that SQLAlchemy
    adds no ``RETURNING id`` nobody reads.
    """
    return sa.text(
        f'INSERT INTO "{t.schema}".outbox (msg_id, subject, headers, payload) '
        "VALUES (:msg_id, :subject, :headers, :payload)"
    ).bindparams(
        sa.bindparam("headers", type_=sa.LargeBinary),
        sa.bindparam("payload", type_=sa.LargeBinary),
    )


def _pending(c: Any) -> tuple[sa.ColumnElement[bool], ...]:
    return (c.published_at.is_(None), c.parked_at.is_(None))


def pending(
    t: models.Tables,
    limit: int,
    held: Sequence[str] = (),
    marking: Sequence[int] = (),
) -> sa.Select[Any]:
    """The oldest rows neither published nor parked, in id order, skipping ``held`` subjects
    and the rows ``marking`` (sorted ids: published, their mark still in flight).

    The rows ``marking`` are skipped as if their mark had committed, so the rows
    read, and their order, are the same as after it. The ids around them are read
    as ranges of the pending index; only those between the first and the last of
    ``marking`` (the rows in flight, and any that committed after the read that
    found those) are tested against them.
    """
    c = t.outbox.c
    stmt = sa.select(*(c[name] for name in PENDING_COLUMNS)).where(*_pending(c))
    if held:
        stmt = stmt.where(c.subject.not_in(list(held)))
    if not marking:
        return stmt.order_by(c.id).limit(limit)
    lo, hi = marking[0], marking[-1]
    in_flight = sa.select(
        sa.func.unnest(
            sa.bindparam("marking", list(marking), type_=postgresql.ARRAY(sa.BigInteger))
        )
    ).scalar_subquery()
    parts = (
        stmt.where(c.id < lo),
        stmt.where(c.id.between(lo, hi), c.id.not_in(in_flight)),
        stmt.where(c.id > hi),
    )
    both = sa.union_all(*(part.order_by(c.id).limit(limit) for part in parts)).subquery()
    return sa.select(*(both.c[name] for name in PENDING_COLUMNS)).order_by(both.c.id).limit(limit)


def mark_published(t: models.Tables, ids: list[int], streams: list[str], seqs: list[int]) -> Any:
    """Record the PubAcks of rows ``ids`` (their stream and sequence), in one statement."""
    return sa.text(
        f'UPDATE "{t.schema}".outbox AS o SET published_at = now(), stream = v.stream, '
        "stream_seq = v.seq FROM unnest(CAST(:ids AS bigint[]), CAST(:streams AS text[]), "
        "CAST(:seqs AS bigint[])) AS v(id, stream, seq) "
        "WHERE o.id = v.id AND o.published_at IS NULL"
    ).bindparams(ids=ids, streams=streams, seqs=seqs)


def count_attempt(t: models.Tables, ids: list[int], error: str) -> sa.Update:
    """Count a refused publish of rows ``ids``; returns each row's id and attempts."""
    c = t.outbox.c
    return (
        sa.update(t.outbox)
        .where(c.id.in_(ids), *_pending(c))
        .values(attempts=c.attempts + 1, last_error=error)
        .returning(c.id, c.attempts)
    )


def park(t: models.Tables, ids: list[int], reason: str, error: str) -> sa.Update:
    """Park rows ``ids``: not published until an operator retries them."""
    c = t.outbox.c
    return (
        sa.update(t.outbox)
        .where(c.id.in_(ids), *_pending(c))
        .values(parked_at=sa.func.now(), park_reason=reason, last_error=error)
        .returning(c.id)
    )


def park_subject(t: models.Tables, subject: str, reason: str, error: str) -> sa.Update:
    """Park every pending row to ``subject`` (its refusals are spent)."""
    c = t.outbox.c
    return (
        sa.update(t.outbox)
        .where(c.subject == subject, *_pending(c))
        .values(parked_at=sa.func.now(), park_reason=reason, last_error=error)
        .returning(c.id)
    )


def take_lease(t: models.Tables, holder: str, ttl_s: float) -> sa.TextClause:
    """Take or renew the relay lease for ``holder``; returns a row only if ``holder`` has it.

    The lease's expiry is the database's clock, so relays on several hosts
    agree on it whatever their own clocks say.
    """
    return sa.text(
        f'INSERT INTO "{t.schema}".relay_leases AS l (name, holder, expires_at) '
        "VALUES (:name, :holder, now() + make_interval(secs => :ttl)) "
        "ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, "
        "expires_at = EXCLUDED.expires_at "
        "WHERE l.holder = EXCLUDED.holder OR l.expires_at < now() "
        "RETURNING l.holder"
    ).bindparams(name=models.RELAY_LEASE, holder=holder, ttl=ttl_s)


def release_lease(t: models.Tables, holder: str) -> sa.Delete:
    """Give the lease up (a stopping relay), so a standby takes it at once."""
    c = t.relay_leases.c
    return sa.delete(t.relay_leases).where(c.name == models.RELAY_LEASE, c.holder == holder)


def purge_published(t: models.Tables, keep_s: float, limit: int) -> sa.Delete:
    """Delete up to ``limit`` rows published more than ``keep_s`` ago, oldest first."""
    c = t.outbox.c
    old = (
        sa.select(c.id)
        .where(
            c.published_at.is_not(None),
            c.published_at < sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, keep_s),
        )
        .order_by(c.published_at)
        .limit(limit)
        .scalar_subquery()
    )
    return sa.delete(t.outbox).where(c.id.in_(old))


def summary(t: models.Tables) -> sa.Select[Any]:
    """Pending rows, the age in seconds of the oldest, parked rows; the lease's holder and
    the seconds until it expires.

    Each part reads its own partial index: the published rows kept for
    ``outbox_keep_s`` may be many, and are never scanned.
    """
    c = t.outbox.c
    pending = sa.select(sa.func.count()).select_from(t.outbox).where(*_pending(c))
    oldest = sa.select(c.created_at).where(*_pending(c)).order_by(c.id).limit(1)
    parked = sa.select(sa.func.count()).select_from(t.outbox).where(c.parked_at.is_not(None))
    lease = t.relay_leases.c
    current = (lease.name == models.RELAY_LEASE, lease.expires_at > sa.func.now())
    holder = sa.select(lease.holder).where(*current)
    expires_in = sa.select(sa.extract("epoch", lease.expires_at - sa.func.now())).where(*current)
    return sa.select(
        pending.scalar_subquery(),
        sa.extract("epoch", sa.func.now() - oldest.scalar_subquery()),
        parked.scalar_subquery(),
        holder.scalar_subquery(),
        expires_in.scalar_subquery(),
    )


def where(
    t: models.Tables, *, state: str, ids: Sequence[int] = (), subject: str | None = None
) -> list[sa.ColumnElement[bool]]:
    """Conditions for the operators' commands: rows in ``state`` (parked, pending,
    published or all), optionally by id or subject."""
    c = t.outbox.c
    conditions: list[sa.ColumnElement[bool]] = []
    if state == "parked":
        conditions.append(c.parked_at.is_not(None))
    elif state == "pending":
        conditions.extend(_pending(c))
    elif state == "published":
        conditions.append(c.published_at.is_not(None))
    if ids:
        conditions.append(c.id.in_(list(ids)))
    if subject is not None:
        conditions.append(c.subject == subject)
    return conditions


def select_rows(
    t: models.Tables, conditions: Sequence[sa.ColumnElement[bool]], limit: int
) -> sa.Select[Any]:
    """Rows for ``eop outbox list``, oldest first, without their payloads."""
    c = t.outbox.c
    return (
        sa.select(
            c.id,
            c.msg_id,
            c.subject,
            sa.func.octet_length(c.payload),
            c.created_at,
            c.attempts,
            c.parked_at,
            c.park_reason,
            c.last_error,
            c.published_at,
            c.stream,
            c.stream_seq,
        )
        .where(*conditions)
        .order_by(c.id)
        .limit(limit)
    )


def unpark(t: models.Tables, conditions: Sequence[sa.ColumnElement[bool]]) -> sa.Update:
    """Queue parked rows again (``eop outbox retry``): their attempts start over."""
    c = t.outbox.c
    return (
        sa.update(t.outbox)
        .where(c.parked_at.is_not(None), *conditions)
        .values(parked_at=None, park_reason=None, attempts=0)
        .returning(c.id)
    )


def delete_rows(t: models.Tables, conditions: Sequence[sa.ColumnElement[bool]]) -> Any:
    """Delete rows (``eop outbox purge``), returning their ids."""
    return sa.delete(t.outbox).where(*conditions).returning(t.outbox.c.id)


def rows_after(t: models.Tables, after_id: int) -> sa.Select[Any]:
    """Rows with an id above ``after_id``, in id order: what transactions added since."""
    c = t.outbox.c
    return (
        sa.select(c.id, c.msg_id, c.subject, c.headers, c.payload)
        .where(c.id > after_id)
        .order_by(c.id)
    )
