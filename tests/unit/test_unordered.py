"""An unordered handler's fetch loop and the worker's slots."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import nats.errors

from eop.runtime.slots import Slots, Taken
from eop.runtime.unordered import Unordered


class _QuietStream:
    """A consumer with nothing to deliver: each fetch finds nothing, lingers, times out."""

    def __init__(self, slots: Slots, stopping: asyncio.Event) -> None:
        self.slots, self.stopping = slots, stopping
        self.seen: list[tuple[int, int, int]] = []

    async def fetch(self, batch: int, timeout_s: float, *, lingering: Any = None) -> list[Any]:
        before = self.slots.free
        lingering()
        self.seen.append((batch, before, self.slots.free))
        self.stopping.set()
        raise nats.errors.TimeoutError


async def test_an_idle_handlers_lingering_fetch_holds_one_slot_not_a_batchs() -> None:
    """With nothing to fetch, the loop waits for one message on one slot: the batch's other
    slots go back to the worker's other handlers for the wait. Each idle handler held a
    batch's worth through every wait, and a busy handler beside seven idle ones ran a
    batch every seven seconds. Every slot is back once the loop ends."""
    slots, stopping = Slots(32), asyncio.Event()
    flight = types.SimpleNamespace(
        settings=types.SimpleNamespace(fetch_timeout_s=1.0, batch_transactions=True),
        slots=slots,
        stopping=stopping,
        leases=types.SimpleNamespace(hold=lambda *args, **kwargs: None),
    )

    async def take_slots() -> int:
        return await slots.take(64)

    flight.take_slots = take_slots
    sub = _QuietStream(slots, stopping)
    loop = Unordered(
        flight, None, {}, None, None, sub, types.SimpleNamespace(ack_wait_s=30.0), None
    )  # type: ignore[arg-type]
    await loop.run()
    assert sub.seen == [(32, 0, 31)]
    assert slots.free == 32


def test_taken_gives_back_all_but_one_once() -> None:
    """A fetch that lingers keeps one slot; a second call, or a fetch of one, gives nothing."""
    given: list[int] = []
    taken = Taken(given.append, 10)
    taken.all_but_one()
    taken.all_but_one()
    assert (taken.count, given) == (1, [9])
    single = Taken(given.append, 1)
    single.all_but_one()
    assert (single.count, given) == (1, [9])
