"""The SQL of the ack floors as workers observe them (:mod:`eop.pg.floors`).

Every time is the database's (``clock_timestamp()``): the wait a worker
started and the wait ``eop audit`` reads are measured on one clock, whatever
the hosts' clocks say.
"""

from __future__ import annotations

import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from eop.pg import models


def _waited_s(c: Any) -> Any:
    """Seconds since ``waiting_since``, on the database's clock (NULL when nothing waits)."""
    return sa.func.extract("epoch", sa.func.clock_timestamp() - c.waiting_since)


def observe(
    t: models.Tables,
    *,
    subscription: str,
    stream: str,
    consumer: str,
    partition: int | None,
    created: datetime.datetime | None,
    floor: int,
    delivered: int,
    waiting: bool,
) -> Any:
    """Record one reading of a consumer; returns the row as it stands after it.

    The wait starts (``waiting_since``) at the first reading that found a
    delivery above the floor unacknowledged, and lasts while later readings
    find the floor where it was: the floor only ever rises, so the delivery
    just above it has been unacknowledged all along. A reading older than the
    row (a lower floor of the same consumer) changes nothing and returns no
    row. A partition's new consumer starts at its predecessor's floor: at the
    same floor, it continues the predecessor's wait (same message, still
    unacknowledged).
    """
    c = t.ack_floors.c
    before = (
        sa.select(c.waiting_since, c.delivered_seq)
        .where(
            c.subscription == subscription,
            c.stream == stream,
            c.partition == partition,
            c.consumer != consumer,
            c.floor_seq == floor,
            c.waiting_since.is_not(None),
        )
        .order_by(c.waiting_since)
        .limit(1)
        .subquery()
    )
    now = sa.func.clock_timestamp()
    if waiting and partition is not None:
        since: Any = sa.func.coalesce(sa.select(before.c.waiting_since).scalar_subquery(), now)
        reached: Any = sa.func.coalesce(
            sa.select(before.c.delivered_seq).scalar_subquery(), delivered
        )
    else:
        since = now if waiting else sa.null()
        reached = delivered
    stmt = postgresql.insert(t.ack_floors).values(
        stream=stream,
        consumer=consumer,
        subscription=subscription,
        partition=partition,
        consumer_created=created,
        floor_seq=floor,
        delivered_seq=reached,
        waiting_since=since,
        observed_at=now,
    )
    new = stmt.excluded
    same = sa.and_(
        c.floor_seq == new.floor_seq,
        c.consumer_created.is_not_distinct_from(new.consumer_created),
        c.waiting_since.is_not(None),
    )
    keeps = sa.and_(same, new.waiting_since.is_not(None))
    return stmt.on_conflict_do_update(
        index_elements=["stream", "consumer"],
        set_={
            "subscription": new.subscription,
            "partition": new.partition,
            "consumer_created": new.consumer_created,
            "floor_seq": new.floor_seq,
            "waiting_since": sa.case((keeps, c.waiting_since), else_=new.waiting_since),
            "delivered_seq": sa.case((keeps, c.delivered_seq), else_=new.delivered_seq),
            "observed_at": new.observed_at,
        },
        where=sa.or_(
            new.floor_seq >= c.floor_seq,
            c.consumer_created.is_distinct_from(new.consumer_created),
        ),
    ).returning(*_columns(t))


def _columns(t: models.Tables) -> tuple[Any, ...]:
    c = t.ack_floors.c
    return (
        c.consumer,
        c.partition,
        c.consumer_created,
        c.floor_seq,
        c.delivered_seq,
        c.waiting_since,
        _waited_s(c).label("waited_s"),
        c.observed_at,
    )


def forget_others(
    t: models.Tables, subscription: str, stream: str, partition: int, consumer: str
) -> sa.Delete:
    """Forget a partition's earlier consumers (retired once its current one took over)."""
    c = t.ack_floors.c
    return sa.delete(t.ack_floors).where(
        c.subscription == subscription,
        c.stream == stream,
        c.partition == partition,
        c.consumer != consumer,
    )


def read(t: models.Tables, subscription: str, stream: str) -> sa.Select[Any]:
    """The subscription's consumers as last observed, with how long each one's oldest
    delivery has waited (NULL when none did)."""
    c = t.ack_floors.c
    return sa.select(*_columns(t)).where(c.subscription == subscription, c.stream == stream)
