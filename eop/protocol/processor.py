"""The per-message protocol.

Claim first, run the handler in the same transaction, COMMIT, then the
confirmed ack; every failure lands in exactly one committed outcome (the
handler's writes or a dead letter, each with its inbox row), in a parked
retry (:mod:`eop.pg.retries`), or in a redelivery that will find one.

:class:`Processor` runs the steps of one message; three collaborators, shared
with the batch paths (:mod:`eop.protocol.batch`, :mod:`eop.protocol.retry_batch`),
do the rest: :class:`~eop.protocol.settlement.Settlement` commits an outcome
and tells the server (ack, term, nak, a dead letter, a parked retry, an
ambiguous COMMIT read back), :class:`~eop.protocol.attempts.Attempts` decides
what a handler's failure costs (counted, then parked, nak'ed or dead-lettered),
and :class:`~eop.protocol.contention.Contention` retries a step the database
failed, uncounted, one at a time after a deadlock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager

from eop import errors, faults, log, message
from eop.broker import ack
from eop.broker.leases import Leases
from eop.handler import HandlerSpec
from eop.observe import observer as observe
from eop.pg import contract, models, retries
from eop.protocol import misconfiguration
from eop.protocol.attempts import Attempts, crash_loop
from eop.protocol.contention import Contention, contended_now, transient
from eop.protocol.settlement import CommitRejected, Settlement
from eop.protocol.settlement import Critical as Critical  # re-exported: the worker makes one
from eop.protocol.settlement import Epochs as Epochs  # re-exported: the test kit implements it
from eop.settings import Settings
from eop.types import Delivery, Outcome


@dataclasses.dataclass
class Fetched:
    """A fetched delivery a batch transaction can take: its message and its logger."""

    delivery: Delivery
    msg: message.Message
    logger: log.Logger


class _Counted:
    """A redelivery's counted run, kept across the retries of its step (the database
    failed): its runs without an outcome, this one included (None until counted), and
    whether this is the first, run beside the process's others."""

    __slots__ = ("runs", "shared")

    def __init__(self) -> None:
        self.runs: int | None = None
        self.shared = False


class Processor:
    """Runs the protocol for the deliveries of one handler subscription.

    Besides :meth:`handle` and :meth:`retry_parked`, the batch path
    (:class:`eop.protocol.batch.BatchProcessor`) uses :meth:`prepare_batch`
    (which messages can go in the batch's transaction), :meth:`hold` (their
    leases while their handlers run), :meth:`handler_failed` (a handler failed
    in the batch's savepoint) and :attr:`batches_failing`; the due retries of
    one poll (:class:`eop.protocol.retry_batch.RetryBatch`) use
    :meth:`retry_parked` for a run alone, and :attr:`attempts` to count their
    failures. Both settle through :attr:`settlement` and ask :attr:`contention`
    whether to run one message at a time.

    The collaborators are made from the arguments and share them:
    :attr:`spec`, :attr:`observer` and :attr:`stopping` may be replaced later
    (the test kit and the tests do; each setter hands the new one on), the
    other arguments are fixed.
    """

    def __init__(
        self,
        spec: HandlerSpec,
        settings: Settings,
        store: contract.Store,
        epochs: Epochs,
        critical: Critical | None = None,
        clock: Callable[[], float] = time.monotonic,
        observer: observe.Observer = observe.NOOP,
        acker: ack.Acker | None = None,
        leases: Leases | None = None,
        suspects: asyncio.Lock | None = None,
        stopping: asyncio.Event | None = None,
        misconfigured: misconfiguration.Watch | None = None,
    ) -> None:
        self._spec = spec
        self._observer = observer
        self.settings = settings
        self.store = store
        self.epochs = epochs
        self.critical = critical if critical is not None else Critical()
        self.clock = clock
        self.leases = leases if leases is not None else Leases()
        """Where the leases of the deliveries it holds are renewed: the worker's, which holds
        them from their fetch (a processor of its own otherwise, on the default clock)."""
        self.suspects = suspects if suspects is not None else asyncio.Lock()
        """Held by a redelivered message with a counted run while it runs: one at a time in
        the process (the worker shares one among its handlers), so a message that kills
        the process again is the only one whose run that death counts."""
        self.misconfigured = (
            misconfigured if misconfigured is not None else misconfiguration.Watch()
        )
        """The process's count of failures only a change of configuration ends (one per worker)."""
        self.batches_failing = False
        """Whether the last batch had a handler fail: the next batch runs with savepoints at
        once (:class:`eop.protocol.batch.BatchProcessor`, made anew for each batch, keeps it
        here). In a flood of failing messages every batch would otherwise run twice (without
        savepoints, rolled back, then with them); a batch whose handlers all succeed goes
        back to the cheaper first pass."""
        self.settlement = Settlement(spec, settings, store, epochs, self.critical, observer, acker)
        """How an outcome is committed and told to the server (shared with the batches)."""
        self.attempts = Attempts(spec, settings, self.settlement, self.critical)
        """What a handler's failure costs its message (shared with the retry batches)."""
        self.contention = Contention(
            spec,
            settings,
            self.settlement,
            clock=clock,
            leases=self.leases,
            stopping=stopping if stopping is not None else asyncio.Event(),
            misconfigured=self.misconfigured,
        )
        """How a step the database failed is retried (shared with the batches)."""

    @property
    def spec(self) -> HandlerSpec:
        """The handler subscription (as the observer sees it run: timed, traced)."""
        return self._spec

    @spec.setter
    def spec(self, spec: HandlerSpec) -> None:
        self._spec = spec
        self.settlement.spec = self.attempts.spec = self.contention.spec = spec

    @property
    def observer(self) -> observe.Observer:
        """Hears of each handler failure and each outcome."""
        return self._observer

    @observer.setter
    def observer(self, observer: observe.Observer) -> None:
        self._observer = self.settlement.observer = observer

    @property
    def stopping(self) -> asyncio.Event:
        """Set when the worker stops: a message waiting to retry is handed back at once."""
        return self.contention.stopping

    @stopping.setter
    def stopping(self, stopping: asyncio.Event) -> None:
        self.contention.stopping = stopping

    @property
    def parks(self) -> bool:
        """Whether failed messages wait for their retry in the database (not ordered ones:
        a key's later messages must wait behind its retried one: :mod:`eop.ordering.keys`)."""
        return self.attempts.parks

    @property
    def ack_wait_s(self) -> float:
        """The lease of one delivery."""
        return self._spec.ack_wait_s or self.settings.ack_wait_s

    def _logger(self, delivery: Delivery) -> log.LazyLogger:
        """A logger bound to the delivery's coordinates."""
        meta = delivery.metadata
        return log.LazyLogger(
            handler=self._spec.name,
            stream=meta.stream,
            seq=meta.sequence.stream,
            delivered=meta.num_delivered,
        )

    async def hand_back(self, delivery: Delivery) -> Outcome:
        """A delivery the worker stopped before it started: nak'ed at once, not run, so
        that another process (or the partition's next owner) takes it without waiting."""
        return await self.settlement.hand_back(delivery, self._logger(delivery))

    async def handle(self, delivery: Delivery, received_at: float) -> Outcome:
        """Process one delivery fetched at ``received_at`` (on :attr:`clock`)."""
        await faults.point("after_fetch")
        meta = delivery.metadata
        logger = self._logger(delivery)
        epoch = await self.epochs.epoch_of(meta.stream, meta.timestamp)
        if epoch is None:
            # Stored before the stream's current incarnation: that stream, and
            # this message with it, were deleted; it cannot even be acked.
            logger.warning(log.Event.MESSAGE_STREAM_GONE, action=log.Action.LEFT)
            return self.settlement.left(delivery)
        msg = message.from_nats(delivery, subscription=self._spec.name, stream_epoch=epoch)
        remaining = self.ack_wait_s - (self.clock() - self.leases.renewed_at(delivery, received_at))
        if remaining < self.settings.lease_margin_s:
            # The server may already have handed this message to someone else.
            logger.info(log.Event.MESSAGE_LEASE_SPENT, action=log.Action.LEFT, lease_s=remaining)
            return self.settlement.left(delivery)
        problem = message.undecodable(delivery)
        if problem is not None:
            # Bytes that are not UTF-8 in its subject or a header: no handler can
            # be given the message as it was published, on this or any delivery.
            dead = contract.DeadLetter(reason=models.REASON_UNDECODABLE, error=problem)
            return await self.contention.retrying(
                delivery,
                lambda m: self.settlement.dead_letter(delivery, m, dead, logger),
                msg,
                logger,
            )
        if msg.num_delivered > 1:
            # Maybe a crash loop: its run is counted before it starts, and from its second
            # counted run on it runs alone, so that a message killing its process does not
            # take the runs of others with it (docs/design.md, 'The crash-loop bound').
            counted = _Counted()
            return await self._claiming(
                delivery,
                lambda m: self._suspect(delivery, m, logger, counted),
                msg,
                logger,
                contended=self.contention.active,
            )
        return await self._claiming(
            delivery,
            lambda m: self._attempt(delivery, m, logger),
            msg,
            logger,
            contended=self.contention.active,
        )

    async def retry_parked(self, delivery: retries.ParkedDelivery) -> Outcome:
        """Run a parked message again (taken from the retries table by the retry loop)."""
        msg = delivery.message
        logger = log.LazyLogger(
            handler=self._spec.name, stream=msg.stream, seq=msg.seq, attempt=msg.num_delivered
        )
        return await self.contention.retrying(
            delivery,
            lambda m: self._rerun(delivery, m, logger),
            msg,
            logger,
            contended=self.contention.active,
        )

    async def prepare_batch(
        self, deliveries: Sequence[Delivery], received_at: float
    ) -> tuple[list[Fetched], list[Delivery]]:
        """Split a fetched batch: the messages a batch transaction can take, and the unusual
        ones :meth:`handle` must take alone (epoch unknown, short lease, redelivered,
        undecodable)."""
        items: list[Fetched] = []
        others: list[Delivery] = []
        shared = await self._shared_epoch(deliveries)
        for delivery in deliveries:
            meta = delivery.metadata
            epoch = shared or await self.epochs.epoch_of(meta.stream, meta.timestamp)
            # After the epoch: reading it may have waited for a stream leader's election.
            renewed_at = self.leases.renewed_at(delivery, received_at)
            lease_left = self.ack_wait_s - (self.clock() - renewed_at)
            usual = (
                epoch is not None
                and lease_left >= self.settings.lease_margin_s
                # A redelivery's run is counted before it starts (_suspect).
                and meta.num_delivered == 1
                and message.undecodable(delivery) is None
            )
            if not usual or epoch is None:
                others.append(delivery)
                continue
            msg = message.from_nats(delivery, subscription=self._spec.name, stream_epoch=epoch)
            logger = log.LazyLogger(
                handler=self._spec.name, stream=msg.stream, seq=msg.seq, delivered=msg.num_delivered
            )
            items.append(Fetched(delivery, msg, logger))
        return items, others

    async def _shared_epoch(self, deliveries: Sequence[Delivery]) -> str | None:
        """The epoch of every message of the batch, when one epoch holds them all.

        An epoch covers the messages stored from its creation until the next
        one's, so if the oldest and the newest message share an epoch, every
        message between them has it too. The newest is asked first: if it is
        newer than the last reading, that reading is refreshed before the
        oldest is looked up.
        """
        metas = [d.metadata for d in deliveries]
        stamps = [m.timestamp for m in metas if m.timestamp is not None]
        if not metas or len(stamps) != len(metas) or len({m.stream for m in metas}) != 1:
            return None
        stream, epochs = metas[0].stream, self.epochs
        newest = await epochs.epoch_of(stream, max(stamps))
        oldest = await epochs.epoch_of(stream, min(stamps))
        return newest if newest is not None and newest == oldest else None

    def hold(self, deliveries: Sequence[Delivery]) -> AbstractAsyncContextManager[None]:
        """Keep the leases of ``deliveries`` renewed for the body (a batch's handlers)."""
        return self.leases.keep(deliveries, self.ack_wait_s)

    async def handler_failed(
        self, delivery: Delivery, msg: message.Message, exc: Exception | None, logger: log.Logger
    ) -> Outcome:
        """The handler raised ``exc`` (not a failure of the database), in a transaction
        rolled back since (or, in a batch, its savepoint): settle the failure in a
        transaction of its own (:meth:`Attempts.settle_failure`)."""
        assert exc is not None
        self._observer.failed(self._spec, delivery, exc)

        async def settle(m: message.Message) -> Outcome:
            async with self.store.transaction(self._spec) as tx:
                return await self.attempts.settle_failure(tx, delivery, m, exc, logger)

        return await self.contention.retrying(delivery, settle, msg, logger)

    async def _claiming(
        self,
        delivery: Delivery,
        step: Callable[[message.Message], Awaitable[Outcome]],
        msg: message.Message,
        logger: log.Logger,
        *,
        contended: bool = False,
    ) -> Outcome:
        """:meth:`Contention.retrying`; a message whose inbox row is refused is dead-lettered
        on its own."""
        try:
            return await self.contention.retrying(delivery, step, msg, logger, contended=contended)
        except errors.UnclaimableMessage as exc:
            dead = contract.DeadLetter(reason=models.REASON_UNDECODABLE, error=str(exc))
            # Not caught again: if even the row without the msg-id is refused, the
            # message cannot have an outcome, and the worker naks it.
            return await self.contention.retrying(
                delivery,
                lambda m: self.settlement.dead_letter(
                    delivery, m, dead, logger, msg_id_guard=False
                ),
                msg,
                logger,
            )

    async def _suspect(
        self, delivery: Delivery, msg: message.Message, logger: log.Logger, counted: _Counted
    ) -> Outcome:
        """A redelivered message: count its run (once, however often the step is retried
        for the database), committed before the handler starts; dead-letter it as a crash
        loop past ``max_deliveries`` runs without an outcome, else attempt it.

        Its first run without an outcome runs at once, beside the process's other
        runs; a message with a run counted already runs alone, one at a time in the
        process, its run counted when its turn comes (docs/design.md, 'The
        crash-loop bound').
        """
        if counted.runs is None:
            # Most redeliveries are done already (acked out of order above the ack floor
            # before a handover or a crash): settled without a count or the wait.
            async with self.store.transaction(self._spec) as tx:
                existing = await tx.find(msg)
                # At max_deliveries=1 the one count a first run beside others may cost a
                # good neighbour would dead-letter it: there every redelivery runs alone.
                shares = self.settings.max_deliveries >= 2
                if existing is None and shares and await tx.count_first_run(msg):
                    await tx.commit()
                    counted.runs, counted.shared = 1, True
                else:
                    # An earlier delivery's counted run, found settled, is forgotten here.
                    await self.settlement.end_look_up(tx, msg, existing)
            if existing is not None:
                return await self.settlement.not_claimed(delivery, msg, existing, logger)
        if counted.shared:
            # Its first run without an outcome (so also when the step is retried for the
            # database): a message that kills its process costs the runs beside it one
            # count each, and only once, as each of them runs alone from then on.
            return await self._attempt(delivery, msg, logger)
        # Held for the run only: a retry's backoff (an outage, a lock held elsewhere)
        # must not keep the process's other redeliveries waiting.
        async with self.suspects:
            if self.stopping.is_set():
                # Queued behind the other redeliveries, not started: handed back at once.
                return await self.settlement.hand_back(delivery, logger)
            if counted.runs is None:
                async with self.store.transaction(self._spec) as tx:
                    runs = await tx.count_run(msg)
                    await tx.commit()
                counted.runs = runs
            if counted.runs > self.settings.max_deliveries:
                dead = crash_loop(counted.runs, self.settings.max_deliveries)
                return await self.settlement.dead_letter(delivery, msg, dead, logger)
            return await self._attempt(delivery, msg, logger)

    async def _attempt(
        self, delivery: Delivery, msg: message.Message, logger: log.Logger
    ) -> Outcome:
        async with self.store.transaction(self._spec) as tx:
            if contended_now():
                # One settled already (a late republish, found by its msg-id) is acked
                # without a turn: the fleet's contended transactions queue for it.
                existing = await tx.find(msg)
                if existing is not None:
                    await self.settlement.end_look_up(tx, msg, existing)
                    return await self.settlement.not_claimed(delivery, msg, existing, logger)
                await tx.take_turn()
            if not await tx.claim(msg, models.OUTCOME_PROCESSED):
                existing = await tx.find(msg)
                # A redelivery's run, counted before its claim, is forgotten here.
                await self.settlement.end_look_up(tx, msg, existing)
                return await self.settlement.not_claimed(delivery, msg, existing, logger)
            await faults.point("after_claim")

            async def run() -> None:
                async with self.leases.keep([delivery], self.ack_wait_s):
                    await tx.run(msg)
                    await faults.point("mid_handler")
                if msg.num_delivered > 1:
                    # Its runs were counted (an ordered handler's failures too, if nak'ed).
                    await tx.forget_failures(msg)

            result = await self._run_and_commit(tx, delivery, msg, run, logger)
        if isinstance(result, Outcome):
            return result
        return await self.handler_failed(delivery, msg, result, logger)

    async def _rerun(
        self, delivery: retries.ParkedDelivery, msg: message.Message, logger: log.Logger
    ) -> Outcome:
        """A parked message's run: the ``retrying`` row is its claim, locked for this run.

        The handler runs in a savepoint: when it fails (as a parked message
        mostly does), its failure is counted, and the message parked again or
        dead-lettered, in this same transaction, still holding the run's lock,
        instead of in a second one. Only once it succeeded does the
        ``retrying`` row take its outcome.
        """
        async with self.store.transaction(self._spec) as tx:
            if contended_now():
                await tx.take_turn()
            if not await tx.lock_run(msg, delivery.runs):
                # A later run took it (this one outlived its lease), or it settled.
                await tx.rollback()
                return self.settlement.left(delivery)
            if delivery.runs > delivery.failures + self.settings.max_deliveries:
                await tx.rollback()
                dead = crash_loop(delivery.runs - delivery.failures, self.settings.max_deliveries)
                return await self.settlement.dead_letter(delivery, msg, dead, logger)
            failed = await tx.run_isolated([msg])
            if isinstance(failed, errors.TransactionEndedByHandler) and failed.ended:
                await tx.rollback()  # nothing more can go in it: counted in a new one
                return await self.handler_failed(delivery, msg, failed, logger)
            if failed is not None:
                self._observer.failed(self._spec, delivery, failed)
                return await self.attempts.settle_failure(tx, delivery, msg, failed, logger)
            if not await tx.settle_retrying(msg, models.OUTCOME_PROCESSED):
                await tx.rollback()
                return self.settlement.left(delivery)
            await tx.forget_failures(msg)
            try:
                return await self.critical.run(
                    self.settlement.commit_and_settle(tx, delivery, msg, Outcome.PROCESSED, logger)
                )
            except CommitRejected as rejected:
                # A deferred constraint of the handler's writes: its failure.
                await tx.rollback()
                result = rejected.error
        return await self.handler_failed(delivery, msg, result, logger)

    async def _run_and_commit(
        self,
        tx: contract.Transaction,
        delivery: Delivery,
        msg: message.Message,
        run: Callable[[], Awaitable[None]],
        logger: log.Logger,
    ) -> Outcome | Exception:
        """Run the handler in its claimed transaction, COMMIT, settle; or the handler's failure.

        A database failure is raised (:func:`transient`: retried, never counted);
        the handler's own, or its writes refused at COMMIT, is returned for
        :meth:`handler_failed`, once the transaction is rolled back.
        """
        try:
            await run()
        except Exception as exc:
            await tx.rollback()
            if transient(exc):
                raise
            return exc
        try:
            return await self.critical.run(
                self.settlement.commit_and_settle(tx, delivery, msg, Outcome.PROCESSED, logger)
            )
        except CommitRejected as rejected:
            # A deferred constraint or the handler's last writes failed at
            # COMMIT: the handler's failure, settled like any other.
            await tx.rollback()
            return rejected.error
