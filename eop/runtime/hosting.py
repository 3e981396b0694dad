"""A worker inside another application's event loop: started and stopped by its host.

``eop worker`` owns its process: it installs signal handlers and, when
stopping, ends the process whatever its handlers do
(:mod:`eop.runtime.shutdown`). A worker run by a web application (a FastAPI
lifespan, an aiohttp cleanup context) owns neither: the host has its own
signal handlers and decides when to stop. :class:`Hosted` gives
:class:`eop.Worker` what such a host needs::

    @contextlib.asynccontextmanager
    async def lifespan(api: FastAPI) -> AsyncIterator[None]:
        async with eop.Worker(app).running():
            yield

The stop is the one a SIGTERM makes: fetching stops, in-flight messages
finish within ``shutdown_grace_s`` (then are cancelled and left for
redelivery), and a COMMIT is always followed by its ack. A host cancelled
while it waits for the stop (a second Ctrl-C) cancels the handlers at once,
and still waits for the acks of the COMMITs under way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from typing_extensions import Self


class Hosted:
    """Start, stop and context manager of a worker that runs as a task of its host's loop.

    The worker class provides :meth:`run`, :meth:`stop` and :attr:`ready`.
    A worker runs once: a new one is made for each start.
    """

    ready: asyncio.Event
    _task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Run until stopped (provided by the worker)."""
        raise NotImplementedError

    def stop(self, *, force: bool = False) -> None:
        """Ask for a stop (provided by the worker)."""
        raise NotImplementedError

    async def start(self) -> None:
        """Start the worker in a task of the running loop; return once it fetches messages.

        While PostgreSQL or NATS is unreachable it waits for them, as ``eop
        worker`` does (until they answer, or for ``startup_attempts`` tries
        of each step when set). Raises what kept the worker from starting
        (refused credentials, an unmigrated schema, an unreachable server
        after ``startup_attempts``). Installs no signal handler.
        """
        if self._task is not None:
            raise RuntimeError("this worker was started already: make a new eop.Worker")
        task = self._task = asyncio.create_task(self.run(), name="eop-worker")
        ready = asyncio.ensure_future(self.ready.wait())
        try:
            await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # The host gave up while the worker was starting: it must not outlive the
            # host, and the host's cancellation, not the worker's error, goes on.
            with contextlib.suppress(Exception):
                await self.shutdown()
            raise
        finally:
            ready.cancel()
            await asyncio.wait({ready})  # ended, not merely cancelling, when start returns
        if task.done():
            task.result()  # raises what stopped the worker
            raise RuntimeError("the worker stopped before it was ready")

    async def shutdown(self) -> None:
        """Stop the worker and wait until it has stopped; raise what stopped it, if anything.

        In-flight messages finish within ``shutdown_grace_s``; the rest are
        cancelled and left for redelivery. Cancelled while waiting, it stops
        the handlers at once (``force``), still waits for the acks of the
        COMMITs under way, then raises :class:`asyncio.CancelledError`.
        """
        self.stop()
        task = self._task
        if task is None:
            return
        cancelled = False
        while not task.done():
            try:
                # asyncio.wait, not await task: a cancelled host must not cancel the
                # worker's task, whose stop is what finishes the in-flight messages.
                await asyncio.wait({task})
            except asyncio.CancelledError:
                cancelled = True
                self.stop(force=True)
        if cancelled:
            raise asyncio.CancelledError
        if not task.cancelled():
            task.result()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Self]:
        """``async with worker.running():`` :meth:`start`, then :meth:`shutdown` on the way out.

        The body runs while the worker processes messages; leaving it, by
        return, error or cancellation, stops the worker gracefully.
        """
        await self.start()
        try:
            yield self
        finally:
            await self.shutdown()
