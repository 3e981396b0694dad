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
