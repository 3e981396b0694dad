"""The due retries of one poll in one transaction.

A worker's retry loop takes the parked messages of a handler whose retry is
due (:func:`eop.pg.retries.take_due`) and hands them here together. Each runs
as :meth:`~eop.protocol.processor.Processor.retry_parked` would run it alone,
but in one transaction for the poll: one statement locks every run, each
handler runs in a savepoint of its own, one statement counts the failures and
parks them again, one gives the successes and the dead letters their
outcomes, one drops their counts, one executemany writes the dead letters,
one COMMIT. In a poison flood a failing run then costs a savepoint and its
share of five statements, not a transaction of its own.

Anything off that path goes to the per-run protocol, which settles it
exactly as it settles a lone run:

- a run over the crash-loop bound (dead-lettered without running);
- every run of the poll when a statement or the COMMIT fails for the
  database (a lost connection, a deadlock, a lock or statement timeout,
  also when a handler raised it): nothing of the transaction committed, so
  no failure was counted, and each run is retried on its own, where such an
  error is never counted;
- every run of the poll when a row is not what its run expects (another run
  settled the message), or when COMMIT refuses the handlers' writes (a
  deferred constraint: whose is unknown).

So a bad neighbour can cost a good run a second execution of its handler,
never an attempt, never its outcome. After a deadlock or lock timeout the
polls of that handler run one message at a time for a while, as batches do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Sequence

from eop import errors, faults, log, message
from eop.pg import contract, models, retries
from eop.protocol.attempts import exhausted, rejected
from eop.protocol.contention import crossed, transient
from eop.protocol.fallback import Unsettled, log_failure, run_each
from eop.protocol.processor import Processor
from eop.protocol.settlement import describe
from eop.types import Delivery, Outcome


@dataclasses.dataclass
class _Run:
    delivery: retries.ParkedDelivery
    logger: log.Logger

    @property
    def msg(self) -> message.Message:
        return self.delivery.message


@dataclasses.dataclass
class _Decided:
    """What the poll's transaction decided for its runs, settled once it commits."""

    processed: list[_Run]
    failed: list[tuple[_Run, Exception]]
    dead: list[tuple[_Run, contract.DeadLetter]] = dataclasses.field(default_factory=list)
    parked: list[_Run] = dataclasses.field(default_factory=list)


class RetryBatch:
    """Runs the due retries of one poll of one handler; ``single`` settles the exceptions.

    Of its :class:`~eop.protocol.processor.Processor` it uses a run alone
    (:meth:`~eop.protocol.processor.Processor.retry_parked`), the store, the
    critical sections and the observer, and the collaborators it shares with
    it: ``settlement``, ``attempts`` and ``contention``.
    """

    def __init__(self, single: Processor) -> None:
        self.single = single
        self.spec = single.spec
        self.settings = single.settings
        self.settlement = single.settlement
        self.attempts = single.attempts
        self.contention = single.contention
        self._committed = False
        """Whether the current group's transaction committed (or may have: ambiguous)."""
        self._unsettled: list[tuple[Delivery, Exception]] = []
        """Runs that failed alone too (eop's own failure beyond the per-run retries)."""

    async def run(self, parked: Sequence[retries.ParkedDelivery]) -> list[Outcome]:
        """Run the parked messages one poll took; one outcome each.

        Raises :class:`eop.protocol.fallback.Unsettled` when some runs failed alone
        too (eop's own failure beyond its retries), once the others are settled:
        the worker handles them as a batch's (a parked run has nothing to nak:
        its lease ends, and a later poll takes it again).
        """
        self._unsettled = []
        bound = self.settings.max_deliveries
        looping = [d for d in parked if d.runs > d.failures + bound]
        # One transaction per stream epoch: the statements take one epoch's messages.
        groups: dict[tuple[str, str], list[_Run]] = {}
        for delivery in parked:
            if delivery.runs > delivery.failures + bound:
                continue
            m = delivery.message
            logger = log.LazyLogger(
                handler=self.spec.name, stream=m.stream, seq=m.seq, attempt=m.num_delivered
            )
            groups.setdefault((m.stream, m.stream_epoch), []).append(_Run(delivery, logger))
        outcomes: list[Outcome] = []
        for runs in groups.values():
            outcomes += await self._group(runs)
        # Dead-lettered without running, as a lone run over the bound is.
        outcomes += await self._alone(looping, serial=False)
        if self._unsettled:
            raise Unsettled(outcomes, self._unsettled) from self._unsettled[0][1]
        return outcomes

    async def _group(self, runs: list[_Run]) -> list[Outcome]:
        deliveries = [r.delivery for r in runs]
        if len(runs) == 1 or self.contention.active:
            # Crossing transactions deadlocked lately: one run at a time.
            return await self._alone(deliveries, serial=True)
        self._committed = False
        try:
            return await self._transaction(runs)
        except Exception as exc:
            if self._committed:
                # Each run's outcome stands: run alone, one parked again would run (and
                # count) twice. The worker logs it.
                raise
            crossing = crossed(exc)
            if not (
                transient(exc) or isinstance(exc, (_OneByOne, errors.TransactionEndedByHandler))
            ):
                # eop's own failure (not a handler's: they are isolated): visible, but
                # no reason to hold the runs back. Nothing of the transaction committed.
                self._log_failure(runs, exc)
        # The lone runs go outside the except clause: an error raised while it handles
        # one has that one as its __context__, and a handler's own failure would then
        # pass for the database's (eop.pg.failures.classify follows the chain).
        if crossing:
            self.contention.note()
        # The transaction rolled back whole: each run finds its own way (one at a time
        # after a deadlock or lock timeout).
        return await self._alone(deliveries, serial=crossing)

    async def _alone(
        self, deliveries: Sequence[retries.ParkedDelivery], *, serial: bool
    ) -> list[Outcome]:
        """Each run in a transaction of its own (:meth:`Processor.retry_parked`); a run that
        fails for eop's own reason is noted for :class:`eop.protocol.fallback.Unsettled`, and
        does not sink the others."""
        work = [(d, functools.partial(self.single.retry_parked, d)) for d in deliveries]
        settled, unsettled = await run_each(work, serial=serial)
        self._unsettled.extend(unsettled)
        return [outcome for _, outcome in settled]

    def _log_failure(self, runs: list[_Run], exc: Exception) -> None:
        log_failure(self.spec.name, [r.msg for r in runs], exc, parked=True)

    async def _transaction(self, runs: list[_Run]) -> list[Outcome]:
        """Lock, run each handler in a savepoint, count and settle, COMMIT; then settle."""
        async with self.single.store.transaction(self.spec) as tx:
            locked = await tx.lock_runs([r.msg for r in runs], [r.delivery.runs for r in runs])
            decided = _Decided(processed=[], failed=[])
            for run in runs:
                if run.msg.seq not in locked:
                    continue
                error = await tx.run_isolated([run.msg])
                if isinstance(error, errors.TransactionEndedByHandler) and error.ended:
                    raise error  # the poll's transaction is gone: each run alone
                if error is None:
                    decided.processed.append(run)
                else:
                    decided.failed.append((run, error))
            await self._count(tx, decided)
            await self._settle(tx, decided)
            outcomes = await self.single.critical.run(self._commit(tx, decided))
        # Another run took these since, or they settled: theirs to settle.
        return outcomes + [
            self.settlement.left(r.delivery) for r in runs if r.msg.seq not in locked
        ]

    async def _count(self, tx: contract.Transaction, decided: _Decided) -> None:
        """Count the failures in one statement; dead-letter the rejected and exhausted ones,
        park the others again."""
        counted = []
        for run, exc in decided.failed:
            if isinstance(exc, errors.Reject):
                decided.dead.append((run, rejected(exc)))
            else:
                counted.append((run, exc))
        if not counted:
            return
        texts = [describe(exc) for _, exc in counted]
        delays = [self.attempts.retry_delay(exc, r.delivery.failures + 1) for r, exc in counted]
        counts = await tx.count_parked_failures([r.msg for r, _ in counted], texts, delays)
        for (run, exc), text in zip(counted, texts, strict=True):
            failures = counts.get(run.msg.seq)
            if failures is None:
                raise _OneByOne()  # its row went, under the run's lock: let a lone run say why
            if failures >= self.attempts.max_attempts:
                decided.dead.append((run, exhausted(exc, text)))
                continue
            if failures != run.delivery.failures + 1:
                # Counted elsewhere too (an overlapping delivery): back off by the real count.
                await tx.reschedule(run.msg, self.attempts.retry_delay(exc, failures))
            decided.parked.append(run)

    async def _settle(self, tx: contract.Transaction, decided: _Decided) -> None:
        """The outcomes of the processed and dead-lettered runs, and their dead letters."""
        settling = [(r, models.OUTCOME_PROCESSED) for r in decided.processed]
        settling += [(r, models.OUTCOME_DEAD_LETTERED) for r, _ in decided.dead]
        if not settling:
            return
        msgs = [r.msg for r, _ in settling]
        settled = await tx.settle_retrying_many(msgs, [outcome for _, outcome in settling])
        if len(settled) != len(settling):
            # Not retrying any more (settled by another run): a lone run leaves it, but the
            # handler's writes here cannot be taken back alone.
            raise _OneByOne()
        await tx.forget_failures_many(msgs)
        if decided.dead:
            await tx.add_dead_letters(
                [r.msg for r, _ in decided.dead], [d for _, d in decided.dead]
            )

    async def _commit(self, tx: contract.Transaction, decided: _Decided) -> list[Outcome]:
        """COMMIT, then settle each run; the section a stop must not cut."""
        await faults.point("before_commit")
        try:
            await tx.commit()
        except errors.AmbiguousCommit:
            self._committed = True  # perhaps: never run again here
            self._observe_failures(decided)
            return await self._ambiguous(decided)
        except Exception as exc:
            if transient(exc):
                raise
            # A deferred constraint of some handler's writes: a lone run finds whose.
            raise _OneByOne() from exc
        self._committed = True
        await faults.point("after_commit")
        self._observe_failures(decided)
        settlement = self.settlement
        outcomes = [
            await settlement.settle(r.delivery, Outcome.PROCESSED, r.logger, None)
            for r in decided.processed
        ]
        outcomes += [
            await settlement.settle(r.delivery, Outcome.DEAD_LETTERED, r.logger, dead)
            for r, dead in decided.dead
        ]
        # Per run at debug, as a batch's processed messages: the worker's batch.processed
        # line counts them (in a poison flood, an info line a run cost a third of the run).
        outcomes += [
            settlement.parked_again(r.delivery, r.logger, in_batch=True) for r in decided.parked
        ]
        return outcomes

    def _observe_failures(self, decided: _Decided) -> None:
        # Only once the transaction is over: a poll that falls back to lone runs has its
        # handlers run again, and their failures observed there.
        for run, exc in decided.failed:
            self.single.observer.failed(self.spec, run.delivery, exc)

    async def _ambiguous(self, decided: _Decided) -> list[Outcome]:
        """The connection died during COMMIT: read each outcome back, never re-run here.

        A run parked again is handed back as a lone run's is: its lease ends and
        a later poll runs it again if the COMMIT did not go through.
        """
        settlement = self.settlement
        resolving = [
            settlement.resolve_ambiguous(r.delivery, r.msg, Outcome.PROCESSED, r.logger, None)
            for r in decided.processed
        ]
        resolving += [
            settlement.resolve_ambiguous(r.delivery, r.msg, Outcome.DEAD_LETTERED, r.logger, dead)
            for r, dead in decided.dead
        ]
        resolving += [settlement.nak(r.delivery, r.msg, None, r.logger) for r in decided.parked]
        return list(await asyncio.gather(*resolving))


class _OneByOne(Exception):
    """The poll's transaction cannot settle as one: roll it back, run each run alone."""
