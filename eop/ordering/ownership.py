"""Partition ownership of ordered handlers in the database (docs/ordering.md).

One short transaction a tick per process and ordered handler: renew the
member and its leases, count the live members, give up or take partitions.
The policy (how many partitions a member should own) is the caller's;
this module only runs the statements.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from eop import errors
from eop.ordering import sql
from eop.pg import models

#: The members ranked for shares are those with at least this part of their membership
#: lease still to run: each renews it every third of the lease, so a live one has two
#: thirds or more, less however late its tick runs. A member killed or frozen drops out
#: of the ranking half a lease after its last tick instead of a whole one.
CURRENT_LEASE_LEFT = 0.5


@dataclasses.dataclass(frozen=True)
class Member:
    """One process running an ordered handler: its name in the tables, host and pid."""

    name: str
    host: str
    pid: int


@dataclasses.dataclass(frozen=True)
class Acquired:
    """A partition just taken: its new epoch and the consumer its previous owner used."""

    partition: int
    epoch: int
    previous_consumer: str | None
    released: bool = False
    """Its previous owner released it with every run ended: what that owner's consumer
    delivered and never ran is no run of a crash loop."""


@dataclasses.dataclass(frozen=True)
class Tick:
    """What one tick found: the live members (ranked) and what this member owns now."""

    members: tuple[str, ...]
    owned: dict[int, int]
    """Partition -> epoch, for every lease renewed or taken in this tick."""
    acquired: tuple[Acquired, ...]


@dataclasses.dataclass(frozen=True)
class Handovers:
    """The ranges of a partition that earlier owners' consumers delivered and a later
    one delivered again: each counts one earlier delivery of the messages in it."""

    ranges: tuple[tuple[int, int], ...] = ()

    def earlier(self, seq: int) -> int:
        """Deliveries of message ``seq`` by consumers of earlier owners."""
        return sum(1 for first, last in self.ranges if first <= seq <= last)


class Ownership:
    """The statements of one ordered handler's ownership, on ``engine``."""

    def __init__(
        self,
        engine: AsyncEngine,
        tables: models.Tables,
        subscription: str,
        count: int,
        member: Member,
        lease_s: float,
    ) -> None:
        self.engine = engine
        self.tables = tables
        self.subscription = subscription
        self.count = count
        self.member = member
        self.lease_s = lease_s

    async def prepare(self) -> None:
        """Create the partition rows; refuse a partition count other than the rows'.

        A key's partition is its hash modulo the count: another count would
        send a key's next messages to another partition while its earlier
        ones may still wait in the old one.
        """
        t, s = self.tables, self.subscription
        async with self.engine.begin() as conn:
            counts = [int(r[0]) for r in (await conn.execute(sql.partition_counts(t, s))).all()]
            if counts and counts != [self.count]:
                raise errors.ConfigurationError(
                    f"handler {s!r} has {', '.join(map(str, counts))} partitions in the database "
                    f"but declares partitions={self.count}: a key would move to another "
                    "partition while its earlier messages wait in the old one. Keep "
                    f"partitions={counts[0]}, or change it as docs/ordering.md says (drain "
                    f"the handler, stop its workers, delete its rows from {t.schema}.partitions, "
                    "recreate the stream with the new transform)"
                )
            await conn.execute(sql.create_partitions(t, s, self.count))

    async def tick(
        self,
        want: int,
        releasing: list[int],
        expiring: Sequence[int] = (),
        taking: Callable[[], bool] = lambda: True,
    ) -> Tick:
        """Renew this member and its leases, give up ``releasing`` (every run of theirs
        ended) and ``expiring`` (some cut short), take up to ``want`` more partitions than
        it keeps, if ``taking()`` still says so once renewed; one transaction."""
        t, s, m, lease = self.tables, self.subscription, self.member, self.lease_s
        async with self.engine.begin() as conn:
            await conn.execute(sql.tick_timeouts(2000, 5000, int(lease * 500)))
            await conn.execute(sql.join(t, s, m.name, m.host, m.pid, lease))
            await conn.execute(sql.prune(t, s))
            if releasing:
                await conn.execute(sql.release(t, s, m.name, releasing))
            if expiring:
                await conn.execute(sql.expire(t, s, m.name, list(expiring)))
            ranked = sql.live_members(t, s, lease * CURRENT_LEASE_LEFT)
            members = tuple(r[0] for r in (await conn.execute(ranked)).all())
            renewed = (await conn.execute(sql.renew(t, s, m.name, lease))).all()
            owned = {int(r[0]): int(r[1]) for r in renewed}
            acquired: list[Acquired] = []
            need = want - len(owned)
            if need > 0 and taking():
                rows = (
                    await conn.execute(sql.acquire(t, s, m.name, m.host, m.pid, lease, need))
                ).all()
                for row in rows:
                    acquired.append(Acquired(int(row[0]), int(row[1]), row[2], bool(row[3])))
                    owned[int(row[0])] = int(row[1])
        return Tick(members=members, owned=owned, acquired=tuple(acquired))

    async def record_consumer(
        self,
        partition: int,
        epoch: int,
        consumer: str,
        redelivers: tuple[int, int] | None = None,
        *,
        counted: bool = True,
    ) -> Handovers | None:
        """Name the consumer of this ownership, which ``redelivers`` a range its
        predecessors delivered without an ack; the partition's ranges so redelivered
        (None if the partition moved on meanwhile). ``counted`` False: the previous owner
        released the partition with every run ended, so its range is no crash loop's and
        is not recorded (earlier owners' ranges still are)."""
        t, s = self.tables, self.subscription
        async with self.engine.begin() as conn:
            result: Any = await conn.execute(sql.record_consumer(t, s, partition, epoch, consumer))
            if not result.rowcount:
                return None
            if redelivers is not None:
                first, last = redelivers
                await conn.execute(sql.forget_handovers(t, s, partition, first))
                if counted and first <= last:
                    await conn.execute(sql.record_handover(t, s, partition, epoch, first, last))
            rows = (await conn.execute(sql.handovers(t, s, partition))).all()
        return Handovers(tuple((int(r[0]), int(r[1])) for r in rows))

    async def leave(self, partitions: list[int], *, clean: bool = True) -> None:
        """Give every partition up and leave (a stopping process); ``clean`` False: some
        runs were cut short (:meth:`tick`'s ``expiring``)."""
        t, s, m = self.tables, self.subscription, self.member.name
        async with self.engine.begin() as conn:
            if partitions:
                give_up = sql.release if clean else sql.expire
                await conn.execute(give_up(t, s, m, partitions))
            await conn.execute(sql.leave(t, s, m))

    async def consumers(self) -> dict[int, str | None]:
        """Each partition's current consumer."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(sql.consumers(self.tables, self.subscription))).all()
        return {int(r[0]): r[1] for r in rows}


@dataclasses.dataclass(frozen=True)
class PartitionRow:
    """One partition as ``eop status`` shows it."""

    subscription: str
    partition: int
    count: int
    host: str | None
    pid: int | None
    epoch: int
    consumer: str | None
    acquired_at: datetime.datetime | None
    expires_in_s: float | None


async def read_status(engine: AsyncEngine, tables: models.Tables) -> list[PartitionRow]:
    """Every ordered handler's partitions and their owners."""
    async with engine.connect() as conn:
        rows = (await conn.execute(sql.status(tables))).all()
    return [
        PartitionRow(
            subscription=r[0],
            partition=int(r[1]),
            count=int(r[2]),
            host=r[3],
            pid=r[4],
            epoch=int(r[5]),
            consumer=r[6],
            acquired_at=r[7],
            expires_in_s=float(r[8]) if r[8] is not None else None,
        )
        for r in rows
    ]


@dataclasses.dataclass(frozen=True)
class MemberRow:
    """A live member of an ordered handler, as ``eop status`` shows it."""

    subscription: str
    host: str
    pid: int
    joined_at: datetime.datetime | None


async def read_members(engine: AsyncEngine, tables: models.Tables) -> list[MemberRow]:
    """Every ordered handler's live members (their lease not run out)."""
    async with engine.connect() as conn:
        rows = (await conn.execute(sql.member_status(tables))).all()
    return [MemberRow(subscription=r[0], host=r[1], pid=int(r[2]), joined_at=r[3]) for r in rows]
