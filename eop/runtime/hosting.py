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

from eop import log


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

    @property
    def alive(self) -> bool:
        """Whether the worker runs: from :meth:`start` until its task ends, whether a
        stop ended it or it stopped by itself (a misconfiguration, NATS refusing its
        credentials for good). A liveness check for the host."""
        return self._task is not None and not self._task.done()

    @property
    def error(self) -> BaseException | None:
        """What the worker stopped with by itself, once its task has ended (None while
        it runs, and after a clean stop); :meth:`shutdown` raises it too."""
        task = self._task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()

    async def start(self, *, wait: bool = True) -> None:
        """Start the worker in a task of the running loop; return once it fetches messages.

        While PostgreSQL or NATS is unreachable it waits for them, as ``eop
        worker`` does (until they answer, or for ``startup_attempts`` tries
        of each step when set). Raises what kept the worker from starting
        (refused credentials, an unmigrated schema, an unreachable server
        after ``startup_attempts``). Installs no signal handler.

        ``wait=False`` returns at once, the worker starting in the background:
        for a host that does not act on a stop signal until its start-up is
        done (uvicorn's lifespan), so that a SIGTERM during an outage is not
        ignored. Then :attr:`ready` tells when it fetches, and what kept it
        from starting is logged (``worker.failed``), ends :attr:`alive`, is
        :attr:`error`, and is raised by :meth:`shutdown`.
        """
        if self._task is not None:
            raise RuntimeError("this worker was started already: make a new eop.Worker")
        task = self._task = asyncio.create_task(self.run(), name="eop-worker")
        task.add_done_callback(_log_failure)
        if not wait:
            return
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
    async def running(self, *, wait: bool = True) -> AsyncIterator[Self]:
        """``async with worker.running():`` :meth:`start`, then :meth:`shutdown` on the way out.

        The body runs while the worker processes messages (with ``wait=False``,
        from before it is ready: see :meth:`start`); leaving it, by return,
        error or cancellation, stops the worker gracefully. What stopped the
        worker by itself meanwhile is not raised on the way out: it was logged
        (``worker.failed``) and is :attr:`error`.
        """
        await self.start(wait=wait)
        try:
            yield self
        finally:
            try:
                await self.shutdown()
            except Exception as exc:
                # What stopped the worker by itself was logged (worker.failed) and is
                # `error`: raised again here, it would fail the host's own shutdown.
                if exc is not self.error:
                    raise


def _log_failure(task: asyncio.Task[None]) -> None:
    """A worker's task that ended with an error: one error line, whoever awaits it later
    (a host that started it without waiting may not look until it stops)."""
    error = None if task.cancelled() else task.exception()
    if error is None:
        return
    log.get_logger().error(log.Event.WORKER_FAILED, error=log.bounded_error(error))
