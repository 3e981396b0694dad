"""Batches: one transaction per fetched batch, confirmed acks pipelined after COMMIT.

The protocol is the one of :mod:`eop.protocol.processor`, amortised: one multi-row
claim for the batch, the handler of each claimed message inside its own
savepoint (so one failing handler does not sink the others), one COMMIT, then
every confirmed ack at once. Anything off the common path (a message not
claimed, a failed handler, a spent lease, an exhausted message, a COMMIT that
fails for the handlers' writes, the batch transaction failing for any reason of
eop's own, before or after its COMMIT) goes to the per-message protocol, which
settles it exactly as a lone message would be: its claim makes that safe, a
message whose outcome committed is acked without running its handler again.
Only a message the per-message protocol cannot settle either is left to the
worker, which naks it alone (:class:`Unsettled`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence

from eop import errors, faults, log
from eop.pg import contract, models
from eop.protocol.contention import crossed, transient
from eop.protocol.fallback import Step, log_failure, run_each
from eop.protocol.fallback import Unsettled as Unsettled  # re-exported: the worker catches it
from eop.protocol.processor import Fetched, Processor
from eop.types import Delivery, Outcome


class BatchProcessor:
    """Runs batches of one handler subscription; ``single`` handles the exceptions.

    Of its :class:`~eop.protocol.processor.Processor` it uses the per-message
    steps (:meth:`~eop.protocol.processor.Processor.handle`,
    :meth:`~eop.protocol.processor.Processor.handler_failed`), the split of a
    batch (:meth:`~eop.protocol.processor.Processor.prepare_batch`), the leases
    (:meth:`~eop.protocol.processor.Processor.hold`), the store and the critical
    sections, and the two collaborators it shares with it: ``settlement`` and
    ``contention``.
    """

    def __init__(
        self, single: Processor, *, settled_one: Callable[[Delivery], None] | None = None
    ) -> None:
        self.single = single
        self.settled_one = settled_one
        """Told of each message settled on its own (one at a time after a deadlock, or
        the batch transaction's leftovers) as soon as it is: the worker gives its slot
        back then, not when the whole batch is done, so that a batch crawling one message
        at a time behind hot rows does not hold the other handlers' room for all of it."""
        self.spec = single.spec
        self.settlement = single.settlement
        self.contention = single.contention
        self._unsettled: list[tuple[Delivery, Exception]] = []
        """The messages of the current batch the per-message protocol could not settle."""
        self._settled: dict[int, Outcome] = {}
        """The outcome of each message of the current batch settled so far, by its id."""

    async def settle_each(
        self, deliveries: Sequence[Delivery], received_at: float
    ) -> list[Outcome | Exception]:
        """:meth:`handle_batch`, with each message's own result, in the order of
        ``deliveries``: its outcome, or the error of eop's own that left it unsettled."""
        with contextlib.suppress(Unsettled):
            await self.handle_batch(deliveries, received_at)
        failed = {id(d): exc for d, exc in self._unsettled}
        return [failed[id(d)] if id(d) in failed else self._settled[id(d)] for d in deliveries]

    async def handle_batch(
        self, deliveries: Sequence[Delivery], received_at: float
    ) -> list[Outcome]:
        """Process a fetched batch; returns one outcome per message settled here.

        Raises :class:`Unsettled` when the per-message protocol failed for some
        messages too (eop's own failure beyond its retries): it carries them, for
        the worker to nak each alone, and the outcomes of the others.
        """
        self._unsettled, self._settled = [], {}
        await faults.point("after_fetch")
        items, others = await self.single.prepare_batch(deliveries, received_at)
        outcomes: list[Outcome] = []
        one_by_one: list[Fetched] = []
        leftovers: list[Fetched] = []
        failures: list[tuple[Fetched, Exception]] = []
        if items and self.contention.active:
            # Crossing transactions deadlocked lately: a batch would hold all its
            # rows' locks at once and deadlock again. One message at a time.
            one_by_one = items
        elif items:
            try:
                outcomes, leftovers, failures = await self._transaction(items)
            except Exception as exc:
                if crossed(exc):
                    # The batch deadlocked (or waited out its lock timeout): shrink it
                    # to one transaction per message, run one at a time.
                    self.contention.note()
                    one_by_one = items
                else:
                    if not (transient(exc) or isinstance(exc, _HANDLERS_OWN)):
                        # Not a handler's failure (the batch isolates those; one that
                        # ended the transaction is logged as such) but eop's own: it
                        # must stay visible, and must not hold the batch back.
                        self._log_failure(items, exc)
                    # The batch transaction cannot commit (or failed after its COMMIT):
                    # each message finds its own way. The claim makes it safe: one whose
                    # outcome committed is acked as a duplicate, its handler not run.
                    leftovers = items
        serial = self._singles([i.delivery for i in one_by_one], received_at)
        outcomes += await self._alone(serial, serial=True)
        work = self._singles([*others, *(i.delivery for i in leftovers)], received_at)
        work += [
            (
                i.delivery,
                functools.partial(self.single.handler_failed, i.delivery, i.msg, e, i.logger),
            )
            for i, e in failures
        ]
        outcomes += await self._alone(work)
        if self._unsettled:
            raise Unsettled(outcomes, self._unsettled) from self._unsettled[0][1]
        return outcomes

    async def _transaction(
        self, items: list[Fetched]
    ) -> tuple[list[Outcome], list[Fetched], list[tuple[Fetched, Exception]]]:
        """The batch transaction, without savepoints first unless the last batch had a
        failing handler (:attr:`Processor.batches_failing`)."""
        if self.single.batches_failing:
            result = await self._run(items, isolate=True)
        else:
            try:
                result = await self._run(items, isolate=False)
            except _NeedsIsolation:
                self.single.batches_failing = True
                result = await self._run(items, isolate=True)
        self.single.batches_failing = bool(result[2])
        return result

    def _singles(self, deliveries: Sequence[Delivery], received_at: float) -> list[Step]:
        """The per-message protocol for each of ``deliveries``, as steps for :meth:`_alone`."""
        return [(d, functools.partial(self.single.handle, d, received_at)) for d in deliveries]

    async def _alone(self, work: list[Step], *, serial: bool = False) -> list[Outcome]:
        """Run each message's step (concurrently, or one after another); their outcomes.

        A step that raises (eop's own failure beyond the per-message protocol's
        retries) is noted in :attr:`_unsettled`, for the worker to nak that
        message alone: it does not sink the others. A cancellation is no failure
        (``BaseException``): it passes.
        """
        settled, unsettled = await run_each(work, serial=serial, settled_one=self.settled_one)
        self._unsettled.extend(unsettled)
        for delivery, outcome in settled:
            self._settled[id(delivery)] = outcome
        return [outcome for _, outcome in settled]

    def _log_failure(self, items: list[Fetched], exc: Exception) -> None:
        log_failure(self.spec.name, [i.msg for i in items], exc)

    async def _run(
        self, items: list[Fetched], *, isolate: bool
    ) -> tuple[list[Outcome], list[Fetched], list[tuple[Fetched, Exception]]]:
        """The batch transaction: claim all, run each, COMMIT, ack all.

        Handlers fail rarely, so the first pass runs them without savepoints
        (two statements fewer per message); if one fails, the transaction is
        rolled back whole and run again with a savepoint per message.
        """
        async with self.single.store.transaction(self.spec) as tx:
            try:
                claimed = await tx.claim_many([i.msg for i in items], models.OUTCOME_PROCESSED)
            except Exception as exc:
                if not transient(exc):
                    # The database refuses one message's row: go one by one, so that
                    # message settles on its own and the others are not held back.
                    # (A lock timeout on a key a concurrent delivery holds is
                    # transient: the batch runs one message at a time then.)
                    raise _BatchRejected() from exc
                raise
            await faults.point("after_claim")
            mine = [i for i in items if i.msg.seq in claimed]
            leftovers = [i for i in items if i.msg.seq not in claimed]
            async with self.single.hold([i.delivery for i in mine]):
                if isolate:
                    failures = await self._run_handlers(tx, mine)
                else:
                    await self._run_optimistically(tx, mine)
                    failures = []
            for item, _ in failures:
                await tx.unclaim(item.msg)
            done = [i for i in mine if all(i is not f for f, _ in failures)]
            outcomes = await self.single.critical.run(self._commit_and_ack(tx, done))
        return outcomes, leftovers, failures

    async def _run_optimistically(self, tx: contract.Transaction, mine: list[Fetched]) -> None:
        # The handlers' writes and ORM objects go out together at the end: a
        # statement per run of one statement, not a round trip per message. A
        # failure among them is one of the handlers', as any other here.
        try:
            if self.spec.batch:
                if mine:
                    await tx.run_many([i.msg for i in mine], flush=False)
            else:
                # ruled() first: a coroutine a message for a point nothing arms.
                mid_handler = faults.ruled("mid_handler")
                for item in mine:
                    await tx.run(item.msg, flush=False)
                    if mid_handler:
                        await faults.point("mid_handler")
            await tx.flush()
        except Exception as exc:
            if transient(exc) or (isinstance(exc, errors.TransactionEndedByHandler) and exc.ended):
                # Rerun in isolation, an ended transaction would find its claims committed
                # and never show the handler's error: it goes up.
                raise
            raise _NeedsIsolation() from exc

    async def _run_handlers(
        self, tx: contract.Transaction, mine: list[Fetched]
    ) -> list[tuple[Fetched, Exception]]:
        if self.spec.batch and mine:
            error = await tx.run_isolated([i.msg for i in mine])
            if error is None:
                return []
            # Which message the batch handler choked on is unknown: retry them
            # one by one, each in its own savepoint.
        failures = []
        for item in mine:
            error = await tx.run_isolated([item.msg])
            if isinstance(error, errors.TransactionEndedByHandler) and error.ended:
                # The batch's transaction is gone, with the claims and writes of the
                # messages before: each message alone, in a transaction of its own.
                raise error
            if error is not None:
                failures.append((item, error))
        return failures

    async def _commit_and_ack(self, tx: contract.Transaction, done: list[Fetched]) -> list[Outcome]:
        """COMMIT, then every confirmed ack concurrently; the section a stop must not cut."""
        await faults.point("before_commit")
        try:
            await tx.commit()
        except errors.AmbiguousCommit:
            # Read back, never re-run here (Settlement.resolve_ambiguous): a message
            # whose outcome cannot be read is the worker's to nak, alone.
            return await self._alone(
                [
                    (
                        i.delivery,
                        functools.partial(
                            self.settlement.resolve_ambiguous,
                            i.delivery,
                            i.msg,
                            Outcome.PROCESSED,
                            i.logger,
                            None,
                        ),
                    )
                    for i in done
                ]
            )
        except Exception as exc:
            if transient(exc):
                raise
            # A deferred constraint failed at COMMIT: one of the handlers' writes.
            raise _BatchRejected() from exc
        await faults.point("after_commit")
        await self.settlement.ack_processed([i.delivery for i in done], [i.logger for i in done])
        self._settled.update((id(i.delivery), Outcome.PROCESSED) for i in done)
        return [Outcome.PROCESSED] * len(done)


class _NeedsIsolation(Exception):
    """A handler failed in the savepoint-less pass: run the batch again with savepoints."""


class _BatchRejected(Exception):
    """The batch transaction cannot be committed as a batch: process one by one."""


_HANDLERS_OWN = (_BatchRejected, errors.TransactionEndedByHandler)
"""A batch transaction's failures that are not eop's own: no ``batch.failed`` line."""


def log_settled(handler: str, deliveries: Sequence[Delivery], outcomes: Sequence[Outcome]) -> None:
    """One info line for a group of messages settled together (a fetched batch, an ordered
    handler's transaction, or one message alone): how many of each outcome, and the
    stream sequences of its first and last message as fetched, not a range (a batch
    can hold a redelivery of an earlier sequence). Per-message lines are debug lines."""
    if not deliveries or not log.enabled(logging.INFO):
        return
    counts = collections.Counter(o.value for o in outcomes)
    first, last = deliveries[0].metadata, deliveries[-1].metadata
    log.get_logger().info(
        log.Event.BATCH_PROCESSED,
        handler=handler,
        stream=first.stream,
        first_seq=first.sequence.stream,
        last_seq=last.sequence.stream,
        messages=len(deliveries),
        **counts,
    )
