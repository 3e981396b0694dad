"""A worker's start: bounded retries while PostgreSQL or NATS is briefly unreachable.

A database restarting while a deployment rolls out should not make every
worker exit; a server that stays down should, after a few attempts, with
one clear line naming it (its URL without credentials).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import tenacity

from eop import errors, log, retry
from eop.settings import Settings

T = TypeVar("T")

_FIRST_DELAY_S = 0.5
_MAX_DELAY_S = 5.0


def _worth_retrying(exc: BaseException) -> bool:
    # A refused login or a failed TLS handshake is also a configuration
    # error: retrying would only knock on the server's door again.
    return isinstance(exc, errors.ServiceUnavailable) and not isinstance(
        exc, errors.ConfigurationError
    )


async def retrying(step: Callable[[], Awaitable[T]], settings: Settings) -> T:
    """Run ``step``, again after a backoff while it raises :class:`eop.errors.ServiceUnavailable`.

    Other errors (an unmigrated schema, a bad configuration) are not
    transient: they are raised at once. After ``settings.startup_attempts``
    tries the last error is raised.
    """
    logger = log.get_logger()
    attempts = settings.startup_attempts

    def before_sleep(state: tenacity.RetryCallState) -> None:
        logger.warning(
            log.Event.WORKER_STARTUP_RETRY,
            attempt=state.attempt_number,
            attempts=attempts,
            retry_in_s=state.upcoming_sleep,
            error=_described(state.outcome.exception() if state.outcome else None),
        )

    retrier = retry.retrying(
        stop=tenacity.stop_after_attempt(attempts),
        retry=tenacity.retry_if_exception(_worth_retrying),
        base_s=_FIRST_DELAY_S,
        max_s=_MAX_DELAY_S,
        before_sleep=before_sleep,
    )
    # Not ``await retrier(step)``: tenacity awaits only what it sees is a
    # coroutine function, and a step may be a lambda returning a coroutine.
    async for attempt in retrier:
        with attempt:
            return await step()
    raise AssertionError("unreachable: the last attempt returns or raises")


def _described(exc: BaseException | None) -> str:
    # A connection error's text, as every error eop logs: through describe_error.
    return log.describe_error(exc) if exc is not None else "None"
