"""An ordered handler's keys in one process: a lane each, its messages run in stream order.

The partitions this process owns (:mod:`eop.ordering.share`) hand their
fetched messages to :meth:`Lanes.dispatch`, which gives each key of them a
lane: a task that runs the key's messages one after another, once the
key's previous lane has ended. When one of them is retried, the key's
followers wait behind it (:mod:`eop.ordering.keys`), keeping their
leases; a lane whose partition is lost stops, leaving the rest unacked for
the partition's next consumer. A lane's messages go through the handler's
:class:`~eop.ordering.heads.Heads`, which lets the heads of several lanes
share a transaction.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from eop.app import App
from eop.broker.jetstream import StreamEpochs
from eop.handler import HandlerSpec
from eop.ordering import heads, keys, ownership, share
from eop.pg.store import PostgresStore
from eop.protocol import processor
from eop.runtime import startup
from eop.runtime.inflight import InFlight
from eop.types import Delivery, Outcome

#: How often a lane holding a redelivery, waiting behind its key's previous lane, looks
#: whether that lane now waits for the redelivery (its first run settled as a retry).
AWAITED_POLL_S = 0.05


class Lanes:
    """The lanes of every ordered handler one worker runs, with their runners and heads."""

    def __init__(self, flight: InFlight) -> None:
        self._flight = flight
        self.blocked = keys.BlockedKeys()
        """The keys held behind a retried message, shared with the runners."""
        self.runners: dict[str, share.OrderedRunner] = {}
        """Each ordered handler's runner of its partitions in this process, by name."""
        self._heads: dict[str, heads.Heads] = {}
        self._lanes: dict[tuple[str, str], asyncio.Task[Any]] = {}

    async def add(
        self,
        app: App,
        nc: NATS,
        js: JetStreamContext,
        spec: HandlerSpec,
        proc: processor.Processor,
        store: PostgresStore,
        patience: startup.Patience,
        epochs: StreamEpochs | None = None,
    ) -> share.OrderedRunner:
        """The runner of an ordered handler's partitions in this process, prepared."""
        flight = self._flight
        settings = flight.settings
        owners = ownership.Ownership(
            app.engine,
            store.tables,
            spec.name,
            spec.partitions,
            share.member(),
            settings.partition_lease_s,
        )
        runner = share.OrderedRunner(
            spec=spec,
            nc=nc,
            js=js,
            owners=owners,
            settings=settings,
            dispatch=functools.partial(self.dispatch, proc),
            take_slots=flight.take_slots,
            give_slots=flight.slots.give,
            stopping=flight.stopping,
            observer=flight.observer,
            blocked=self.blocked,
            epochs=epochs,
            noted=proc.misconfigured.noting(
                f"the partition ownership of handler {spec.name!r}", settings
            ),
        )
        await patience(functools.partial(share.prepare, runner))
        self.runners[spec.name] = runner
        self._heads[spec.name] = heads.Heads(
            proc,
            transactions=max(app.connection_shares()),
            most=settings.batch,
            spawn=flight.spawn,
            together=settings.batch_transactions,
        )
        return runner

    def dispatch(
        self,
        proc: processor.Processor,
        msgs: Sequence[Delivery],
        at: float,
        part: share.Partition,
    ) -> None:
        """One lane per key: a key's messages run one after another, in stream order."""
        self._flight.leases.hold(msgs, proc.ack_wait_s, at=at)
        by_key: dict[str, list[Delivery]] = {}
        for msg in msgs:
            by_key.setdefault(keys.key_of(proc.spec, msg), []).append(msg)
        for key, group in by_key.items():
            lane = self._lanes.get((proc.spec.name, key))
            task = self._flight.spawn(self._process_lane(proc, key, group, at, lane, part))
            self._lanes[(proc.spec.name, key)] = task
            task.add_done_callback(functools.partial(self._end_lane, (proc.spec.name, key)))

    def _end_lane(self, key: tuple[str, str], task: asyncio.Task[Any]) -> None:
        if self._lanes.get(key) is task:
            del self._lanes[key]

    async def _process_lane(
        self,
        proc: processor.Processor,
        key: str,
        msgs: Sequence[Delivery],
        received_at: float,
        previous: asyncio.Task[Any] | None,
        part: share.Partition,
    ) -> None:
        """Process a key's messages in order; when one is retried, its followers wait."""
        flight = self._flight
        name = proc.spec.name
        flight.observer.received(proc.spec, msgs)
        try:
            rest = list(msgs)
            # A redelivery here may be of a message the previous lane still runs: once that
            # run settles as a retry, the previous lane waits for this redelivery, which
            # must then not wait for it. Checked again while the previous lane runs.
            redelivered = any(m.metadata.num_delivered > 1 for m in rest)
            poll_s = AWAITED_POLL_S if redelivered else None
            while True:
                first = self._awaited(name, key, rest)
                if first:
                    rest = [m for m in rest if m not in first]
                    if not await self._run_lane(proc, key, first, received_at, part):
                        return
                if previous is None or previous.done():
                    break
                # Past the lookahead they keep their slots, unless the key is blocked.
                over = part.queued + len(rest) > self.runners[name].lookahead
                if over and self.blocked.blocked_seq(name, key) is None:
                    await asyncio.wait({previous}, timeout=poll_s or 1.0)
                    continue
                async with part.held(flight.slots, len(rest), queued=True):
                    while not previous.done() and not self._awaited(name, key, rest):
                        await asyncio.wait({previous}, timeout=poll_s)
            await self._run_lane(proc, key, rest, received_at, part)
        finally:
            # Those it did not run are left for the partition's next consumer.
            flight.leases.release(msgs)
            part.inflight -= len(msgs)
            part.room.set()
            flight.observer.done(proc.spec, msgs)
            flight.slots.give(len(msgs))

    def _awaited(self, name: str, key: str, msgs: Sequence[Delivery]) -> list[Delivery]:
        """Those of ``msgs`` the key's blocked lane waits for: the retried message's
        redelivery (and any earlier one), which must not wait behind that lane."""
        awaited = self.blocked.blocked_seq(name, key)
        return [] if awaited is None else [m for m in msgs if _seq(m) <= awaited]

    async def _run_lane(
        self,
        proc: processor.Processor,
        key: str,
        msgs: Sequence[Delivery],
        received_at: float,
        part: share.Partition,
    ) -> bool:
        """Run ``msgs`` in order; False once the partition is lost (the rest are left
        unacked: the next owner's consumer starts at or below them)."""
        name = proc.spec.name
        runner = self.runners[name]
        hold_s = self._flight.settings.backoff_max_s + proc.ack_wait_s
        for index, msg in enumerate(msgs):
            if part.lost.is_set():
                return False
            awaited = self.blocked.blocked_seq(name, key)
            if awaited is not None and _seq(msg) > awaited:
                held = msgs[index:]
                async with part.held(self._flight.slots, len(held)):
                    # Their leases are kept meanwhile (they are held since their fetch).
                    went_on = await self.blocked.wait(
                        name, key, len(held), lost=part.lost, stored=runner.stored, hold_s=hold_s
                    )
                if not went_on:
                    return False
            outcome = await self._heads[name].handle(msg, received_at)
            self._flight.leases.release([msg])
            self.blocked.update(name, key, msg, outcome)
            if outcome in (Outcome.RETRY, Outcome.LEFT):
                part.keys.add(key)
            if outcome in (Outcome.PROCESSED, Outcome.DEAD_LETTERED):
                self._flight.count(proc.spec, 1)
        return True


def _seq(msg: Delivery) -> int:
    return int(msg.metadata.sequence.stream)
