"""The worker's in-flight budget: ``concurrency`` slots, taken and given back in bulk.

A fetch takes as many free slots as its batch may hold, and a finished batch
gives all of its slots back at once: one counter and, only while nobody can
take a slot, one future per waiting loop. (An ``asyncio.Semaphore`` costs an
``acquire`` and a ``release`` per message, and waiting on it together with
the stop event two tasks per fetch.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Slots:
    """``count`` slots shared by the worker's fetch and retry loops, first come first served.

    A loop that waits is served before any loop that asks later: a fetch loop
    that gives its slots back and asks again at once must not take them from
    the retry loop waiting for them.
    """

    def __init__(self, count: int) -> None:
        self.free = count
        # Waiting loops in order; the first stays listed, woken, until it has taken.
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False

    async def take(self, most: int) -> int:
        """Wait for a free slot (behind the loops already waiting), then take as many as
        are free, up to ``most``; 0 once :meth:`close` was called, at once or while waiting."""
        if self._closed:
            return 0
        if self.free <= 0 or self._waiters:
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                while True:
                    await waiter
                    if self._closed or self.free > 0:
                        break
                    # Woken, but the slots went back out (borrow()) before this loop ran:
                    # 0 would read as a stop, and its fetch loop would end for good. It
                    # waits again, still first in line.
                    renewed: asyncio.Future[None] = loop.create_future()
                    self._waiters[self._waiters.index(waiter)] = renewed
                    waiter = renewed
            except asyncio.CancelledError:
                self._waiters.remove(waiter)
                self._wake_next()  # its turn, if it had come, passes on
                raise
            self._waiters.remove(waiter)
            if self._closed:
                return 0
        taken = min(self.free, most)
        self.free -= taken
        self._wake_next()
        return taken

    def give(self, count: int) -> None:
        """Give ``count`` slots back; the first waiting loop takes them."""
        self.free += count
        self._wake_next()

    def borrow(self, count: int) -> None:
        """Take ``count`` slots back at once, even beyond the budget: for messages
        already fetched that gave their slots up while they waited (an ordered key
        held behind a retried message), which must not wait for slots to run."""
        self.free -= count

    def close(self) -> None:
        """No more slots for anyone: every waiting and later :meth:`take` returns 0."""
        self._closed = True
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _wake_next(self) -> None:
        if self.free > 0 and self._waiters and not self._waiters[0].done():
            self._waiters[0].set_result(None)


class Taken:
    """The slots one fetch holds, given back but one when it lingers.

    A fetch takes room for a batch; when the server has nothing, it waits for
    one message (:meth:`eop.broker.fetcher.Fetcher.fetch`'s ``lingering``), and
    :meth:`all_but_one` gives the rest back for the worker's other loops: an idle
    handler holding a batch's slots through every wait starved a busy one.
    """

    __slots__ = ("_give", "count")

    def __init__(self, give: Callable[[int], None], count: int) -> None:
        self.count = count
        """How many slots the fetch holds now."""
        self._give = give

    def all_but_one(self) -> None:
        """Give back every slot but one."""
        if self.count > 1:
            self._give(self.count - 1)
            self.count = 1
