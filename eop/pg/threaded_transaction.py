"""The inbox transaction of a plain ``def`` handler on the async engine: eop's statements
sent from the event loop as an async handler's are, the handler called in a thread with
the session's sync face, its I/O awaited back on the loop (:mod:`eop.pg.bridge`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from eop import futures, writes
from eop.outbox import table as outbox
from eop.pg import bridge, models, session_guard
from eop.pg.async_transaction import AsyncTransaction
from eop.pg.threads import SyncThreads

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

    from eop.handler import HandlerSpec
    from eop.message import Message

T = TypeVar("T")


class ThreadedTransaction(AsyncTransaction):
    """An ``AsyncSession``'s transaction whose handler is a sync function run in a thread.

    The handler gets ``session.sync_session`` (a plain ``Session``) or a write queue
    on it. Everything else is :class:`AsyncTransaction`'s: the claim on asyncpg's
    own connection, queued writes sent as one INSERT of many rows, the flush and
    COMMIT from the loop. The handlers of a batch run one after another in one
    thread hop, at the batch's flush (:meth:`run` with ``flush=False``).
    """

    def __init__(
        self,
        session: AsyncSession,
        tables: models.Tables,
        spec: HandlerSpec,
        threads: SyncThreads,
        outbox_context: outbox.Context | None = None,
    ) -> None:
        super().__init__(session, tables, spec, outbox_context)
        # The handler's write queue hands it a sync session when it asks for one.
        self.writes = writes.Writes(session.sync_session)
        session.info[outbox.WRITES_KEY] = self.writes
        self._threads = threads
        # Here rather than where the app makes its engine: an engine given to the
        # app needs it too (once per dialect; later calls find it done).
        bind = session.sync_session.bind
        if bind is not None:
            bridge.terminate_on_loop(bind.dialect)
        self._running: concurrent.futures.Future[Any] | None = None
        """The handler's latest run in a thread: :meth:`close` waits for it if not done."""

    def _second_argument(self, session: Any) -> Any:
        """The handler's write queue, or the session's sync face."""
        return self.writes if self.spec.takes_writes else self.session.sync_session

    async def _invoke(self, messages: list[Message], second: Any) -> None:
        await self._in_thread(self._handle, [messages], second)

    def _handle(self, groups: list[list[Message]], second: Any) -> None:
        """In the thread: call the handler once for each group of messages, in order."""
        func: Any = self.spec.func  # a sync handler, given the Session or Writes
        for messages in groups:
            arg, extra = self.spec.arguments(messages)
            func(arg, second, **extra)

    async def _in_thread(self, func: Callable[..., T], *args: Any) -> T:
        """Run ``func(*args)`` in a thread of the store's; its session's I/O comes back here.

        Cancelled, it cancels that I/O (:meth:`eop.pg.bridge.Call.cancel`); a thread
        that was waiting on it comes back at once, and is waited for (a little), so
        that its transaction closes now rather than once the worker has moved on.
        """
        await self._set_timeouts()
        call = bridge.Call(asyncio.get_running_loop())
        future: concurrent.futures.Future[T] = self._threads.submit(call.run, func, *args)
        self._running = future
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if call.cancel():
                returned = asyncio.wrap_future(future)
                # Its outcome is the thread's; the cancellation is what goes on from here.
                returned.add_done_callback(futures.retrieve)
                await asyncio.wait({returned}, timeout=bridge.RETURN_S)
            raise

    async def run(self, message: Message, *, flush: bool = True) -> None:
        """Call the handler in a thread and flush its writes; with ``flush=False`` (a
        batch's handlers) the call waits for :meth:`flush`, which runs every waiting
        handler in order in one thread hop, then sends their writes (:meth:`_defer`)."""
        if self._defer(message, flush):
            return
        await super().run(message, flush=flush)

    async def flush(self) -> None:
        """Run the handlers :meth:`run` left waiting, in one thread hop, then send the
        queued writes and pending ORM objects from the loop."""
        deferred = self._take_deferred()
        if deferred:
            await self._in_thread(
                self._handle, [[message] for message in deferred], self._second_argument(None)
            )
            self._check_intact(deferred)
        await super().flush()

    async def commit(self) -> None:
        """Run what waits, then :meth:`AsyncTransaction.commit`."""
        if self._deferred:
            await self.flush()  # never left behind, whoever ran the handler
        await super().commit()

    async def rollback(self) -> None:
        """Forget the handlers still waiting; ROLLBACK."""
        self._take_deferred()
        await super().rollback()

    async def close(self) -> None:
        """Close the session (rolling back what is open), giving its connection back.

        A handler whose task was cancelled may still run in its thread (a thread
        cannot be stopped): the session, its transaction and its connection stay
        that thread's, whatever it still sends, and are closed once it returns.
        """
        running = self._running
        if running is None or running.done():
            await session_guard.end_async(self.session, "close")
            return
        loop = asyncio.get_running_loop()

        def close_later(_: object) -> None:
            # A loop already closed took its connections with it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._close_soon)

        running.add_done_callback(close_later)

    def _close_soon(self) -> None:
        task = asyncio.ensure_future(session_guard.end_async(self.session, "close"))
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)


_CLOSING: set[asyncio.Future[None]] = set()
"""Sessions closing after their abandoned handler returned (held here, as the loop holds
only weak references to its tasks)."""
