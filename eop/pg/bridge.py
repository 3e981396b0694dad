"""A sync handler's way back to the event loop: its session's I/O, awaited there.

A plain ``def`` handler runs in a thread, so that it may block (an HTTP call, a
sleep, a slow library) without stalling the worker's event loop. Its ``Session``
is the sync face of the transaction's ``AsyncSession`` (``AsyncSession.sync_session``):
SQLAlchemy's async dialects do their I/O by handing an awaitable to the greenlet
that runs them (its ``greenlet_spawn``). :meth:`Call.run` is that greenlet's driver in
the thread: each awaitable the handler's statements hand over is awaited on the
event loop, where the session's connection lives, and its result handed back.

So a sync handler's transaction is the same one an async handler's is: one
connection of the async pool, asyncpg's protocol, the ORM's INSERTs of many rows,
eop's own statements sent from the loop, and one hop to a thread a batch instead
of one a step.

A handler's task cancelled (a stop) cancels the :class:`Call` too: the I/O the
thread waits on is cancelled on the loop (asyncpg cancels the statement) and
every awaitable it hands over afterwards is refused, each as
``asyncio.CancelledError`` raised in the handler. A handler whose only wait is
its session's I/O thus returns; one blocked in code of its own (``time.sleep``)
cannot be stopped from outside and runs on. Either way the transaction stays the
thread's, its session and connection included, until the handler returns
(:class:`eop.pg.threaded_transaction.ThreadedTransaction` closes it then), so
nothing the handler still does can reach a connection the pool has handed to
another transaction.

A connection SQLAlchemy invalidates in the thread (a dead server, a cancelled
statement) is terminated on the loop (:func:`terminate_on_loop`): asyncpg's
objects belong to the loop's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import greenlet
from sqlalchemy.util.concurrency import greenlet_spawn

if TYPE_CHECKING:
    from sqlalchemy.engine.interfaces import DBAPIConnection, Dialect

T = TypeVar("T")

#: How long a cancelled handler's task waits for its thread to come back from its
#: cancelled I/O (:class:`eop.pg.threaded_transaction.ThreadedTransaction`): it
#: takes milliseconds, unless the handler catches the cancellation and goes on.
RETURN_S = 2.0


class _Provider(greenlet.greenlet):  # type: ignore[misc]  # no type hints: an Any base
    """A greenlet SQLAlchemy's ``await_`` hands its awaitables from (its duck-typed mark)."""

    __sqlalchemy_greenlet_provider__ = True


class _Here(threading.local):
    """The loop of the :class:`Call` running in this thread, if one is."""

    loop: asyncio.AbstractEventLoop | None = None


_here = _Here()


class Call:
    """One run of a function in a thread whose session's awaitables run on ``loop``.

    :meth:`run` is called in the thread, :meth:`cancel` on the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._cancelled = False
        """Set on the loop, read there: awaitables are refused from then on."""
        self._awaiting: asyncio.Task[Any] | None = None
        """The loop's task awaiting the thread's current awaitable (only touched on the loop)."""
        self._waiting = False
        """Whether the thread waits on the loop right now (written by the thread only)."""

    def run(self, func: Callable[..., T], *args: Any) -> T:
        """Run ``func(*args)`` here, in a thread; its session's awaitables run on the loop."""
        here = greenlet.getcurrent()
        child = _Provider(func, here)
        # The thread's context (the message's log fields, its span) for the handler too.
        child.gr_context = here.gr_context
        outer, _here.loop = _here.loop, self._loop
        try:
            result: Any = child.switch(*args)
            while not child.dead:
                try:
                    value = self._on_loop(result)
                except concurrent.futures.CancelledError:
                    # As asyncio's (a BaseException): SQLAlchemy then invalidates the
                    # connection, and a handler's ``except Exception`` lets it through.
                    result = child.throw(asyncio.CancelledError())
                except BaseException:
                    result = child.throw(*sys.exc_info())
                else:
                    result = child.switch(value)
        finally:
            _here.loop = outer
        return result  # type: ignore[no-any-return]

    def _on_loop(self, awaitable: Awaitable[T]) -> T:
        """In the thread: ``awaitable`` awaited on the loop, its result or error."""
        coroutine = self._awaited(awaitable)
        self._waiting = True
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        except RuntimeError:  # the loop is closed: neither coroutine will ever run
            coroutine.close()
            _discard(awaitable)
            raise
        else:
            return future.result()
        finally:
            self._waiting = False

    async def _awaited(self, awaitable: Awaitable[T]) -> T:
        """On the loop: ``awaitable`` awaited, unless the call was cancelled."""
        if self._cancelled:
            _discard(awaitable)
            raise asyncio.CancelledError
        self._awaiting = asyncio.current_task()
        try:
            return await awaitable
        finally:
            self._awaiting = None

    def cancel(self) -> bool:
        """On the loop: cancel the awaitable the thread waits on and refuse the next ones.

        True if the thread waited on the loop, so that the cancellation reaches
        the handler at once; False if it runs code of its own (which may block).
        """
        self._cancelled = True
        if self._awaiting is not None:
            self._awaiting.cancel()
        return self._waiting


def _discard(awaitable: Awaitable[Any]) -> None:
    """Close a coroutine that will never be awaited (Python warns of it otherwise)."""
    close = getattr(awaitable, "close", None)
    if callable(close):
        close()


class _TerminateOnLoop:
    """A dialect's ``do_terminate`` that, in a :class:`Call`'s thread, terminates on the loop.

    SQLAlchemy invalidates a connection where the error reached it: in the
    handler's thread, inside the call's greenlet, which SQLAlchemy takes for
    its own. Its asyncio ``terminate()`` then calls ``asyncio.shield()`` right
    there, and the thread has no event loop: a RuntimeError, the pool's logged
    traceback, a coroutine never awaited, and the asyncpg connection never
    closed. Awaiting the close through the call would not do either: the
    handler may be the one cancelled, and asyncpg's objects must not be touched
    from the thread. So the loop runs the dialect's own ``do_terminate`` in a
    greenlet of its own, as it does for an async handler's connection: a
    graceful close (which waits for a statement's cancellation under way),
    forced when that fails. The pool has forgotten the connection already.
    """

    def __init__(self, terminate: Callable[[DBAPIConnection], None]) -> None:
        self.terminate = terminate

    def __call__(self, dbapi_connection: DBAPIConnection) -> None:
        loop = _here.loop
        if loop is None:
            self.terminate(dbapi_connection)
            return
        # A closed loop took its connections' transports with it.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._start, dbapi_connection)

    def _start(self, dbapi_connection: DBAPIConnection) -> None:
        """On the loop: terminate ``dbapi_connection`` in a task (an error: the loop reports it)."""
        task = asyncio.ensure_future(greenlet_spawn(self.terminate, dbapi_connection))
        _TERMINATING.add(task)
        task.add_done_callback(_TERMINATING.discard)


_TERMINATING: set[asyncio.Future[None]] = set()
"""Connections terminating on the loop (held here: the loop holds its tasks weakly)."""


def terminate_on_loop(dialect: Dialect) -> None:
    """Have ``dialect`` terminate the connections invalidated in a :class:`Call`'s thread on
    the loop (:class:`_TerminateOnLoop`); elsewhere as it did. Done once per dialect."""
    if not isinstance(dialect.do_terminate, _TerminateOnLoop):
        # An instance attribute: only this engine's dialect, and only its terminate.
        dialect.do_terminate = _TerminateOnLoop(dialect.do_terminate)  # type: ignore[method-assign]
