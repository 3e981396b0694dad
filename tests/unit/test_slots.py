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


async def test_a_waiter_whose_slot_is_borrowed_back_before_it_runs_waits_again() -> None:
    """A slot given to a waiting loop and borrowed back (a held ordered message resuming)
    before that loop ran: it must not get 0, which its fetch loop reads as a stop (a
    partition's fetch loop ended for good, its lease still renewed); it waits for the
    next slot, still first in line."""
    slots = Slots(0)
    waiting = asyncio.ensure_future(slots.take(4))
    await asyncio.sleep(0)
    slots.give(1)
    slots.borrow(1)
    await asyncio.sleep(0.01)
    assert not waiting.done()
    later = asyncio.ensure_future(slots.take(4))
    await asyncio.sleep(0)
    slots.give(2)
    assert await asyncio.wait_for(waiting, 1) == 2
    slots.give(1)
    assert await asyncio.wait_for(later, 1) == 1
    slots.close()
