"""A worker's start: bounded retries while PostgreSQL or NATS is briefly unreachable.

A database restarting while a deployment rolls out should not make every
worker exit; a server that stays down should, after a few attempts, with
one clear line naming it (its URL without credentials).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from eop import errors, log
from eop.settings import Settings

T = TypeVar("T")

_FIRST_DELAY_S = 0.5
_MAX_DELAY_S = 5.0


async def retrying(step: Callable[[], Awaitable[T]], settings: Settings) -> T:
    """Run ``step``, again after a backoff while it raises :class:`eop.errors.ServiceUnavailable`.

    Other errors (an unmigrated schema, a bad configuration) are not
    transient: they are raised at once.
    """
    logger = log.get_logger()
    attempts = settings.startup_attempts
    for attempt in range(1, attempts + 1):
        try:
            return await step()
        except errors.ServiceUnavailable as exc:
            # A refused login or a failed TLS handshake is also a configuration
            # error: retrying would only knock on the server's door again.
            if attempt >= attempts or isinstance(exc, errors.ConfigurationError):
                raise
            delay_s = min(_FIRST_DELAY_S * 2 ** (attempt - 1), _MAX_DELAY_S)
            logger.warning(
                log.Event.WORKER_STARTUP_RETRY,
                attempt=attempt,
                attempts=attempts,
                retry_in_s=delay_s,
                error=str(exc),
            )
            await asyncio.sleep(delay_s)
    raise AssertionError("unreachable: the last attempt returns or raises")
