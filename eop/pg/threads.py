"""The threads sync handlers run in, and the bound that keeps them from waiting on each other.

On the async session (:mod:`eop.pg.threaded_transaction`, the default) a handler's
transaction holds a connection of the async pool from the event loop, and only
its handler runs in a thread: as many threads as that pool has connections, so
the handler of a transaction holding one never waits for a thread. On a sync
session given to the app (:mod:`eop.pg.sync_transaction`) it is more:

A sync transaction runs each step (a statement, the handler, COMMIT) in a
thread and keeps its connection between steps, while it has no thread. With
more such transactions than threads, every thread can end up waiting for a
connection of the pool while every connection is held by a transaction that
waits for a thread: nothing moves again (and row locks held by the waiting
transactions stall everyone else). So:

- at most ``size`` sync transactions hold a connection at a time: a
  transaction takes a permit before its first statement checks a connection
  out, and gives it back once COMMIT or ROLLBACK has returned the connection;
- they have ``size`` threads of their own, so a step never waits for a thread;
- eop's sync pool has ``size`` connections and no overflow (a pool the user
  gives bounds ``size`` instead), so a step never waits for a connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class SyncThreads:
    """``size`` threads for sync transactions and ``size`` permits to hold a connection."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("at least one thread")
        self.size = size
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=size, thread_name_prefix="eop-sync"
        )
        self._permits = asyncio.Semaphore(size)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._busy = 0

    async def acquire(self) -> None:
        """Take a permit: wait until fewer than ``size`` sync transactions hold one."""
        self._loop = asyncio.get_running_loop()
        await self._permits.acquire()

    def release(self) -> None:
        """Give a permit back, from the event loop or from one of the threads."""
        loop = self._loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is None or here is loop:
            self._permits.release()
            return
        # A closed loop has nobody waiting for the permit any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._permits.release)

    def submit(self, func: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``func(*args)`` in one of the threads, in a copy of the caller's context.

        The context carries the log fields and the tracing span of the message,
        as :func:`asyncio.to_thread` would.
        """
        context = contextvars.copy_context()
        return self._executor.submit(self._run, context, func, *args)

    def later(self, func: Callable[[], object]) -> None:
        """Run ``func`` in one of the threads, or here once the threads are closed."""
        try:
            self._executor.submit(func)
        except RuntimeError:
            func()

    def _run(self, context: contextvars.Context, func: Callable[..., T], *args: Any) -> T:
        with self._lock:
            self._busy += 1
        try:
            return context.run(func, *args)
        finally:
            with self._lock:
                self._busy -= 1

    @property
    def busy(self) -> int:
        """Steps running right now (after :meth:`close`: the threads that cannot be stopped)."""
        with self._lock:
            return self._busy

    def close(self) -> None:
        """Take no more steps; do not wait for running ones.

        A thread cannot be stopped from outside: one running a handler that
        never returns keeps running (see :func:`eop.runtime.worker.run_worker`, which
        exits the process rather than wait for it).
        """
        self._executor.shutdown(wait=False, cancel_futures=True)
