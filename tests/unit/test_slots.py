"""The worker's slots: taken in bulk, first come first served, closed by a stop."""

from __future__ import annotations

import asyncio

from eop.runtime.slots import Slots


async def test_a_loop_giving_back_and_asking_again_waits_behind_the_waiting_loop() -> None:
    """A fetch loop returning its slots cannot take them back from the waiting retry loop."""
    slots = Slots(4)
    assert await slots.take(8) == 4
    waiting = asyncio.create_task(slots.take(8))
    await asyncio.sleep(0)
    slots.give(4)
    again = asyncio.create_task(slots.take(8))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert waiting.result() == 4
    assert not again.done()
    slots.give(2)
    assert await again == 2


async def test_a_cancelled_waiter_passes_its_turn_on_and_a_stop_frees_every_waiter() -> None:
    """Cancelling a woken waiter hands the slot to the next; close() returns 0 to all."""
    slots = Slots(0)
    first, second = asyncio.create_task(slots.take(1)), asyncio.create_task(slots.take(1))
    await asyncio.sleep(0)
    slots.give(1)
    first.cancel()
    assert await second == 1
    third = asyncio.create_task(slots.take(1))
    await asyncio.sleep(0)
    slots.close()
    assert await third == 0
    assert await slots.take(1) == 0
