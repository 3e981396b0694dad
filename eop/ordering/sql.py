"""The SQL of ordered handlers' partitions: members, leases, epochs (docs/ordering.md).

Every lease runs on the database's clock (``now()``), so processes on hosts
whose clocks disagree still agree on who owns what.
"""

from __future__ import annotations

import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from eop.pg import models


def tick_timeouts(lock_ms: int, statement_ms: int, idle_ms: int) -> sa.TextClause:
    """The tick transaction's local timeouts, ``idle_in_transaction_session_timeout``
    included: a process frozen (SIGSTOP, a pause) in the middle of its tick would
    otherwise keep its partitions' rows locked, and nobody could take them over,
    for as long as it stays frozen."""
    return sa.text(
        "SELECT set_config('lock_timeout', :lock, true), "
        "set_config('statement_timeout', :stmt, true), "
        "set_config('idle_in_transaction_session_timeout', :idle, true)"
    ).bindparams(lock=f"{lock_ms}ms", stmt=f"{statement_ms}ms", idle=f"{idle_ms}ms")


def _ttl(seconds: float) -> Any:
    return sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, seconds)


def join(
    t: models.Tables, subscription: str, member: str, host: str, pid: int, ttl_s: float
) -> Any:
    """Add ``member`` to the subscription's live members, or renew it."""
    stmt = postgresql.insert(t.members).values(
        subscription=subscription, member=member, host=host, pid=pid, expires_at=_ttl(ttl_s)
    )
    return stmt.on_conflict_do_update(
        index_elements=["subscription", "member"], set_={"expires_at": stmt.excluded.expires_at}
    )


def prune(t: models.Tables, subscription: str) -> sa.Delete:
    """Forget the members whose lease ran out (a process that died)."""
    c = t.members.c
    return sa.delete(t.members).where(c.subscription == subscription, c.expires_at < sa.func.now())


def leave(t: models.Tables, subscription: str, member: str) -> sa.Delete:
    """Take ``member`` out of the subscription (a process stopping)."""
    c = t.members.c
    return sa.delete(t.members).where(c.subscription == subscription, c.member == member)


def live_members(t: models.Tables, subscription: str, left_s: float) -> sa.Select[Any]:
    """The names of the members with at least ``left_s`` of their membership lease still
    to run (renewed lately: a member renews at every tick), in a fixed order (every member
    ranks them the same).

    Not every member whose lease has yet to run out: a process killed (or frozen) keeps
    its row until then, and the partitions its rank would give it, when one is given up
    (a stop, a rebalance), would wait that long for an owner. Ranking only the members
    that ticked lately, the others take them at their next tick.
    """
    c = t.members.c
    return (
        sa.select(c.member)
        .where(c.subscription == subscription, c.expires_at >= _ttl(left_s))
        .order_by(c.member)
    )


def create_partitions(t: models.Tables, subscription: str, count: int) -> Any:
    """The subscription's partition rows, 0 to ``count - 1``, where they are missing."""
    series = sa.select(
        sa.literal(subscription, sa.Text),
        sa.column("n", sa.Integer),
        sa.literal(count, sa.Integer),
    ).select_from(sa.func.generate_series(0, count - 1).alias("n"))
    stmt = postgresql.insert(t.partitions).from_select(
        ["subscription", "partition", "partition_count"], series
    )
    return stmt.on_conflict_do_nothing()


def partition_counts(t: models.Tables, subscription: str) -> sa.Select[Any]:
    """The partition counts the subscription's rows were made with (one, unless changed)."""
    c = t.partitions.c
    return sa.select(c.partition_count).where(c.subscription == subscription).distinct()


def renew(t: models.Tables, subscription: str, member: str, ttl_s: float) -> Any:
    """Extend ``member``'s leases; returns the partitions it still owns, with their epochs."""
    c = t.partitions.c
    return (
        sa.update(t.partitions)
        .where(c.subscription == subscription, c.owner == member, c.expires_at >= sa.func.now())
        .values(expires_at=_ttl(ttl_s))
        .returning(c.partition, c.epoch)
    )


def acquire(
    t: models.Tables,
    subscription: str,
    member: str,
    host: str,
    pid: int,
    ttl_s: float,
    limit: int,
) -> Any:
    """Take up to ``limit`` partitions nobody owns (or whose lease ran out), raising each
    one's epoch; returns each with its new epoch, the consumer of the one before, and
    whether that one was released (:func:`release`: its runs all ended) rather than
    expired or given up with runs cut short (:func:`expire`).

    ``SKIP LOCKED``: two members acquiring at once take different partitions.
    """
    c = t.partitions.c
    free = (
        sa.select(c.partition, c.owner.is_(None).label("released"))
        .where(
            c.subscription == subscription,
            sa.or_(c.owner.is_(None), c.expires_at < sa.func.now()),
        )
        .order_by(c.partition)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .cte("free")
    )
    return (
        sa.update(t.partitions)
        .where(c.subscription == subscription, c.partition == free.c.partition)
        .values(
            owner=member,
            owner_host=host,
            owner_pid=pid,
            epoch=c.epoch + 1,
            expires_at=_ttl(ttl_s),
            acquired_at=sa.func.now(),
        )
        .returning(c.partition, c.epoch, c.consumer, free.c.released)
    )


def record_consumer(
    t: models.Tables, subscription: str, partition: int, epoch: int, consumer: str
) -> sa.Update:
    """Name the consumer of ``partition``'s ownership ``epoch`` (if it is still current)."""
    c = t.partitions.c
    return (
        sa.update(t.partitions)
        .where(c.subscription == subscription, c.partition == partition, c.epoch == epoch)
        .values(consumer=consumer)
    )


def record_handover(
    t: models.Tables, subscription: str, partition: int, epoch: int, first: int, last: int
) -> Any:
    """Note that ownership ``epoch``'s consumer delivers ``first``..``last`` again."""
    return (
        postgresql.insert(t.handovers)
        .values(
            subscription=subscription,
            partition=partition,
            epoch=epoch,
            first_seq=first,
            last_seq=last,
        )
        .on_conflict_do_nothing()
    )


def forget_handovers(t: models.Tables, subscription: str, partition: int, below: int) -> sa.Delete:
    """Drop the ranges wholly below ``below``: every message there has its outcome."""
    c = t.handovers.c
    return sa.delete(t.handovers).where(
        c.subscription == subscription, c.partition == partition, c.last_seq < below
    )


def handovers(t: models.Tables, subscription: str, partition: int) -> sa.Select[Any]:
    """The partition's redelivered ranges (first_seq, last_seq)."""
    c = t.handovers.c
    return (
        sa.select(c.first_seq, c.last_seq)
        .where(c.subscription == subscription, c.partition == partition)
        .order_by(c.epoch)
    )


def _members_partitions(
    t: models.Tables, subscription: str, member: str, partitions: list[int]
) -> sa.Update:
    """An UPDATE of ``partitions`` where ``member`` owns them."""
    c = t.partitions.c
    return sa.update(t.partitions).where(
        c.subscription == subscription, c.owner == member, c.partition.in_(partitions)
    )


def release(t: models.Tables, subscription: str, member: str, partitions: list[int]) -> sa.Update:
    """Give ``partitions`` up, so that another member takes them at once."""
    return _members_partitions(t, subscription, member, partitions).values(
        owner=None, owner_host=None, owner_pid=None, expires_at=None
    )


def expire(t: models.Tables, subscription: str, member: str, partitions: list[int]) -> sa.Update:
    """Give ``partitions`` up as if their lease had run out, so that another member takes
    them at once and counts what their consumer delivered as runs (some were cut short)."""
    return _members_partitions(t, subscription, member, partitions).values(
        expires_at=sa.func.now() - datetime.timedelta(seconds=1)
    )


def consumers(t: models.Tables, subscription: str) -> sa.Select[Any]:
    """Each partition's current consumer (None before its first owner)."""
    c = t.partitions.c
    return (
        sa.select(c.partition, c.consumer)
        .where(c.subscription == subscription)
        .order_by(c.partition)
    )


def status(t: models.Tables) -> sa.Select[Any]:
    """Every partition of every ordered handler, its owner and lease, for ``eop status``."""
    c = t.partitions.c
    return sa.select(
        c.subscription,
        c.partition,
        c.partition_count,
        c.owner_host,
        c.owner_pid,
        c.epoch,
        c.consumer,
        c.acquired_at,
        sa.extract("epoch", c.expires_at - sa.func.now()).label("expires_in_s"),
    ).order_by(c.subscription, c.partition)


def member_status(t: models.Tables) -> sa.Select[Any]:
    """The live members of every ordered handler."""
    c = t.members.c
    return (
        sa.select(c.subscription, c.host, c.pid, c.joined_at)
        .where(c.expires_at >= sa.func.now())
        .order_by(c.subscription, c.host, c.pid)
    )


def fence_partitions(t: models.Tables, subscription: str, member: str) -> sa.Select[Any]:
    """The partitions ``member`` owns on an unexpired lease, share-locked to the end of the
    transaction: a member's ``acquire`` (``FOR UPDATE SKIP LOCKED``) passes them by, while
    the owner's own renewal (no key column changes) is not held up."""
    c = t.partitions.c
    return (
        sa.select(c.partition)
        .where(c.subscription == subscription, c.owner == member, c.expires_at >= sa.func.now())
        .with_for_update(read=True, key_share=True)
    )


def fence_member(t: models.Tables, subscription: str, member: str) -> sa.Select[Any]:
    """``member``'s row if its lease has not run out."""
    c = t.members.c
    return sa.select(c.member).where(
        c.subscription == subscription, c.member == member, c.expires_at >= sa.func.now()
    )


def holders(t: models.Tables, subscription: str) -> sa.CompoundSelect[Any]:
    """(name, host, pid) of the subscription's live members and unexpired partition owners."""
    m, p = t.members.c, t.partitions.c
    members = sa.select(m.member, m.host, m.pid).where(
        m.subscription == subscription, m.expires_at >= sa.func.now()
    )
    owners = sa.select(p.owner, p.owner_host, p.owner_pid).where(
        p.subscription == subscription, p.owner.is_not(None), p.expires_at >= sa.func.now()
    )
    return sa.union(members, owners)
