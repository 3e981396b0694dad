"""Stuck deliveries: how long each consumer's oldest delivery has waited unacknowledged.

Every worker process reads its handlers' consumers (an ordered handler's:
every partition's) every half AckWait and records each one's ack floor in
the database (:mod:`eop.pg.floors`), where the wait of the delivery above
the floor is measured, on the database's clock, by the one rule ``eop
audit`` and ``eop status`` use. A wait longer than ``stuck_after_ack_waits``
AckWaits is a stuck delivery: the process sets its metric and logs
``delivery.stuck`` once (``delivery.unstuck`` once the floor moved past it).

Any process running the handler sees it, not only the one holding the
delivery: a process frozen with a delivery in hand (SIGSTOP, a paused VM)
tells nothing, and the others report the wait instead (docs/design.md,
'Stuck deliveries').
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Mapping

from nats.aio.client import Client as NATS
from sqlalchemy.ext.asyncio import AsyncEngine

from eop import log
from eop.broker import floors as nats_floors
from eop.handler import HandlerSpec
from eop.observe import observer as observe
from eop.pg import floors as pg_floors
from eop.pg import models
from eop.protocol import background
from eop.settings import Settings

#: An ordered handler's consumer of each partition
#: (:meth:`eop.ordering.ownership.Ownership.consumers`).
Consumers = Callable[[], Awaitable[Mapping[int, str | None]]]


@dataclasses.dataclass(frozen=True)
class Waiting:
    """A consumer's oldest unacknowledged delivery, as one reading found it."""

    consumer: str
    partition: int | None
    floor: int
    waited_s: float
    stuck_after_s: float

    @property
    def stuck(self) -> bool:
        """Waited longer than the stuck bound."""
        return self.waited_s > self.stuck_after_s


def stuck_after_s(settings: Settings, ack_wait_s: float) -> float:
    """How long a delivery may wait unacknowledged before it is stuck."""
    return settings.stuck_after_ack_waits * ack_wait_s


class UnackedWatch:
    """Reads one handler's consumers, records their floors, reports stuck deliveries."""

    def __init__(
        self,
        nc: NATS,
        engine: AsyncEngine,
        settings: Settings,
        spec: HandlerSpec,
        observer: observe.Observer = observe.NOOP,
        consumers: Consumers | None = None,
        noted: background.Noted | None = None,
    ) -> None:
        self.nc, self.engine, self.settings, self.spec = nc, engine, settings, spec
        self._noted = noted
        self.tables = models.tables(settings.schema)
        self.observer = observer
        self._consumers = consumers
        self._logger = log.get_logger(handler=spec.name, stream=spec.stream)
        self._stuck: dict[str, int] = {}
        """The consumers whose stuck delivery was logged, with the floor it waits above."""

    @property
    def interval_s(self) -> float:
        """How often the consumers are read: twice per AckWait."""
        return (self.spec.ack_wait_s or self.settings.ack_wait_s) / 2

    async def run_forever(self, stopping: asyncio.Event) -> None:
        """Check every :attr:`interval_s` until ``stopping`` is set; failures only log."""
        while not stopping.is_set():
            await self._quietly()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.interval_s)

    async def _quietly(self) -> None:
        await background.quietly(
            self.check_once, self._logger, log.Event.UNACKED_WATCH_FAILED, self._noted
        )

    async def _names(self) -> Mapping[int | None, str | None]:
        if self._consumers is None:
            return {None: self.spec.durable}
        return {p: name for p, name in (await self._consumers()).items()}

    async def check_once(self) -> list[Waiting]:
        """Read and record every consumer of the handler; what waits, and report it."""
        found = []
        for partition, name in (await self._names()).items():
            if name is None:
                continue
            waiting = await self._check(partition, name)
            if waiting is not None:
                found.append(waiting)
        oldest = max((w.waited_s for w in found), default=0.0)
        self.observer.unacked(self.spec, oldest, sum(w.stuck for w in found))
        return found

    async def _check(self, partition: int | None, name: str) -> Waiting | None:
        read = await nats_floors.read(self.nc, self.spec.stream, name)
        if read is None:
            return None
        row = await pg_floors.observe(
            self.engine,
            self.tables,
            subscription=self.spec.name,
            stream=self.spec.stream,
            consumer=name,
            partition=partition,
            created=read.created,
            floor=read.floor,
            delivered=read.delivered,
            ack_pending=read.ack_pending,
        )
        waited = pg_floors.waited_s(row, read.floor, read.created)
        logged = self._stuck.get(name)
        if logged is not None and (waited is None or read.floor != logged):
            del self._stuck[name]
            self._logger.info(
                log.Event.DELIVERY_UNSTUCK, consumer=name, partition=partition, floor=read.floor
            )
        if waited is None:
            return None
        waiting = Waiting(
            name, partition, read.floor, waited, stuck_after_s(self.settings, read.ack_wait_s)
        )
        if waiting.stuck and name not in self._stuck:
            self._stuck[name] = read.floor
            seq = await nats_floors.first_above(self.nc, self.spec.stream, read.filters, read.floor)
            self._logger.warning(
                log.Event.DELIVERY_STUCK,
                consumer=name,
                partition=partition,
                seq=seq,
                ack_floor=read.floor,
                waited_s=round(waited, 1),
                stuck_after_s=waiting.stuck_after_s,
                ack_wait_s=read.ack_wait_s,
                ack_pending=read.ack_pending,
            )
        return waiting
