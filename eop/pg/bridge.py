"""A sync handler's way back to the event loop: its session's I/O, awaited there.

A plain ``def`` handler runs in a thread, so that it may block (an HTTP call, a
sleep, a slow library) without stalling the worker's event loop. Its ``Session``
is the sync face of the transaction's ``AsyncSession`` (``AsyncSession.sync_session``):
SQLAlchemy's async dialects do their I/O by handing an awaitable to the greenlet
that runs them (its ``greenlet_spawn``). :func:`call` is that greenlet's driver in
the thread: each awaitable the handler's statements hand over is awaited on the
event loop, where the session's connection lives, and its result handed back.

So a sync handler's transaction is the same one an async handler's is: one
connection of the async pool, asyncpg's protocol, the ORM's INSERTs of many rows,
eop's own statements sent from the loop, and one hop to a thread a batch instead
of one a step.

A handler may still run in its thread after its task was cancelled (a stop):
the transaction then stays the thread's, its session and connection included,
until the handler returns (:class:`eop.pg.threaded_transaction.ThreadedTransaction`
closes it then), so nothing the handler still sends can reach a connection the
pool has handed to another transaction.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import greenlet

T = TypeVar("T")


class _Provider(greenlet.greenlet):  # type: ignore[misc]  # no type hints: an Any base
    """A greenlet SQLAlchemy's ``await_`` hands its awaitables from (its duck-typed mark)."""

    __sqlalchemy_greenlet_provider__ = True


def call(loop: asyncio.AbstractEventLoop, func: Callable[..., T], *args: Any) -> T:
    """Run ``func(*args)`` here, in a thread; its session's awaitables run on ``loop``."""
    here = greenlet.getcurrent()
    child = _Provider(func, here)
    # The thread's context (the message's log fields, its span) for the handler too.
    child.gr_context = here.gr_context
    result: Any = child.switch(*args)
    while not child.dead:
        try:
            value = asyncio.run_coroutine_threadsafe(_awaited(result), loop).result()
        except BaseException:
            result = child.throw(*sys.exc_info())
        else:
            result = child.switch(value)
    return result  # type: ignore[no-any-return]


async def _awaited(awaitable: Awaitable[T]) -> T:
    """``awaitable`` as a coroutine, which is what the loop takes from another thread."""
    return await awaitable
