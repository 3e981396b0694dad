"""Stuck deliveries in ``eop status``: each consumer's oldest unacknowledged delivery.

By the rule the workers record and ``eop audit`` applies
(:mod:`eop.pg.floors`): the database's record of each consumer, read first,
then the consumer; while its ack floor is where a recorded wait began, the
message just above the floor has waited unacknowledged since then. Longer
than ``stuck_after_ack_waits`` AckWaits is a stuck delivery, an anomaly.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping

from nats.aio.client import Client as NATS

from eop.broker import floors as nats_floors
from eop.pg import floors as pg_floors
from eop.settings import Settings

STUCK_DELIVERY = "stuck_delivery"


@dataclasses.dataclass(frozen=True)
class Oldest:
    """A consumer's oldest unacknowledged delivery, and how long it has waited at least."""

    consumer: str
    partition: int | None
    seq: int
    waited_s: float
    since: datetime.datetime | None
    ack_floor: int
    stuck_after_s: float

    @property
    def stuck(self) -> bool:
        """Waited longer than the stuck bound."""
        return self.waited_s > self.stuck_after_s

    def describe(self) -> str:
        """The anomaly's line."""
        where = "" if self.partition is None else f"partition {self.partition}: "
        since = (
            ""
            if self.since is None
            else f" (ack floor {self.ack_floor} unmoved since "
            f"{self.since.astimezone(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC)"
        )
        return (
            f"{STUCK_DELIVERY}: {where}seq {self.seq} of consumer {self.consumer!r} delivered "
            f"but unacknowledged for at least {self.waited_s:.0f} s, longer than "
            f"{self.stuck_after_s:g} s{since}"
        )


async def oldest(
    nc: NATS,
    stream: str,
    names: Mapping[int | None, str | None],
    observed: Mapping[str, pg_floors.Observed],
    settings: Settings,
) -> list[Oldest]:
    """The oldest unacknowledged delivery of each of ``names`` (by partition; None for a
    handler's durable) whose wait is known; ``observed`` was read before this call."""
    found = []
    for partition, name in names.items():
        if name is None:
            continue
        read = await nats_floors.read(nc, stream, name)
        if read is None:
            continue
        row = observed.get(name)
        waited = pg_floors.waited_s(row, read.floor, read.created)
        if waited is None or row is None:
            continue
        seq = await nats_floors.first_above(nc, stream, read.filters, read.floor)
        if seq is None or seq > row.delivered:
            # Not the message the wait began with (it was deleted from the stream).
            continue
        found.append(
            Oldest(
                consumer=name,
                partition=partition,
                seq=seq,
                waited_s=waited,
                since=row.waiting_since,
                ack_floor=read.floor,
                stuck_after_s=settings.stuck_after_ack_waits * read.ack_wait_s,
            )
        )
    return found
