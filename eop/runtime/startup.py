"""A worker's start: waiting for PostgreSQL and NATS as a running worker rides out an outage.

A worker (or ``eop relay``) started while a server is down or restarting
(a rollout, a failover, a node drained) retries each step of its start
with backoff for as long as it takes: the migration check, the connection,
every JetStream call that provisions its streams and consumers. Meanwhile
it is alive (``/healthz``) and not ready (``/readyz``), logs one warning
per retry, and a stop (SIGTERM) ends it at once, as a stopped worker
(exit status 0). A supervisor that restarts exited processes (Kubernetes)
would only add its own growing delays.

What no retry can fix is raised at once, with one line naming the fix:
refused credentials, an unmigrated schema, a stream the server refuses, an
old server. ``startup_attempts`` (0, the default: until stopped) bounds the
tries of each step for those who want a start that fails fast.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TypeVar

import tenacity
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from eop import backoff, errors, log
from eop.broker import consumers, fetcher, jetstream
from eop.handler import HandlerSpec, StreamSpec
from eop.settings import Settings

T = TypeVar("T")

_FIRST_DELAY_S = 0.5
_MAX_DELAY_S = 5.0


class Stopped(Exception):
    """A stop was asked for while the worker was starting: it ends as stopped, not failed."""


def _worth_retrying(exc: BaseException) -> bool:
    # A refused login or a failed TLS handshake is also a configuration
    # error: retrying would only knock on the server's door again.
    return isinstance(exc, errors.ServiceUnavailable) and not isinstance(
        exc, errors.ConfigurationError
    )


async def retrying(
    step: Callable[[], Awaitable[T]], settings: Settings, stopping: asyncio.Event | None = None
) -> T:
    """Run ``step``, again after a backoff while it raises :class:`eop.errors.ServiceUnavailable`.

    Other errors (an unmigrated schema, a bad configuration) are not
    transient: they are raised at once. With ``settings.startup_attempts``
    set, the last error is raised after that many tries; at 0, ``step`` is
    tried until it succeeds or ``stopping`` is set. Once ``stopping`` is set,
    the step under way is cancelled (a connection attempt may take seconds)
    and :class:`Stopped` is raised.
    """
    logger = log.get_logger()
    attempts = settings.startup_attempts
    started = time.monotonic()

    def before_sleep(state: tenacity.RetryCallState) -> None:
        logger.warning(
            log.Event.WORKER_STARTUP_RETRY,
            attempt=state.attempt_number,
            attempts=attempts,
            retry_in_s=state.upcoming_sleep,
            waited_s=round(time.monotonic() - started, 1),
            error=_described(state.outcome.exception() if state.outcome else None),
        )

    async def sleep(delay_s: float) -> None:
        if stopping is None:
            await asyncio.sleep(delay_s)
        elif await backoff.stopped_within(stopping, delay_s):
            raise Stopped

    retrier = backoff.retrying(
        stop=tenacity.stop_after_attempt(attempts) if attempts else tenacity.stop_never,
        retry=tenacity.retry_if_exception(_worth_retrying),
        base_s=_FIRST_DELAY_S,
        max_s=_MAX_DELAY_S,
        before_sleep=before_sleep,
        sleep=sleep,
    )
    # Not ``await retrier(step)``: tenacity awaits only what it sees is a
    # coroutine function, and a step may be a lambda returning a coroutine.
    async for attempt in retrier:
        with attempt:
            return await _unless_stopped(step, stopping)
    raise AssertionError("unreachable: the last attempt returns or raises")


class Patience:
    """:func:`retrying` bound to a process's settings and its stop event.

    Every call a worker or relay makes to PostgreSQL or NATS while it starts
    goes through one, so that each waits for the servers alike.
    """

    def __init__(self, settings: Settings, stopping: asyncio.Event) -> None:
        self.settings = settings
        self.stopping = stopping

    async def __call__(self, step: Callable[[], Awaitable[T]]) -> T:
        """``step``'s result, once the servers answer it (see :func:`retrying`)."""
        return await retrying(step, self.settings, self.stopping)

    async def streams(
        self,
        js: JetStreamContext,
        streams: Iterable[StreamSpec],
        transforms: Mapping[str, tuple[str, str]],
    ) -> None:
        """Bind to each of ``streams``, creating it when allowed (with its subject
        transform in ``transforms``, for a handler of several partitions)."""
        for stream in streams:
            await self(
                functools.partial(
                    jetstream.ensure_stream,
                    js,
                    stream,
                    create=self.settings.create,
                    transform=transforms.get(stream.name),
                )
            )

    async def bind(self, nc: NATS, js: JetStreamContext, spec: HandlerSpec) -> fetcher.Fetcher:
        """The handler's durable consumer, created when allowed, and a fetcher of it."""
        create = self.settings.create
        await self(
            functools.partial(consumers.ensure_consumer, js, spec, self.settings, create=create)
        )
        sub = await consumers.subscribe(nc, spec)
        log.get_logger().info(
            log.Event.SUBSCRIPTION_BOUND,
            handler=spec.name,
            stream=spec.stream,
            durable=spec.durable,
        )
        return sub


def stopped(process: str) -> None:
    """Log that ``process`` (worker, relay) stopped before it was ready."""
    log.get_logger().info(log.Event.WORKER_STARTUP_STOPPED, process=process)


async def _unless_stopped(step: Callable[[], Awaitable[T]], stopping: asyncio.Event | None) -> T:
    """``step()``'s result; :class:`Stopped` (``step`` cancelled) if ``stopping`` is set first."""
    if stopping is None:
        return await step()
    if stopping.is_set():
        raise Stopped
    task = asyncio.ensure_future(step())
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
            # Ended, not merely cancelling: a connection it opened is closed by now.
            await asyncio.wait({task})
    if task.cancelled():
        raise Stopped
    # Done, even if a stop came at the same moment: what it opened is the caller's to close.
    return task.result()


def _described(exc: BaseException | None) -> str:
    # A connection error's text, as every error eop logs: through describe_error.
    return log.describe_error(exc) if exc is not None else "None"
