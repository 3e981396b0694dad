"""Background rounds: a failure logged, not raised, for the next round to recover from;
a round a stop does not wait for.

The compactor's rounds (:mod:`eop.protocol.compaction`) and the unacked watch's
(:mod:`eop.protocol.unacked`) read NATS and PostgreSQL while either may be
away: an outage costs them a round, and a warning, never the worker. The
relay's rounds and an ordered handler's ticks wait on the same servers; a stop
gives the one under way a bound (:func:`before_stop`), since a server that does
not answer (frozen, or a connection that never comes) would hold the stop for
as long as it does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors

from eop import errors, futures, log
from eop.pg import failures

T = TypeVar("T")

Step = Callable[[], Awaitable[object]]
"""One round."""

Noted = Callable[[BaseException], None]
"""Told of each failed round: the worker's count of the failures only a change of
configuration ends (:class:`eop.protocol.misconfiguration.Watch`), which stops it at
the third within a minute. A pooler that loses prepared statements fails these rounds
as it fails handlers', and an idle worker runs no handler to notice it."""


async def quietly(
    step: Step, logger: log.Logger, failed: log.Event, noted: Noted | None = None
) -> None:
    """Run ``step``, logging ``failed`` (not raising) for the I/O failures a later round
    recovers from, with the error described in a line (never its bound values), and telling
    ``noted``; any other error (a bug) is raised."""
    try:
        await step()
    except (errors.EopError, nats.errors.Error, OSError, asyncio.TimeoutError) as exc:
        _failed(exc, logger, failed, noted)
    except Exception as exc:
        if failures.classify(exc) is failures.DbFailure.OTHER:
            raise
        _failed(exc, logger, failed, noted)


def _failed(exc: BaseException, logger: log.Logger, failed: log.Event, noted: Noted | None) -> None:
    logger.warning(failed, error=log.round_error(exc))
    if noted is not None:
        noted(exc)


class Abandoned(Exception):
    """A round cut short: it outlived its bound (after a stop)."""


async def before_stop(work: Awaitable[T], stopping: asyncio.Event, bound_s: float) -> T:
    """``work``'s result; when ``stopping`` is set while it runs, as :func:`bounded` from
    then on. ``work`` runs in a task of its own, cancelled too when the caller is."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        _drop(task)
        raise
    finally:
        stopped.cancel()
    return await _within(task, bound_s)


async def bounded(work: Awaitable[T], bound_s: float) -> T:
    """``work``'s result, or :class:`Abandoned` once it has run ``bound_s``: it is then
    cancelled, and its cancellation waited for ``bound_s`` more at most."""
    return await _within(asyncio.ensure_future(work), bound_s)


async def _within(task: asyncio.Future[T], bound_s: float) -> T:
    try:
        await asyncio.wait([task], timeout=bound_s)
        if task.done():
            return task.result()
        task.cancel()
        # Its cancellation may wait on the server too (a connection's rollback, its
        # close): not for long. Unlike asyncio.wait_for, which waits for it for ever.
        await asyncio.wait([task], timeout=bound_s)
    except BaseException:
        _drop(task)
        raise
    # Still cancelling: left to end by itself, not cancelled again (its cleanup goes on).
    task.add_done_callback(futures.retrieve)
    raise Abandoned(f"no answer within {bound_s:.3g} s at the stop")


def _drop(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` if it still runs, and let it end unseen (its error retrieved)."""
    if task.done():
        futures.retrieve(task)
        return
    task.cancel()
    task.add_done_callback(futures.retrieve)
