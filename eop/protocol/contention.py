"""Contention: transactions in each other's way, and the database failing under them.

Failures of the database itself (:data:`eop.pg.failures.INFRASTRUCTURE`: an
outage, read-only, lock and statement timeouts, deadlocks, serialization
failures, an exhausted pool) are retried here, in the process, with jittered
backoff, for as long as the worker runs (:meth:`Contention.retrying`): they
never count, so no outage is long enough to dead-letter a good message. Those
only a change of configuration ends (a mismatched pooler, a missing table) are
counted on the way (:mod:`eop.protocol.misconfiguration`) and stop the worker.

After a deadlock, a serialization failure or a lock timeout, a handler's
transactions run one at a time in the process for a while
(:attr:`Contention.active`, :data:`WINDOW_S`): the retried ones queue on one
lock, and batches shrink to a transaction per message. Such a contended step's
handler transaction also waits for its turn across the fleet (every handler's
contended transactions, one at a time: :func:`contended_now`,
:meth:`eop.pg.contract.Transaction.take_turn`): processes
each running one transaction at a time still cross each other, and PostgreSQL
breaks each cycle only after ``deadlock_timeout``.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from collections.abc import Awaitable, Callable

from eop import backoff, errors, log, message
from eop.broker.leases import Leases
from eop.handler import HandlerSpec
from eop.pg import failures
from eop.protocol import misconfiguration
from eop.protocol.settlement import EpochChanged, Settlement, describe
from eop.settings import Settings
from eop.types import Delivery, Outcome

#: How long after a deadlock or lock timeout a handler's transactions run one at a
#: time in a process. Long enough to drain a burst of crossing transactions, short
#: enough that a one-off deadlock costs little parallelism.
WINDOW_S = 5.0

_CONTENDED: contextvars.ContextVar[bool] = contextvars.ContextVar("eop_contended", default=False)


def contended_now() -> bool:
    """Whether the step running in this task runs contended (one at a time in the process):
    its handler's transaction then takes the fleet's turn before its claim."""
    return _CONTENDED.get()


class Contention:
    """How one handler subscription's transactions meet each other and the database.

    :meth:`retrying` runs a transactional step until it settles its message;
    :attr:`active` tells a batch whether to run one message at a time, and
    :meth:`note` is how it reports a deadlock of its own.
    """

    def __init__(
        self,
        spec: HandlerSpec,
        settings: Settings,
        settlement: Settlement,
        *,
        clock: Callable[[], float],
        leases: Leases,
        stopping: asyncio.Event,
        misconfigured: misconfiguration.Watch,
    ) -> None:
        self.spec = spec
        self.settings = settings
        self.settlement = settlement
        """Hands a message back when its step cannot go on (a stop, a key held elsewhere)."""
        self.clock = clock
        self.leases = leases
        self.stopping = stopping
        """Set when the worker stops: a message waiting to retry is handed back at once."""
        self.misconfigured = misconfigured
        self._one_at_a_time = asyncio.Lock()
        self._until = 0.0

    @property
    def active(self) -> bool:
        """Whether a deadlock or lock timeout happened within the last :data:`WINDOW_S`."""
        return self.clock() < self._until

    def note(self) -> None:
        """A transaction deadlocked or timed out on a lock: run one at a time for a while."""
        self._until = self.clock() + WINDOW_S

    async def retrying(
        self,
        delivery: Delivery,
        step: Callable[[message.Message], Awaitable[Outcome]],
        msg: message.Message,
        logger: log.Logger,
        *,
        contended: bool = False,
    ) -> Outcome:
        """Run a transactional step, retrying it whole after a failure of the database.

        The retries go on, with jittered backoff, until the step succeeds or
        the worker stops (then the message is handed back at once, for
        another worker): none of them counts as an attempt of the message.

        A step that deadlocked or timed out on a lock is retried ``contended``,
        one at a time in this process, its handler's transaction in its turn across
        the fleet (:func:`contended_now`): handlers that lock the same
        rows in different orders would otherwise keep deadlocking each other
        (PostgreSQL needs ``deadlock_timeout``, one second by default, to break
        each cycle), and hot rows admit one writer anyway. A contended step still
        waiting for its turn in the process when the worker stops is handed back.
        """
        attempt = 0
        while True:
            try:
                if not contended:
                    return await step(msg)
                async with self._one_at_a_time:
                    if self.stopping.is_set():
                        # Queued behind the others, not started: handed back at once
                        # rather than run one by one through the stop's grace.
                        return await self.settlement.hand_back(delivery, logger)
                    token = _CONTENDED.set(True)
                    try:
                        return await step(msg)
                    finally:
                        _CONTENDED.reset(token)
            except EpochChanged as changed:
                msg = dataclasses.replace(msg, stream_epoch=changed.epoch)
                continue
            except errors.ClaimTimeout:
                # Another delivery of this message holds its key: it settles it.
                logger.info(log.Event.MESSAGE_CLAIM_TIMEOUT, action=log.Action.NAK)
                return await self.settlement.nak(delivery, msg, None, logger)
            except Exception as exc:
                if not transient(exc):
                    raise
                # A misconfiguration retried for ever would stall without a word.
                self.misconfigured.note(exc, f"handler {self.spec.name!r}", self.settings)
                if crossed(exc):
                    contended = True
                    self.note()
                if self.stopping.is_set():
                    # Left for redelivery at once: no line saying it will run again here.
                    return await self.settlement.hand_back(delivery, logger)
                attempt += 1
                delay_s = backoff.jittered_s(
                    attempt, self.settings.backoff_base_s, self.settings.backoff_max_s
                )
                # Quiet while it is a blip, loud once it lasts.
                level = logger.info if attempt < 5 else logger.warning
                # `retry`, not `attempt`: a parked retry's line carries the message's attempt.
                level(log.Event.TRANSACTION_RETRY, retry=attempt, error=describe(exc)[:500])
                # The lease is renewed while the message waits: an outage of any
                # length costs it no redelivery.
                ack_wait_s = self.spec.ack_wait_s or self.settings.ack_wait_s
                async with self.leases.keep([delivery], ack_wait_s):
                    stopped = await backoff.stopped_within(self.stopping, delay_s)
                if stopped:
                    return await self.settlement.nak(delivery, msg, 0.0, logger)


def transient(exc: BaseException) -> bool:
    """Failures of the database (:func:`eop.pg.failures.transient`): retried here, never counted."""
    return failures.transient(exc)


def crossed(exc: BaseException) -> bool:
    """A deadlock, a serialization failure or a lock timeout: transactions in each other's way."""
    if isinstance(exc, errors.TransactionConflict):
        return True
    return failures.classify(exc) in (failures.DbFailure.CONFLICT, failures.DbFailure.LOCK_TIMEOUT)
