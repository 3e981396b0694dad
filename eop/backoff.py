"""eop's retry policy: the one backoff formula every wait before a retry comes from.

A delay starts at a base and doubles with each failure up to a cap; where
several parties may retry the same thing at once, it is jittered. Each
caller keeps its own base and cap (a nak waits seconds, a lost ack reply
milliseconds). Loops that retry a call in place use tenacity through
:func:`retrying`; the protocol's own loops (a nak'ed delivery, a transaction
retried under a heartbeat) call :func:`backoff_s` or :func:`jittered_s`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import tenacity

# 2**30 times any base in use is far past any cap; a larger exponent would
# only make a huge integer out of a runaway delivery count.
_MAX_EXPONENT = 30


def backoff_s(attempt: int, base_s: float, max_s: float) -> float:
    """The delay after ``attempt`` failures (or deliveries): ``base_s`` doubled each time, capped.

    The first (and a zero or negative count, as an unknown one) waits ``base_s``.
    """
    exponent = min(max(attempt - 1, 0), _MAX_EXPONENT)
    return float(min(base_s * (2**exponent), max_s))


def jittered_s(
    attempt: int, base_s: float, max_s: float, rand: Callable[[], float] = random.random
) -> float:
    """:func:`backoff_s` with jitter: between half of it and all of it.

    Transactions that deadlocked or timed out on the same hot rows retry at
    different moments instead of colliding again in lockstep. ``rand``
    returns a number in [0, 1).
    """
    delay = backoff_s(attempt, base_s, max_s)
    return delay / 2 + rand() * delay / 2


def wait(base_s: float, max_s: float) -> Callable[[tenacity.RetryCallState], float]:
    """A tenacity ``wait=``: :func:`backoff_s` of the attempt that just failed."""

    def strategy(state: tenacity.RetryCallState) -> float:
        return backoff_s(state.attempt_number, base_s, max_s)

    return strategy


def retrying(
    *,
    stop: tenacity.stop.stop_base,
    retry: tenacity.retry_base,
    base_s: float,
    max_s: float,
    before_sleep: Callable[[tenacity.RetryCallState], None],
    sleep: Callable[[float], Awaitable[None]] | None = None,
) -> tenacity.AsyncRetrying:
    """tenacity's retrier with eop's backoff (:func:`wait`), raising the last error when it stops.

    ``before_sleep`` logs each retry (tenacity's state says which attempt
    failed, how, and how long the wait is). ``sleep`` waits instead of
    :func:`asyncio.sleep` (one that a stop cuts short).
    """
    return tenacity.AsyncRetrying(
        sleep=sleep or _sleep,
        stop=stop,
        wait=wait(base_s, max_s),
        retry=retry,
        before_sleep=before_sleep,
        reraise=True,
    )


async def _sleep(delay_s: float) -> None:
    await asyncio.sleep(delay_s)


async def stopped_within(stopping: asyncio.Event, delay_s: float) -> bool:
    """Wait ``delay_s`` before a retry; True, at once, if ``stopping`` is set meanwhile.

    A backoff must never hold a stopping worker past its grace.
    """
    try:
        await asyncio.wait_for(stopping.wait(), delay_s)
    except asyncio.TimeoutError:
        return False
    return True
