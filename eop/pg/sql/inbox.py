"""The inbox: the watermark and its compaction, look-ups by key and msg-id, the
unclaim and the dead letter a worker writes (the claim is :mod:`eop.pg.sql.claim`)."""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from eop.pg import models
from eop.pg.sql.base import (
    Bound,
    commits_unflushed,
    epoch_params,
    in_bound_epoch,
    in_bound_inbox_key,
    in_bound_key,
    in_bound_lane,
    in_epoch,
    in_lane,
    key_params,
    msg_id_digest,
    waits_for_locks_at_most,
)


def watermark(t: models.Tables, subscription: str, stream: str, epoch: str) -> sa.Select[int]:
    """The watermark of a subscription on one stream epoch."""
    w = t.watermarks.c
    return sa.select(w.watermark).where(*in_epoch(w, subscription, stream, epoch))


def superseded_epochs(t: models.Tables, subscription: str, stream: str, current: str) -> Bound:
    """The epochs of a subscription's stream other than ``current`` that have a watermark row,
    with their watermarks: the stream's earlier incarnations, once ``current`` is read as
    the stream's epoch before and after this statement (docs/design.md, 'The watermark')."""
    return _superseded_epochs(t), epoch_params(subscription, stream, current)


@functools.cache
def _superseded_epochs(t: models.Tables) -> sa.Executable:
    w = t.watermarks.c
    subscription, stream, epoch = in_bound_epoch(w)
    return sa.select(w.stream_epoch, w.watermark).where(subscription, stream, ~epoch)


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
    t: models.Tables, subscription: str, stream: str, epoch: str, value: int, lock_wait_ms: int
) -> Bound:
    """Raise the watermark to ``value``; it never goes backwards. RETURNING the new value.

    It waits at most ``lock_wait_ms`` for the claims that hold the row ``FOR SHARE``
    (:func:`eop.pg.sql.base.waits_for_locks_at_most`), then fails (SQLSTATE 55P03):
    claims held up on hot rows can keep the row shared for minutes, and a raise
    waiting behind them would hold a pool connection all that time, one per round.
    The next round tries again.

    Sent alone, outside any transaction block (docs/design.md, 'The watermark'):
    claims read the row ``FOR SHARE``, so from the moment the UPDATE has the row
    until its COMMIT every new claim of the epoch waits. As one statement that
    commits without waiting for its WAL flush (:func:`eop.pg.sql.base.commits_unflushed`),
    it holds the row for as long as PostgreSQL takes to update it, not for a
    round trip to the worker and a disk flush. A raise lost in a crash harms
    nothing: the watermark it named was at or below the ack floor, and any
    delete below it commits after it, flushing the WAL up to and past it first.
    """
    params = {
        **epoch_params(subscription, stream, epoch),
        "p_value": value,
        "p_lock_wait": f"{lock_wait_ms}ms",
    }
    return _advance_watermark(t), params


@functools.cache
def _advance_watermark(t: models.Tables) -> sa.Executable:
    w = t.watermarks.c
    value = sa.bindparam("p_value", type_=sa.BigInteger)
    return (
        sa.update(t.watermarks)
        .where(*in_bound_epoch(w), commits_unflushed(), waits_for_locks_at_most())
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
