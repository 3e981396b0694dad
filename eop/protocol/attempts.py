"""The attempt rule: what a handler's failure costs its message.

An attempt is one failure of the handler's own (an exception, its writes
refused at flush or COMMIT), never the database's: those are retried,
uncounted (:mod:`eop.protocol.contention`). Failures are counted in the
database (``eop.retries.failures``), in the transaction that settles them
(:meth:`Attempts.settle_failure`): a rejected message (``eop.Reject``,
undecodable) is dead-lettered at once; one that failed :attr:`Attempts.max_attempts`
times is dead-lettered as ``attempts_exhausted``; any other is retried after
:meth:`Attempts.retry_delay`, parked in the retries table (or, for an ordered
handler, nak'ed for a redelivery). A message run more than ``max_deliveries``
times without an outcome is dead-lettered as a crash loop (:func:`crash_loop`).
See docs/design.md, 'The attempt rule'.
"""

from __future__ import annotations

import contextlib

from eop import backoff, errors, log, message
from eop.handler import HandlerSpec
from eop.pg import contract, models, retries
from eop.protocol.settlement import Critical, Settlement, describe
from eop.settings import Settings
from eop.types import Delivery, Outcome


class Attempts:
    """The attempt rule of one handler subscription; settles through ``settlement``.

    :meth:`settle_failure` for a failure of a message's own transaction;
    :meth:`retry_delay` and :attr:`max_attempts` for the due retries of one
    poll (:class:`eop.protocol.retry_batch.RetryBatch`), which count theirs
    together.
    """

    def __init__(
        self, spec: HandlerSpec, settings: Settings, settlement: Settlement, critical: Critical
    ) -> None:
        self.spec = spec
        self.settings = settings
        self.settlement = settlement
        self.critical = critical

    @property
    def max_attempts(self) -> int:
        """Handler failures before a failing message is dead-lettered."""
        return self.spec.max_attempts or self.settings.max_attempts

    @property
    def parks(self) -> bool:
        """Whether failed messages wait for their retry in the database (not ordered ones:
        a key's later messages must wait behind its retried one: :mod:`eop.ordering.keys`)."""
        return self.spec.order_by is None

    async def settle_failure(
        self,
        tx: contract.Transaction,
        delivery: Delivery,
        msg: message.Message,
        exc: Exception,
        logger: log.Logger,
    ) -> Outcome:
        """In ``tx``: dead-letter a rejected message, else count the failure; dead-letter at
        ``max_attempts``, else retry. COMMIT, then settle with the server.

        The retry is parked (acked, held in the retries table) unless the
        handler is ordered, whose retry is a nak'ed redelivery. The traceback
        is formatted only for a dead letter: with its source lines and markers
        it costs more than the rest of a failure's handling.
        """
        if isinstance(exc, errors.Reject):
            return await self.settlement.dead_letter_in(tx, delivery, msg, rejected(exc), logger)
        parked_run = isinstance(delivery, retries.ParkedDelivery)
        expected = delivery.failures + 1 if isinstance(delivery, retries.ParkedDelivery) else 1
        error = describe(exc)
        delay_s = self.retry_delay(exc, expected)
        failures = await tx.count_failure(
            msg, error, parked=self.parks, due_in_s=delay_s if self.parks else 0.0
        )
        if failures >= self.max_attempts:
            return await self.settlement.dead_letter_in(
                tx, delivery, msg, exhausted(exc, error), logger
            )
        if failures != expected:
            # Counted elsewhere too (an overlapping delivery): back off by the real count.
            delay_s = self.retry_delay(exc, failures)
            if self.parks:
                await tx.reschedule(msg, delay_s)
        if not self.parks:
            with contextlib.suppress(errors.AmbiguousCommit):
                # Counted or not, the nak below is right: at worst one failure
                # goes uncounted.
                await self.critical.run(tx.commit())
            logger.info(
                log.Event.MESSAGE_RETRY, action=log.Action.NAK, failures=failures, error=error
            )
            return await self.settlement.nak(delivery, msg, delay_s, logger)
        if not parked_run and not await tx.claim(msg, models.OUTCOME_RETRYING):
            existing = await tx.find(msg)
            # The failure counted above is rolled back; a redelivery's counted run is
            # forgotten apart.
            await tx.rollback()
            await self.settlement.end_look_up(None, msg, existing)
            return await self.settlement.not_claimed(delivery, msg, existing, logger)
        # The park's line says why, as the nak's above does.
        parking = logger.bind(failures=failures, error=error)
        return await self.critical.run(self.settlement.commit_and_park(tx, delivery, msg, parking))

    def retry_delay(self, exc: Exception, failures: int) -> float:
        """Seconds until the next run of a message whose handler failed ``failures`` times,
        the last with ``exc``: its ``eop.Retry``'s delay, else the backoff."""
        if isinstance(exc, errors.Retry) and exc.delay_s is not None:
            return exc.delay_s
        return backoff.backoff_s(
            failures, self.settings.backoff_base_s, self.settings.backoff_max_s
        )


def rejected(exc: errors.Reject) -> contract.DeadLetter:
    """The dead letter of a message its handler rejected (``eop.Reject``, or undecodable)."""
    undecodable = isinstance(exc, errors.UndecodableMessage)
    return contract.DeadLetter(
        reason=models.REASON_UNDECODABLE if undecodable else models.REASON_REJECTED,
        error=describe(exc),
        traceback=log.format_traceback(exc),
    )


def exhausted(exc: Exception, error: str) -> contract.DeadLetter:
    """The dead letter of a message whose handler failed ``max_attempts`` times, the last
    with ``exc`` (described as ``error``)."""
    return contract.DeadLetter(
        reason=models.REASON_ATTEMPTS_EXHAUSTED, error=error, traceback=log.format_traceback(exc)
    )


def crash_loop(runs: int, bound: int) -> contract.DeadLetter:
    """The dead letter of a message whose ``runs``-th run was counted, more than ``bound``
    (``max_deliveries``): it is not run, and the runs before it ended without an outcome."""
    return contract.DeadLetter(
        reason=models.REASON_CRASH_LOOP,
        error=f"its worker died or lost its lease in each of its {runs - 1} runs, none of "
        f"which settled it (max_deliveries={bound}): not run again",
    )
