"""A background round's failure: logged, not raised, for the next round to recover from.

The compactor's rounds (:mod:`eop.protocol.compaction`) and the unacked watch's
(:mod:`eop.protocol.unacked`) read NATS and PostgreSQL while either may be
away: an outage costs them a round, and a warning, never the worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import nats.errors

from eop import errors, log
from eop.pg import failures

Step = Callable[[], Awaitable[object]]
"""One round."""


async def quietly(step: Step, logger: log.Logger, failed: log.Event) -> None:
    """Run ``step``, logging ``failed`` (not raising) for the I/O failures a later round
    recovers from; any other error (a bug) is raised."""
    try:
        await step()
    except (errors.EopError, nats.errors.Error, OSError, asyncio.TimeoutError) as exc:
        logger.warning(failed, error=type(exc).__name__)
    except Exception as exc:
        if failures.classify(exc) is failures.DbFailure.OTHER:
            raise
        logger.warning(failed, error=type(exc).__name__)
