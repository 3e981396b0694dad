"""The fallback of a shared transaction: each message settled alone.

A fetched batch (:mod:`eop.protocol.batch`) and a poll's due retries
(:mod:`eop.protocol.retry_batch`) run many messages in one transaction. What
that transaction cannot settle goes to the per-message protocol, message by
message (:func:`run_each`); one of them failing there too (eop's own failure
beyond its retries) sinks no other, and is handed to the worker, alone
(:class:`Unsettled`). A shared transaction that failed for eop's own reason is
logged once (:func:`log_failure`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from eop import errors, log, message
from eop.types import Delivery, Outcome

Step = tuple[Delivery, Callable[[], Awaitable[Outcome]]]
"""A message and what settles it on its own."""


class Unsettled(errors.EopError):
    """Messages of a batch that the per-message protocol could not settle either.

    Raised by :meth:`eop.protocol.batch.BatchProcessor.handle_batch` (and
    :meth:`eop.protocol.retry_batch.RetryBatch.run`) once every other message
    of the batch is settled: :attr:`failed` are for the worker to nak, each
    alone; :attr:`outcomes` are the others'.
    """

    def __init__(self, outcomes: list[Outcome], failed: list[tuple[Delivery, Exception]]) -> None:
        super().__init__(
            f"{len(failed)} message(s) of the batch failed in the per-message protocol too: "
            f"{log.brief_error(failed[0][1])}"
        )
        self.outcomes = outcomes
        self.failed = failed


def log_failure(
    handler: str, msgs: Sequence[message.Message], exc: Exception, **extra: object
) -> None:
    """One error line for a batch's (or a poll's) transaction that failed for eop's own
    reason: its coordinates and the error, never a payload."""
    first, last = msgs[0], msgs[-1]
    log.get_logger().error(
        log.Event.BATCH_FAILED,
        handler=handler,
        stream=first.stream,
        first_seq=first.seq,
        last_seq=last.seq,
        messages=len(msgs),
        **extra,
        error=log.bounded_error(exc),
        traceback=log.format_traceback(exc),
    )


async def run_each(
    work: Sequence[Step],
    *,
    serial: bool,
    settled_one: Callable[[Delivery], None] | None = None,
) -> tuple[list[tuple[Delivery, Outcome]], list[tuple[Delivery, Exception]]]:
    """Run each delivery's step, concurrently or one after another: the outcomes, and the
    deliveries whose step raised with what it raised (one failure sinks no other).
    ``settled_one`` is told of each delivery as soon as its step settled it."""

    async def run(
        delivery: Delivery, step: Callable[[], Awaitable[Outcome]]
    ) -> Outcome | Exception:
        result = await caught(step())
        if settled_one is not None and isinstance(result, Outcome):
            settled_one(delivery)
        return result

    if serial:
        results = [await run(delivery, step) for delivery, step in work]
    else:
        results = await asyncio.gather(*(run(delivery, step) for delivery, step in work))
    settled: list[tuple[Delivery, Outcome]] = []
    unsettled: list[tuple[Delivery, Exception]] = []
    for (delivery, _), result in zip(work, results, strict=True):
        if isinstance(result, Outcome):
            settled.append((delivery, result))
        else:
            unsettled.append((delivery, result))
    return settled, unsettled


async def caught(step: Awaitable[Outcome]) -> Outcome | Exception:
    """``step``'s outcome, or the exception it raised (a ``BaseException`` passes)."""
    try:
        return await step
    except Exception as exc:
        return exc
