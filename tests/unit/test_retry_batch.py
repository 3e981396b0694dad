"""The due retries of one poll in one transaction (:mod:`eop.protocol.retry_batch`), on
eop.testing's fakes: each run counted once, the crash-loop bound, dead letters at
``max_attempts``, and the fallback to one transaction per run.
tests/integration/test_retry_batch.py runs them on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Any

import pytest
from structlog.testing import capture_logs

import eop
from eop import log, testing
from eop.handler import HandlerSpec
from eop.message import Message
from eop.observe import observer as observe
from eop.pg import models
from eop.pg.retries import ParkedDelivery
from eop.protocol import fallback, processor, retry_batch
from eop.types import Delivery, Outcome

from .support import FAST, STREAM, delivery, effect_of, events


class Failures(observe.Observer):
    """The handler failures the processor's observer heard of."""

    def __init__(self) -> None:
        self.seqs: list[int] = []

    def failed(self, spec: HandlerSpec, delivery: Delivery, error: BaseException) -> None:
        self.seqs.append(delivery.metadata.sequence.stream)


@dataclasses.dataclass
class Polls:
    """A Processor on a MemoryStore whose handler fails for chosen payloads."""

    single: processor.Processor
    store: testing.MemoryStore
    calls: list[int]
    """The sequences the handler ran on, in turn."""
    failing: dict[bytes, list[Exception | None]]
    """Per payload, what its next handler runs raise (None: nothing); the last one stays."""
    observed: Failures

    def fail(self, data: bytes, *errors: Exception | None) -> Polls:
        self.failing[data] = list(errors)
        return self

    async def park(self, *seqs: int) -> list[ParkedDelivery]:
        """Deliver messages b"<seq>" failing once each (parked), then take them as a poll
        does: one failure counted, their first parked run."""
        parked = []
        for seq in seqs:
            data = str(seq).encode()
            after = self.failing.get(data, [None])
            self.failing[data] = [RuntimeError("first"), *after]
            assert await self.single.handle(delivery(data, seq=seq), self.single.clock()) is (
                Outcome.RETRY
            )
            msg = eop.message.from_nats(
                delivery(data, seq=seq), subscription="orders", stream_epoch="e1"
            )
            again = dataclasses.replace(msg, num_delivered=2)
            parked.append(ParkedDelivery(again, failures=1, runs=1))
        del self.calls[:]
        self.observed.seqs.clear()
        return parked

    async def run(self, parked: list[ParkedDelivery]) -> collections.Counter[Outcome]:
        outcomes = await retry_batch.RetryBatch(self.single).run(parked)
        assert len(outcomes) == len(parked)
        return collections.Counter(outcomes)

    def attempts(self, seq: int) -> int | None:
        return self.store.attempts.get(key(seq))

    def outcome(self, seq: int) -> str | None:
        row = self.store.inbox.get(key(seq))
        return None if row is None else row.outcome


def key(seq: int) -> testing.InboxKey:
    return ("orders", STREAM, "e1", seq)


def effects(*seqs: int) -> list[tuple[str, int, bytes]]:
    return [("effect", seq, str(seq).encode()) for seq in seqs]


@pytest.fixture
def polls() -> Polls:
    calls: list[int] = []
    failing: dict[bytes, list[Exception | None]] = {}

    async def handler(msg: Message, session: Any) -> None:
        calls.append(msg.seq)
        session.add(effect_of(msg))
        queued = failing.get(msg.data)
        if queued:
            error = queued.pop(0) if len(queued) > 1 else queued[0]
            if error is not None:
                raise error

    spec = HandlerSpec(
        func=handler, name="orders", stream=STREAM, subject="orders.>", durable="eop-orders"
    )
    store = testing.MemoryStore()
    observed = Failures()
    single = processor.Processor(
        spec=spec,
        settings=FAST,
        store=store,
        epochs=testing.FakeEpochs({STREAM: "e1"}),
        observer=observed,
    )
    return Polls(single, store, calls, failing, observed)


# ------------------------------------------------------------ one transaction


async def test_a_failing_run_among_good_ones_is_counted_once_and_the_good_ones_commit_together(
    polls: Polls,
) -> None:
    """Three due runs, the middle one failing again: one transaction holds all three; the
    failure is counted once (2 in all) and parked again, the others are processed and their
    counts dropped, and only their effects committed."""
    parked = await polls.park(1, 2, 3)
    polls.fail(b"2", RuntimeError("again"))
    opened = polls.store.transactions
    assert await polls.run(parked) == {Outcome.PROCESSED: 2, Outcome.RETRY: 1}
    assert polls.store.transactions == opened + 1
    assert polls.calls == [1, 2, 3]
    assert (polls.attempts(1), polls.attempts(2), polls.attempts(3)) == (None, 2, None)
    assert (polls.outcome(1), polls.outcome(2), polls.outcome(3)) == (
        models.OUTCOME_PROCESSED,
        models.OUTCOME_RETRYING,
        models.OUTCOME_PROCESSED,
    )
    assert polls.store.parked == {key(2)}
    assert sorted(polls.store.effects) == effects(1, 3)
    assert polls.observed.seqs == [2]


async def test_a_poll_of_failing_runs_counts_each_once_in_one_transaction(polls: Polls) -> None:
    parked = await polls.park(1, 2, 3, 4)
    for seq in (1, 2, 3, 4):
        polls.fail(str(seq).encode(), RuntimeError("poison"))
    opened = polls.store.transactions
    assert await polls.run(parked) == {Outcome.RETRY: 4}
    assert polls.store.transactions == opened + 1
    assert [polls.attempts(seq) for seq in (1, 2, 3, 4)] == [2, 2, 2, 2]
    assert polls.store.effects == []


async def test_the_last_attempt_in_a_poll_is_dead_lettered_and_the_others_are_parked_again(
    polls: Polls,
) -> None:
    """A run whose failure reaches max_attempts is dead-lettered (attempts_exhausted, its
    count dropped) in the poll's transaction; its neighbours' failures are counted once."""
    parked = await polls.park(1, 2)
    polls.fail(b"1", RuntimeError("last"))
    polls.fail(b"2", RuntimeError("again"))
    polls.store.attempts[key(1)] = FAST.max_attempts - 1
    exhausted = ParkedDelivery(parked[0].message, failures=FAST.max_attempts - 1, runs=1)
    assert await polls.run([exhausted, parked[1]]) == {Outcome.DEAD_LETTERED: 1, Outcome.RETRY: 1}
    [dead] = polls.store.dead_letters
    assert (dead.stream_seq, dead.reason) == (1, models.REASON_ATTEMPTS_EXHAUSTED)
    assert polls.outcome(1) == models.OUTCOME_DEAD_LETTERED
    assert (polls.attempts(1), polls.attempts(2)) == (None, 2)
    assert polls.store.parked == {key(2)}


async def test_a_rejected_run_in_a_poll_is_dead_lettered_at_once(polls: Polls) -> None:
    parked = await polls.park(1, 2)
    polls.fail(b"1", eop.Reject("never"))
    assert await polls.run(parked) == {Outcome.DEAD_LETTERED: 1, Outcome.PROCESSED: 1}
    [dead] = polls.store.dead_letters
    assert (dead.stream_seq, dead.reason) == (1, models.REASON_REJECTED)
    assert polls.store.attempts == {}


async def test_a_run_over_the_crash_loop_bound_is_dead_lettered_without_running(
    polls: Polls,
) -> None:
    """runs > failures + max_deliveries: crash_loop, its handler not run; the poll's other
    runs go on."""
    parked = await polls.park(1, 2)
    looping = ParkedDelivery(parked[0].message, failures=1, runs=1 + FAST.max_deliveries + 1)
    assert await polls.run([looping, parked[1]]) == {
        Outcome.DEAD_LETTERED: 1,
        Outcome.PROCESSED: 1,
    }
    assert polls.calls == [2]
    [dead] = polls.store.dead_letters
    assert (dead.stream_seq, dead.reason) == (1, models.REASON_CRASH_LOOP)


async def test_a_run_settled_meanwhile_is_left_and_the_others_run(polls: Polls) -> None:
    parked = await polls.park(1, 2)
    assert await polls.single.retry_parked(parked[0]) is Outcome.PROCESSED
    del polls.calls[:]
    assert await polls.run(parked) == {Outcome.LEFT: 1, Outcome.PROCESSED: 1}
    assert polls.calls == [2]
    assert sorted(polls.store.effects) == effects(1, 2)


# ------------------------------------------------- fallback: one run per transaction


async def test_a_database_failure_in_a_handler_reruns_the_poll_one_run_per_transaction(
    polls: Polls,
) -> None:
    """A handler's lost connection aborts the poll's transaction: nothing of it commits, each
    run goes alone; the database failure is never counted, the handler failure once, the good
    run commits once."""
    parked = await polls.park(1, 2, 3)
    polls.fail(b"1", eop.DatabaseUnavailable("gone"), None)
    polls.fail(b"2", RuntimeError("again"))
    assert await polls.run(parked) == {Outcome.PROCESSED: 2, Outcome.RETRY: 1}
    assert (polls.attempts(1), polls.attempts(2), polls.attempts(3)) == (None, 2, None)
    assert sorted(polls.store.effects) == effects(1, 3)
    assert polls.observed.seqs == [2]  # the rolled-back poll's failure is not observed twice


async def test_a_lock_timeout_in_a_handler_reruns_the_poll_one_at_a_time(polls: Polls) -> None:
    parked = await polls.park(1, 2)
    polls.fail(b"2", testing.LockNotAvailable(), None)
    assert await polls.run(parked) == {Outcome.PROCESSED: 2}
    assert polls.single.contention.active
    assert polls.store.attempts == {}
    assert sorted(polls.store.effects) == effects(1, 2)


async def test_a_handler_failure_in_the_lone_runs_after_a_deadlock_is_counted_as_the_handlers(
    polls: Polls,
) -> None:
    """The lone runs after the poll's lock timeout run outside the except clause that caught
    it: a handler failing there is counted once, not taken for the database's (its
    __context__ would be the lock timeout) and retried for ever."""
    parked = await polls.park(1, 2)
    polls.fail(b"2", testing.LockNotAvailable(), RuntimeError("poison"))
    outcomes = await asyncio.wait_for(polls.run(parked), 10)
    assert outcomes == {Outcome.PROCESSED: 1, Outcome.RETRY: 1}
    assert (polls.attempts(1), polls.attempts(2)) == (None, 2)


async def test_a_commit_conflict_reruns_the_poll_one_run_per_transaction(polls: Polls) -> None:
    parked = await polls.park(1, 2)
    polls.fail(b"1", RuntimeError("again"))
    polls.store.conflict_commits(1)
    assert await polls.run(parked) == {Outcome.RETRY: 1, Outcome.PROCESSED: 1}
    assert (polls.attempts(1), polls.attempts(2)) == (2, None)
    assert polls.calls == [1, 2, 1, 2]
    assert polls.store.effects == effects(2)


async def test_an_ambiguous_commit_of_a_poll_is_read_back_and_never_rerun(polls: Polls) -> None:
    parked = await polls.park(1, 2)
    polls.fail(b"1", RuntimeError("again"))
    polls.store.ambiguous_commit(committed=True)
    assert await polls.run(parked) == {Outcome.RETRY: 1, Outcome.PROCESSED: 1}
    assert polls.calls == [1, 2]
    assert (polls.attempts(1), polls.attempts(2)) == (2, None)
    assert polls.store.effects == effects(2)


# ------------------------------------------------------------ eop's own failures


async def test_eops_own_failure_before_the_commit_settles_each_run_alone_and_is_logged(
    polls: Polls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A statement of eop's failing in the poll's transaction for no reason of the
    database's (a bug): nothing of it committed, so each run goes alone, counted once,
    and one batch.failed error line says why."""
    parked = await polls.park(1, 2)
    polls.fail(b"1", RuntimeError("again"))
    real = testing.MemoryTransaction.count_parked_failures

    async def broken(self: Any, *args: Any) -> dict[int, int]:
        monkeypatch.setattr(testing.MemoryTransaction, "count_parked_failures", real)
        raise KeyError("a bug")

    monkeypatch.setattr(testing.MemoryTransaction, "count_parked_failures", broken)
    with capture_logs() as logs:
        assert await polls.run(parked) == {Outcome.RETRY: 1, Outcome.PROCESSED: 1}
    assert (polls.attempts(1), polls.attempts(2)) == (2, None)
    assert polls.store.effects == effects(2)
    [line] = events(logs, log.Event.BATCH_FAILED)
    assert "KeyError" in line["error"]


async def test_a_failure_after_the_commit_never_runs_a_run_again(
    polls: Polls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the poll's COMMIT went through, each run's outcome stands: a failure after it
    reaches the worker, and no run goes again alone (a run parked again would be counted
    twice)."""
    parked = await polls.park(1, 2)
    polls.fail(b"1", RuntimeError("again"))

    def broken(*args: Any, **kwargs: Any) -> Outcome:
        raise KeyError("a bug after the commit")

    monkeypatch.setattr(polls.single.settlement, "parked_again", broken)
    with pytest.raises(KeyError):
        await retry_batch.RetryBatch(polls.single).run(parked)
    assert polls.calls == [1, 2]
    assert (polls.attempts(1), polls.attempts(2)) == (2, None)
    assert polls.store.effects == effects(2)


async def test_a_run_that_fails_alone_too_is_handed_to_the_worker_and_the_others_settle(
    polls: Polls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the poll's transaction failed, one lone run failing for eop's own reason does
    not sink the others: they settle, and Unsettled carries it for the worker."""
    parked = await polls.park(1, 2)
    polls.store.conflict_commits(1)
    real = polls.single.retry_parked

    async def flaky(delivery: ParkedDelivery) -> Outcome:
        if delivery.message.seq == 1:
            raise KeyError("a bug alone")
        return await real(delivery)

    monkeypatch.setattr(polls.single, "retry_parked", flaky)
    with pytest.raises(fallback.Unsettled) as raised:
        await retry_batch.RetryBatch(polls.single).run(parked)
    assert raised.value.outcomes == [Outcome.PROCESSED]
    [(delivery, error)] = raised.value.failed
    assert delivery is parked[0]
    assert isinstance(error, KeyError)
