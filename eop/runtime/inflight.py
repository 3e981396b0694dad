"""A worker's messages in flight: their slots, their leases, their tasks, and their run.

Every message a worker fetches, or takes from the parked retries, holds one
of the ``concurrency`` slots (:mod:`eop.runtime.slots`) and a lease
(:mod:`eop.broker.leases`) from then until it is settled, and runs in a task
of its own, which a stop waits for within the grace period.
:meth:`InFlight.process` runs a group of them through the protocol: one
message alone, a fetched batch in one transaction (:mod:`eop.protocol.batch`)
or a poll's due retries in one (:mod:`eop.protocol.retry_batch`); an ordered
handler's lanes (:mod:`eop.ordering.lanes`) run theirs one by one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from eop import log
from eop.broker import ack
from eop.broker.leases import Leases
from eop.handler import HandlerSpec
from eop.observe import observer as observe
from eop.pg import retries
from eop.protocol import batch, processor, retry_batch
from eop.runtime.slots import Slots
from eop.settings import Settings
from eop.types import Delivery, Outcome


class InFlight:
    """The messages one worker has in flight, shared by its fetch, retry and ordered loops."""

    def __init__(
        self,
        settings: Settings,
        *,
        slots: Slots,
        leases: Leases,
        stopping: asyncio.Event,
        observer: observe.Observer,
        logger: log.Logger,
        count: Callable[[HandlerSpec, int], None],
    ) -> None:
        self.settings = settings
        self.slots = slots
        """The in-flight budget the loops take their fetches' room from."""
        self.leases = leases
        """Every delivery from its fetch to its settlement: the one place leases are kept."""
        self.stopping = stopping
        """Set once the worker stops: no slot is taken after it."""
        self.observer = observer
        self.logger = logger
        self.tasks: set[asyncio.Task[Any]] = set()
        """The tasks running messages now, which a stop waits for."""
        self.count = count
        """Told how many of a handler's messages a run settled (processed or dead-lettered)."""

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run ``coro`` in a task of its own, counted in flight until it ends."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def take_slots(self) -> int:
        """Wait for a free slot, then take as many as are free, up to the batch size."""
        if self.stopping.is_set():
            return 0
        return await self.slots.take(self.settings.batch)

    async def process(
        self, proc: processor.Processor, msgs: Sequence[Delivery], received_at: float
    ) -> None:
        """Process one message, a batch in one transaction, or a poll's due retries in one;
        release their slots."""
        self.observer.received(proc.spec, msgs)
        early: set[int] = set()

        def settled_one(delivery: Delivery) -> None:
            # Settled alone before the rest of its batch: its slot and lease are free now.
            early.add(id(delivery))
            self.leases.release([delivery])
            self.slots.give(1)

        try:
            parked = [m for m in msgs if isinstance(m, retries.ParkedDelivery)]
            if len(parked) == 1:
                outcomes = [await proc.retry_parked(parked[0])]
            elif parked:
                outcomes = await self._together(proc, retry_batch.RetryBatch(proc).run(parked))
            elif len(msgs) == 1:
                outcomes = [await proc.handle(msgs[0], received_at)]
            else:
                batches = batch.BatchProcessor(proc, settled_one=settled_one)
                handled = batches.handle_batch(msgs, received_at)
                outcomes = await self._together(proc, handled)
            settled = (Outcome.PROCESSED, Outcome.DEAD_LETTERED)
            self.count(proc.spec, sum(1 for o in outcomes if o in settled))
            batch.log_settled(proc.spec.name, msgs, outcomes)
        except Exception as exc:
            await self._failed(proc, msgs, exc)
        finally:
            rest = [m for m in msgs if id(m) not in early] if early else msgs
            self.leases.release(rest)
            self.observer.done(proc.spec, msgs)
            self.slots.give(len(rest))

    async def _together(
        self, proc: processor.Processor, settling: Awaitable[list[Outcome]]
    ) -> list[Outcome]:
        """The outcomes of a batch (or a poll's retries) settled together; the messages it
        could not settle (:class:`batch.Unsettled`) are nak'ed, each alone."""
        try:
            return await settling
        except batch.Unsettled as unsettled:
            for delivery, exc in unsettled.failed:
                await self._failed(proc, [delivery], exc)
            return unsettled.outcomes

    async def _failed(
        self, proc: processor.Processor, msgs: Sequence[Delivery], exc: Exception
    ) -> None:
        """Not a handler failure (those are settled in the protocol) but eop's own I/O
        failing beyond its retries: log it, and let the messages come back later."""
        self.logger.error(
            log.Event.MESSAGE_FAILED,
            handler=proc.spec.name,
            **_coordinates(msgs),
            action=log.Action.NAK,
            error=log.bounded_error(exc),
        )
        self.observer.errored(proc.spec, msgs, exc)
        for msg in msgs:
            await ack.nak(msg, self.settings.backoff_max_s, self.logger)


def _coordinates(msgs: Sequence[Delivery]) -> dict[str, object]:
    """Where ``msgs`` are: their stream, and the sequences of the first and last as
    fetched (as ``batch.processed`` gives them); nothing when their metadata cannot
    be read, since a failure's line must not fail."""
    try:
        first, last = msgs[0].metadata, msgs[-1].metadata
        return {
            "stream": first.stream,
            "first_seq": first.sequence.stream,
            "last_seq": last.sequence.stream,
            "messages": len(msgs),
        }
    except Exception:
        return {"messages": len(msgs)}
