"""Ack floors as the workers observe them: since when a delivery has waited unacknowledged.

JetStream tells how far a consumer's ack floor is and what it delivered, not
when any one delivery happened; its floor's ``last_active`` moves with every
ack, the floor or not. So each worker reads its consumers now and then
(:mod:`eop.protocol.unacked`) and keeps, per consumer, the floor and when a
reading first found a delivery above it unacknowledged. While the floor
stays there, that delivery (the consumer's first message above its floor)
has waited at least since then: the floor only rises, and it would have
risen past the delivery once acked. ``eop audit``, ``eop status`` and the
worker's metric all measure a stuck delivery by this one rule
(:func:`waited_s`).
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from eop.pg import models
from eop.pg.sql import floors as sql


@dataclasses.dataclass(frozen=True)
class Observed:
    """A consumer as a worker last observed it."""

    consumer: str
    partition: int | None
    consumer_created: datetime.datetime | None
    floor: int
    delivered: int
    """Its delivered sequence when the wait began: the waiting delivery is at or below it."""
    waiting_since: datetime.datetime | None
    """When a reading first found a delivery above :attr:`floor` unacknowledged (the
    database's clock); None when the last reading found none."""
    waited_s: float | None
    """Seconds from :attr:`waiting_since` to when the row was read."""
    observed_at: datetime.datetime


def _row(r: Any) -> Observed:
    return Observed(
        consumer=str(r.consumer),
        partition=r.partition,
        consumer_created=r.consumer_created,
        floor=int(r.floor_seq),
        delivered=int(r.delivered_seq),
        waiting_since=r.waiting_since,
        waited_s=None if r.waited_s is None else float(r.waited_s),
        observed_at=r.observed_at,
    )


async def observe(
    engine: AsyncEngine,
    t: models.Tables,
    *,
    subscription: str,
    stream: str,
    consumer: str,
    partition: int | None,
    created: datetime.datetime | None,
    floor: int,
    delivered: int,
    ack_pending: int,
) -> Observed | None:
    """Record a reading of ``consumer``; the row after it (None: an older reading than
    the row's, ignored)."""
    stmt = sql.observe(
        t,
        subscription=subscription,
        stream=stream,
        consumer=consumer,
        partition=partition,
        created=created,
        floor=floor,
        delivered=delivered,
        waiting=ack_pending > 0 and delivered > floor,
    )
    async with engine.begin() as conn:
        row = (await conn.execute(stmt)).one_or_none()
        if partition is not None and row is not None:
            await conn.execute(sql.forget_others(t, subscription, stream, partition, consumer))
    return None if row is None else _row(row)


async def read(
    engine: AsyncEngine, t: models.Tables, subscription: str, stream: str
) -> dict[str, Observed]:
    """The subscription's consumers as last observed, by name."""
    async with engine.connect() as conn:
        rows = (await conn.execute(sql.read(t, subscription, stream))).all()
    return {str(r.consumer): _row(r) for r in rows}


def waited_s(row: Observed | None, floor: int, created: datetime.datetime | None) -> float | None:
    """How long, at least, the delivery just above ``floor`` has waited unacknowledged.

    ``floor`` and ``created`` are the consumer's, read after ``row`` was: if
    the floor is still the one the row's wait began at (and the consumer the
    same incarnation), the delivery above it waited all along. None when
    that cannot be told: no wait recorded, or the floor moved since.
    """
    if row is None or row.waiting_since is None or row.waited_s is None:
        return None
    if row.floor != floor:
        return None
    recreated = (
        created is not None
        and row.consumer_created is not None
        and abs((row.consumer_created - created).total_seconds()) > 1e-3
    )
    if recreated:
        # Another consumer of the same name since: its floor starts anew.
        return None
    return max(row.waited_s, 0.0)
