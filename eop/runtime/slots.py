"""The worker's in-flight budget: ``concurrency`` slots, taken and given back in bulk.

A fetch takes as many free slots as its batch may hold, and a finished batch
gives all of its slots back at once: one counter and, only while nobody can
take a slot, one future per waiting loop. (An ``asyncio.Semaphore`` costs an
``acquire`` and a ``release`` per message, and waiting on it together with
the stop event two tasks per fetch.)
"""

from __future__ import annotations

import asyncio


class Slots:
    """``count`` slots shared by the worker's fetch and retry loops."""

    def __init__(self, count: int) -> None:
        self.free = count
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False

    async def take(self, most: int) -> int:
        """Wait for a free slot, then take as many as are free, up to ``most``.

        0 once :meth:`close` was called (the worker stops), at once or while waiting.
        """
        while not self._closed and self.free == 0:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        if self._closed:
            return 0
        taken = min(self.free, most)
        self.free -= taken
        return taken

    def give(self, count: int) -> None:
        """Give ``count`` slots back; every waiting loop looks again."""
        self.free += count
        if count > 0:
            self._wake()

    def close(self) -> None:
        """No more slots for anyone: every waiting and later :meth:`take` returns 0."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
