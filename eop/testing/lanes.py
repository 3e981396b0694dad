"""Per-key order in a :class:`~eop.testing.app.TestApp`: the lanes of ``order_by`` handlers.

A worker gives each key of an ``order_by`` handler a lane
(:mod:`eop.ordering.keys`): when a message is retried (nak'ed), the
later messages of its key wait in the lane, unrun, until it has an outcome
(processed, dead-lettered...), then run in stream order. :class:`Lanes`
does the same for the test kit: it knows which key waits for which retried
message, holds the deliveries behind it, and runs them once it is settled.

The rule is :class:`eop.ordering.keys.BlockedKeys`'s: a key is held
until its retried message has an outcome. A worker also lets a key go when
its partition moves to another process or the stream no longer holds the
message; the kit, one process holding every key, lets it go when
:meth:`TestApp.retry <eop.testing.app.TestApp.retry>` finds no nak'ed
delivery of it to run.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from eop.ordering import keys
from eop.types import Outcome

if TYPE_CHECKING:
    from eop.handler import HandlerSpec
    from eop.testing.deliveries import FakeDelivery
    from eop.testing.results import Result

LaneKey = tuple[str, str]
"""``(handler name, ordering key)``."""

Run = Callable[["HandlerSpec", "FakeDelivery"], Awaitable["Result"]]
"""Runs a delivery through the protocol and records its result."""

Hold = Callable[["HandlerSpec", "FakeDelivery", int], Awaitable["Result"]]
"""Records the result of a delivery held back behind the given stream sequence."""


@dataclasses.dataclass(frozen=True)
class Held:
    """A delivery waiting in its key's lane, and the result its delivery returned."""

    lane: LaneKey
    spec: HandlerSpec
    delivery: FakeDelivery
    result: Result
    serial: int
    """When it was held, among all held deliveries."""


def seq_of(delivery: FakeDelivery) -> int:
    """The stream sequence of a delivery."""
    return int(delivery.metadata.sequence.stream)


def lane_of(spec: HandlerSpec, delivery: FakeDelivery) -> LaneKey:
    """The lane of a delivery: its handler and its ordering key, as a worker computes it."""
    return (spec.name, keys.key_of(spec, delivery))


class Lanes:
    """The lanes of ``order_by`` handlers: blocked keys, held deliveries, and their runs.

    ``run`` runs a delivery (claim, handler, COMMIT, ack) and returns its
    result; ``hold`` makes the result of a delivery held back. The results
    of held deliveries a run released wait in :meth:`take_released`.
    """

    def __init__(self, run: Run, hold: Hold) -> None:
        self._run = run
        self._hold = hold
        self._blocked: dict[LaneKey, int] = {}
        self._held: dict[LaneKey, list[Held]] = {}
        self._serials = itertools.count()
        self._released: list[Result] = []

    async def deliver(self, spec: HandlerSpec, delivery: FakeDelivery) -> Result:
        """Run ``delivery`` in its key's lane, or hold it there behind the key's retried message.

        The retried message itself (a redelivery of it) runs; when it gets an
        outcome, what its key held runs next, in order.
        """
        lane = lane_of(spec, delivery)
        blocked = self._blocked.get(lane)
        if blocked is not None and seq_of(delivery) > blocked:
            result = await self._hold(spec, delivery, blocked)
            held = Held(lane, spec, delivery, result, next(self._serials))
            self._held.setdefault(lane, []).append(held)
            return result
        result = await self._run_in(lane, spec, delivery)
        self._released += await self._drain(lane)
        return result

    def take_released(self) -> list[Result]:
        """The results of the held deliveries that ran since the last call, in order."""
        released, self._released = self._released, []
        return released

    async def unhold(self, naked: Iterable[tuple[HandlerSpec, FakeDelivery]]) -> list[Result]:
        """Stop holding the keys whose retried message is not among the ``naked`` deliveries
        (no redelivery will settle it), and run what they held."""
        pending = {(lane_of(spec, d), seq_of(d)) for spec, d in naked}
        for lane, seq in list(self._blocked.items()):
            if (lane, seq) not in pending:
                del self._blocked[lane]
        return [r for lane in list(self._held) for r in await self._drain(lane)]

    def held(self) -> list[Result]:
        """The results of the deliveries held now, in the order they were held, each with the
        sequence its key waits for now."""
        waiting = sorted((h for lane in self._held.values() for h in lane), key=lambda h: h.serial)
        return [
            dataclasses.replace(
                h.result, held_behind=self._blocked.get(h.lane, h.result.held_behind)
            )
            for h in waiting
        ]

    async def _run_in(self, lane: LaneKey, spec: HandlerSpec, delivery: FakeDelivery) -> Result:
        result = await self._run(spec, delivery)
        self._update(lane, seq_of(delivery), result.outcome)
        return result

    def _update(self, lane: LaneKey, seq: int, outcome: Outcome | None) -> None:
        """Block the key behind a retried message; unblock it once that one is settled."""
        current = self._blocked.get(lane)
        if outcome in (Outcome.RETRY, Outcome.LEFT):
            if current is None or seq <= current:
                self._blocked[lane] = seq
        elif current == seq:
            del self._blocked[lane]

    async def _drain(self, lane: LaneKey) -> list[Result]:
        """Run the deliveries held in ``lane``, in order, while its key is not blocked."""
        results = []
        while lane not in self._blocked and (waiting := self._held.get(lane)):
            held = waiting.pop(0)
            if not waiting:
                del self._held[lane]
            results.append(await self._run_in(lane, held.spec, held.delivery))
        return results
