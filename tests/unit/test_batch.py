"""The batch path (:mod:`eop.protocol.batch`), branch by branch, on eop.testing's fakes.

One transaction claims the whole batch, runs its handlers, commits once and
acks every message; what it cannot settle goes to the per-message protocol.
The integration tests (tests/integration/test_batch.py) run the same paths on
NATS and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

import eop
from eop import faults, log, testing
from eop.handler import HandlerSpec
from eop.message import Message
from eop.pg import models
from eop.protocol import batch, processor
from eop.types import Outcome

from .support import FAST, STREAM, delivery, effect_of, events

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
RECREATED = T0 + datetime.timedelta(seconds=10)


class StatementTimeout(Exception):
    """What the driver raises when a statement outlives ``statement_timeout`` (sqlstate 57014)."""

    sqlstate = "57014"


class UniqueViolation(Exception):
    """What the driver raises when a deferred unique constraint fails at COMMIT."""

    sqlstate = "23505"


@dataclasses.dataclass
class Batches:
    """A BatchProcessor on a MemoryStore, with a handler that fails for chosen payloads."""

    processor: batch.BatchProcessor
    store: testing.MemoryStore
    calls: list[list[int]]
    """The sequences the handler was called with, call by call."""
    failing: dict[bytes, list[Exception | None]]
    """Per payload, what its next handler runs raise (None: nothing), in turn; the last
    entry stays (so ``[error]`` fails every run)."""

    def fail(self, data: bytes, *errors: Exception | None) -> Batches:
        """Make the handler raise ``errors`` in turn for the message with payload ``data``."""
        self.failing[data] = list(errors)
        return self

    async def handle(self, *deliveries: testing.FakeDelivery) -> collections.Counter[Outcome]:
        """Process ``deliveries`` as one fetched batch; how many of each outcome."""
        # A BatchProcessor per batch, as the worker makes them: what lasts from one batch
        # to the next is the subscription's Processor's.
        batches = batch.BatchProcessor(self.processor.single)
        outcomes = await batches.handle_batch(deliveries, self.processor.single.clock())
        assert len(outcomes) == len(deliveries)
        return collections.Counter(outcomes)

    def runs_of(self, seq: int) -> int:
        """How many handler calls included the message at ``seq``."""
        return sum(seq in call for call in self.calls)

    def message(self, d: testing.FakeDelivery) -> Message:
        """The message of ``d`` as the handler sees it (epoch e1)."""
        return eop.message.from_nats(d, subscription="orders", stream_epoch="e1")


def make(*, batch_handler: bool = False) -> Batches:
    calls: list[list[int]] = []
    failing: dict[bytes, list[Exception | None]] = {}

    def run(msg: Message, session: Any) -> None:
        session.add(effect_of(msg))
        queued = failing.get(msg.data)
        if queued:
            error = queued.pop(0) if len(queued) > 1 else queued[0]
            if error is not None:
                raise error

    async def one(msg: Message, session: Any) -> None:
        calls.append([msg.seq])
        run(msg, session)

    async def many(msgs: list[Message], session: Any) -> None:
        calls.append([m.seq for m in msgs])
        for msg in msgs:
            run(msg, session)

    spec = HandlerSpec(
        func=many if batch_handler else one,
        name="orders",
        stream=STREAM,
        subject="orders.>",
        durable="eop-orders",
        batch=batch_handler,
    )
    store = testing.MemoryStore()
    single = processor.Processor(
        spec=spec, settings=FAST, store=store, epochs=testing.FakeEpochs({STREAM: "e1"})
    )
    return Batches(batch.BatchProcessor(single), store, calls, failing)


def three() -> list[testing.FakeDelivery]:
    """Three deliveries with payloads b"1", b"2", b"3" at sequences 1, 2, 3."""
    return [delivery(str(seq).encode(), seq=seq) for seq in (1, 2, 3)]


def effects(*seqs: int) -> list[tuple[str, int, bytes]]:
    return [("effect", seq, str(seq).encode()) for seq in seqs]


def key(seq: int) -> testing.InboxKey:
    return ("orders", STREAM, "e1", seq)


# ------------------------------------------------------------ optimistic pass


async def test_optimistic_pass_commits_the_whole_batch_in_one_transaction_and_acks_each() -> None:
    b = make()
    ds = three()
    assert await b.handle(*ds) == {Outcome.PROCESSED: 3}
    assert (b.store.transactions, b.store.commits) == (1, 1)
    assert b.calls == [[1], [2], [3]]  # each handler once: no savepoint pass
    assert sorted(b.store.effects) == effects(1, 2, 3)
    assert [b.store.outcome_of(b.message(d)) for d in ds] == [models.OUTCOME_PROCESSED] * 3
    assert all(d.acked and not d.naked and not d.termed for d in ds)


async def test_optimistic_pass_calls_a_batch_handler_once_with_the_whole_batch() -> None:
    b = make(batch_handler=True)
    assert await b.handle(*three()) == {Outcome.PROCESSED: 3}
    assert b.calls == [[1, 2, 3]]
    assert sorted(b.store.effects) == effects(1, 2, 3)


# ------------------------------------------------------------- isolation pass


async def test_isolation_pass_commits_the_others_once_and_parks_the_failed_one() -> None:
    """One handler fails: the batch is run again with a savepoint per message; the
    others commit once, the failed one's writes are rolled back, its failure is counted
    and it is parked for a retry (acked), not dead-lettered."""
    b = make().fail(b"2", ValueError("boom"))
    d1, d2, d3 = three()
    assert await b.handle(d1, d2, d3) == {Outcome.PROCESSED: 2, Outcome.RETRY: 1}
    assert sorted(b.store.effects) == effects(1, 3)
    assert b.store.outcome_of(b.message(d1)) == models.OUTCOME_PROCESSED
    assert b.store.outcome_of(b.message(d2)) == models.OUTCOME_RETRYING
    assert b.store.attempts == {key(2): 1}
    assert b.store.parked == {key(2)}
    assert b.store.dead_letters == []
    assert (d2.acked, d2.termed) == (True, False)
    assert (d1.acked, d3.acked) == (True, True)


async def test_after_a_batch_had_a_failure_the_next_skips_the_first_pass_until_one_is_clean() -> (
    None
):
    """A flood of failing messages: once a batch had a handler fail, the next batches run
    each handler once, in its savepoint, without a first pass that would be rolled back;
    a batch whose handlers all succeed brings the first pass back."""
    b = make().fail(b"2", ValueError("boom")).fail(b"5", ValueError("boom"))
    assert await b.handle(*three()) == {Outcome.PROCESSED: 2, Outcome.RETRY: 1}
    assert b.runs_of(1) == 2  # the first pass, rolled back, then the savepoint pass
    batch = [delivery(str(seq).encode(), seq=seq) for seq in (4, 5, 6)]
    assert await b.handle(*batch) == {Outcome.PROCESSED: 2, Outcome.RETRY: 1}
    assert (b.runs_of(4), b.runs_of(5), b.runs_of(6)) == (1, 1, 1)
    clean = [delivery(str(seq).encode(), seq=seq) for seq in (7, 8, 9)]
    assert await b.handle(*clean) == {Outcome.PROCESSED: 3}
    assert b.runs_of(7) == 1
    assert not b.processor.single.batches_failing
    assert sorted(b.store.effects) == effects(1, 3, 4, 6, 7, 8, 9)


async def test_a_handler_failing_only_in_the_optimistic_pass_commits_with_the_batch() -> None:
    """The savepoint pass runs every handler again; one that succeeds there commits with
    the others, and no failure is counted for it."""
    b = make().fail(b"2", ValueError("once"), None)
    assert await b.handle(*three()) == {Outcome.PROCESSED: 3}
    assert sorted(b.store.effects) == effects(1, 2, 3)
    assert b.store.attempts == {}
    assert b.runs_of(2) == 2


async def test_a_failed_message_in_a_batch_is_dead_lettered_when_its_own_attempts_run_out() -> None:
    b = make().fail(b"2", ValueError("boom"))
    b.store.attempts[key(2)] = FAST.max_attempts - 1
    d1, d2, d3 = three()
    assert await b.handle(d1, d2, d3) == {Outcome.PROCESSED: 2, Outcome.DEAD_LETTERED: 1}
    [dead] = b.store.dead_letters
    assert (dead.stream_seq, dead.reason) == (2, models.REASON_ATTEMPTS_EXHAUSTED)
    assert d2.termed
    assert sorted(b.store.effects) == effects(1, 3)
    assert b.store.attempts == {}


async def test_a_failing_batch_handler_is_rerun_whole_then_one_message_per_savepoint() -> None:
    """Which message a batch handler choked on is unknown: after the whole batch fails
    in its savepoint, each message runs alone in its own."""
    b = make(batch_handler=True).fail(b"2", ValueError("boom"))
    assert await b.handle(*three()) == {Outcome.PROCESSED: 2, Outcome.RETRY: 1}
    assert b.calls == [[1, 2, 3], [1, 2, 3], [1], [2], [3]]
    assert sorted(b.store.effects) == effects(1, 3)
    assert b.store.attempts == {key(2): 1}


async def test_a_database_failure_in_a_handler_is_no_failure_each_message_retries_alone() -> None:
    """A statement timeout inside a handler is the database's: nothing is counted, and
    the batch's messages go to the per-message protocol, which commits each once."""
    b = make().fail(b"2", StatementTimeout("canceling statement due to statement timeout"), None)
    assert await b.handle(*three()) == {Outcome.PROCESSED: 3}
    assert sorted(b.store.effects) == effects(1, 2, 3)
    assert b.store.attempts == {}
    assert b.store.dead_letters == []


# ----------------------------------------------------------- dead letters


async def test_a_rejected_message_in_a_batch_is_dead_lettered_while_the_others_commit_once() -> (
    None
):
    b = make().fail(b"2", eop.Reject("no such customer"))
    d1, d2, d3 = three()
    assert await b.handle(d1, d2, d3) == {Outcome.PROCESSED: 2, Outcome.DEAD_LETTERED: 1}
    [dead] = b.store.dead_letters
    assert (dead.stream_seq, dead.reason) == (2, models.REASON_REJECTED)
    assert b.store.outcome_of(b.message(d2)) == models.OUTCOME_DEAD_LETTERED
    assert (d2.termed, d2.acked) == (True, False)
    assert sorted(b.store.effects) == effects(1, 3)
    assert b.store.attempts == {}


async def test_an_undecodable_message_in_a_batch_is_dead_lettered_without_running_its_handler() -> (
    None
):
    """A header that is not UTF-8 keeps the message out of the batch transaction; the
    per-message protocol dead-letters it while its neighbours commit once."""
    d1, _, d3 = three()
    d2 = delivery(b"2", seq=2, headers={"X-Bad": "a\udcffb"})
    b = make()
    assert await b.handle(d1, d2, d3) == {Outcome.PROCESSED: 2, Outcome.DEAD_LETTERED: 1}
    [dead] = b.store.dead_letters
    assert (dead.stream_seq, dead.reason) == (2, models.REASON_UNDECODABLE)
    assert b.runs_of(2) == 0
    assert d2.termed
    assert sorted(b.store.effects) == effects(1, 3)


# ---------------------------------------------------------- ambiguous commit


async def test_an_ambiguous_commit_that_went_through_is_read_back_and_acked_without_rerunning() -> (
    None
):
    b = make()
    b.store.ambiguous_commit(committed=True)
    ds = three()
    assert await b.handle(*ds) == {Outcome.PROCESSED: 3}
    assert b.calls == [[1], [2], [3]]
    assert b.store.commits == 1
    assert sorted(b.store.effects) == effects(1, 2, 3)
    assert all(d.acked for d in ds)


async def test_an_ambiguous_commit_that_rolled_back_naks_the_batch_and_its_redelivery_applies_once() -> (  # noqa: E501
    None
):
    b = make()
    b.store.ambiguous_commit(committed=False)
    ds = three()
    assert await b.handle(*ds) == {Outcome.RETRY: 3}
    assert all(d.naked and not d.acked for d in ds)
    assert b.store.effects == []
    again = [d.redeliver() for d in ds]
    assert await b.handle(*again) == {Outcome.PROCESSED: 3}
    assert sorted(b.store.effects) == effects(1, 2, 3)
    assert all(d.acked for d in again)


# ---------------------------------------------------------------- duplicates


async def test_a_redelivered_message_with_an_inbox_row_is_acked_in_a_batch_without_running() -> (
    None
):
    b = make()
    d1, d2, _ = three()
    assert await b.handle(d1) == {Outcome.PROCESSED: 1}
    redelivered = d1.redeliver()
    assert await b.handle(redelivered, d2) == {Outcome.DUPLICATE: 1, Outcome.PROCESSED: 1}
    assert b.runs_of(1) == 1
    assert redelivered.acked
    assert sorted(b.store.effects) == effects(1, 2)


async def test_a_republish_inside_the_same_batch_is_acked_as_a_duplicate_without_running() -> None:
    """Two messages of one batch with one Nats-Msg-Id: the batch's claim takes the first;
    the second finds its msg-id taken."""
    first = delivery(b"1", seq=1, headers={"Nats-Msg-Id": "order-1"})
    republished = delivery(b"1", seq=2, headers={"Nats-Msg-Id": "order-1"})
    b = make()
    assert await b.handle(first, republished) == {Outcome.PROCESSED: 1, Outcome.DUPLICATE: 1}
    assert b.calls == [[1]]
    assert republished.acked
    assert b.store.effects == effects(1)


# ---------------------------------------------------------------- contention


async def test_a_commit_conflict_reruns_the_batch_one_message_per_transaction() -> None:
    """A deadlock at COMMIT (nothing committed): each message is run again alone, committed
    once, and the handler runs one transaction at a time for a while."""
    b = make()
    b.store.conflict_commits(1)
    assert await b.handle(*three()) == {Outcome.PROCESSED: 3}
    assert sorted(b.store.effects) == effects(1, 2, 3)
    assert b.store.commits == 3
    assert b.processor.single.contention.active
    assert b.store.attempts == {}


async def test_a_lock_timeout_on_the_batch_claim_runs_the_batch_one_message_at_a_time() -> None:
    b = make()
    b.store.lock_timeout_claims(1)
    assert await b.handle(*three()) == {Outcome.PROCESSED: 3}
    assert sorted(b.store.effects) == effects(1, 2, 3)
    assert b.store.commits == 3
    assert b.processor.single.contention.active


async def test_a_handler_failure_in_the_rerun_after_a_deadlock_is_counted_as_the_handlers() -> None:
    """A batch that hit a lock timeout reruns one message at a time: a handler failing there
    is counted (and parked) as its own failure. (Rerun inside the except clause that caught
    the lock timeout, the failure carried it as its __context__, passed for the database's,
    and was retried in process for ever, never counted.)"""
    b = make()
    b.fail(b"1", testing.LockNotAvailable(), RuntimeError("poison"))
    outcomes = await asyncio.wait_for(b.handle(*three()), 10)
    assert outcomes == {Outcome.RETRY: 1, Outcome.PROCESSED: 2}
    assert b.store.attempts == {key(1): 1}
    assert sorted(b.store.effects) == effects(2, 3)


async def test_in_contention_a_batch_runs_one_transaction_per_message() -> None:
    b = make()
    b.processor.single.contention.note()
    assert await b.handle(*three()) == {Outcome.PROCESSED: 3}
    assert (b.store.transactions, b.store.commits) == (3, 3)


async def test_in_contention_each_message_is_reported_settled_before_the_next_one_runs() -> None:
    """A batch crawling one message at a time behind hot rows tells the worker of each
    message as soon as it is settled (so it gives that message's slot back at once, for
    the other handlers of the process), not once the whole batch is done."""
    b = make()
    b.processor.single.contention.note()
    seen: list[tuple[str, int]] = []
    real = b.processor.single.spec.func

    async def recording(msg: Message, session: Any) -> None:
        seen.append(("run", msg.seq))
        await real(msg, session)  # type: ignore[misc]

    b.processor.single.spec = dataclasses.replace(b.processor.single.spec, func=recording)
    batches = batch.BatchProcessor(
        b.processor.single,
        settled_one=lambda d: seen.append(("settled", d.metadata.sequence.stream)),
    )
    outcomes = await batches.handle_batch(three(), b.processor.single.clock())
    assert outcomes == [Outcome.PROCESSED] * 3
    assert seen == [
        ("run", 1), ("settled", 1), ("run", 2), ("settled", 2), ("run", 3), ("settled", 3)
    ]  # fmt: skip


async def test_a_batch_settled_in_one_transaction_reports_no_message_alone() -> None:
    """The common path settles the whole batch at once: nothing is reported early, and the
    worker gives the batch's slots back together."""
    b = make()
    seen: list[int] = []
    batches = batch.BatchProcessor(b.processor.single, settled_one=lambda d: seen.append(1))
    assert await batches.handle_batch(three(), b.processor.single.clock()) == (
        [Outcome.PROCESSED] * 3
    )
    assert seen == []


async def test_a_commit_refused_for_the_handlers_writes_settles_each_message_alone() -> None:
    """A deferred constraint fails the batch's COMMIT: no batch failure, no attempt counted;
    each message runs in its own transaction, where a refusal would be its handler's."""
    b = make()
    b.store.fail_commits(1, UniqueViolation("duplicate key value violates orders_pkey"))
    assert await b.handle(*three()) == {Outcome.PROCESSED: 3}
    assert sorted(b.store.effects) == effects(1, 2, 3)
    assert b.store.commits == 3
    assert b.store.attempts == {}


# ------------------------------------------------------------ eop's own failures


@contextlib.contextmanager
def armed(point: faults.Point, nth: int = 1) -> Iterator[None]:
    """Raise :class:`eop.faults.FaultInjected` at the ``nth`` pass of ``point``."""
    faults.arm([faults.Rule(point, "raise", nth=nth)], seed=1)
    try:
        yield
    finally:
        faults.disarm()


def failing_unclaim(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the batch's first ``unclaim`` raise a bug of eop's own (not transient); the
    sequences it was called for."""
    calls: list[int] = []
    real = testing.MemoryTransaction.unclaim

    async def unclaim(self: testing.MemoryTransaction, message: Message) -> None:
        calls.append(message.seq)
        if len(calls) == 1:
            raise RuntimeError("a bug in eop's unclaim")
        await real(self, message)

    monkeypatch.setattr(testing.MemoryTransaction, "unclaim", unclaim)
    return calls


async def test_an_eop_statement_failing_in_the_batch_settles_each_message_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A non-transient failure of eop's own inside the batch transaction (here ``unclaim``
    of a failed handler's row) is no reason to nak the batch: each message goes to the
    per-message protocol, the good ones commit once at this delivery, the failed handler's
    message is parked as it would be alone; one error line says what happened, with the
    batch's coordinates and never a payload."""
    calls = failing_unclaim(monkeypatch)
    b = make().fail(b"2", ValueError("boom"))
    d1, d2, d3 = three()
    with capture_logs() as logs:
        assert await b.handle(d1, d2, d3) == {Outcome.PROCESSED: 2, Outcome.RETRY: 1}
    assert calls == [2]
    assert sorted(b.store.effects) == effects(1, 3)
    assert b.store.outcome_of(b.message(d2)) == models.OUTCOME_RETRYING
    assert b.store.dead_letters == []
    assert all(d.acked and not d.naked for d in (d1, d2, d3))
    [line] = events(logs, log.Event.BATCH_FAILED)
    assert line["log_level"] == "error"
    assert (line["handler"], line["stream"], line["first_seq"], line["last_seq"]) == (
        "orders",
        STREAM,
        1,
        3,
    )
    assert line["messages"] == 3
    assert "a bug in eop's unclaim" in line["error"]
    assert not {"data", "payload", "body"} & set(line)


@pytest.mark.parametrize("point", ["after_claim", "before_commit"])
async def test_a_fault_in_the_batch_transaction_before_its_commit_settles_each_message_alone(
    point: faults.Point,
) -> None:
    """Raised after the batch's claim or before its COMMIT: nothing committed; each message
    is run on its own and commits once, at this delivery, none nak'ed."""
    b = make()
    ds = three()
    with armed(point):
        assert await b.handle(*ds) == {Outcome.PROCESSED: 3}
    assert sorted(b.store.effects) == effects(1, 2, 3)
    assert b.store.commits == 3
    assert all(d.acked and not d.naked for d in ds)


async def test_a_failure_after_the_batch_commit_acks_each_message_without_running_it_again() -> (
    None
):
    """Raised after the batch's COMMIT, before its acks: the per-message protocol's claim
    finds each outcome committed and acks the message as a duplicate; no handler runs twice."""
    b = make()
    ds = three()
    with armed("after_commit"):
        assert await b.handle(*ds) == {Outcome.DUPLICATE: 3}
    assert b.calls == [[1], [2], [3]]
    assert (b.store.transactions, b.store.commits) == (4, 1)
    assert sorted(b.store.effects) == effects(1, 2, 3)
    assert all(d.acked and not d.naked for d in ds)


async def test_a_message_the_per_message_protocol_cannot_settle_either_is_left_alone_to_the_worker() -> (  # noqa: E501
    None
):
    """The batch transaction fails, then one message's own transaction too: its neighbours
    settle, and it alone is handed to the worker (:class:`batch.Unsettled`), which naks it."""
    b = make()
    b.store.fail_transactions(2, RuntimeError("a bug in eop"))
    ds = three()
    with pytest.raises(batch.Unsettled) as raised:
        await batch.BatchProcessor(b.processor.single).handle_batch(ds, b.processor.single.clock())
    [(failed, error)] = raised.value.failed
    assert str(error) == "a bug in eop"
    assert raised.value.outcomes == [Outcome.PROCESSED, Outcome.PROCESSED]
    others = [d for d in ds if d is not failed]
    assert all(d.acked for d in others)
    assert isinstance(failed, testing.FakeDelivery)
    assert not failed.is_acked  # no ack, nak or term: the worker's to nak
    assert len(b.store.effects) == 2


async def test_an_ambiguous_commit_whose_outcome_cannot_be_read_is_never_rerun_in_process() -> None:
    """After an ambiguous COMMIT the batch reads each outcome back; a message whose read
    fails for eop's own reason is left to the worker to nak, alone (its redelivery's claim
    decides), never run again here, and its neighbours are acked."""
    b = make()
    b.store.ambiguous_commit(committed=True)
    b.store.fail_has_outcome(1, RuntimeError("a bug in eop"))
    ds = three()
    with pytest.raises(batch.Unsettled) as raised:
        await batch.BatchProcessor(b.processor.single).handle_batch(ds, b.processor.single.clock())
    [(failed, _)] = raised.value.failed
    assert raised.value.outcomes == [Outcome.PROCESSED, Outcome.PROCESSED]
    assert b.calls == [[1], [2], [3]]
    assert (b.store.transactions, b.store.commits) == (1, 1)
    assert all(d.acked for d in ds if d is not failed)


async def test_a_stop_during_the_batch_commit_is_no_failure_to_fall_back_from() -> None:
    """Cancelled while its COMMIT runs, the batch still commits and acks (Critical) and the
    cancellation passes: no message is run again on its own."""
    b = make()
    b.store.pause_commits()
    ds = three()
    task = asyncio.create_task(b.handle(*ds))
    await b.store.commit_started.wait()
    task.cancel()
    await asyncio.sleep(0.01)
    b.store.resume_commits()
    with pytest.raises(asyncio.CancelledError):
        await task
    await b.processor.single.critical.drain()
    assert (b.store.transactions, b.store.commits) == (1, 1)
    assert b.calls == [[1], [2], [3]]
    assert all(d.acked and not d.naked for d in ds)


# -------------------------------------------------------------------- epochs


class TwoEpochs:
    """A stream recreated at RECREATED: "e1" before, "e2" from then on; counts look-ups."""

    def __init__(self) -> None:
        self.lookups = 0

    async def epoch_of(self, stream: str, stored_at: datetime.datetime | None) -> str | None:
        self.lookups += 1
        assert stored_at is not None
        return "e2" if stored_at >= RECREATED else "e1"

    async def refresh(self, stream: str) -> str:
        return "e2"

    async def read_within(self, stream: str, within_s: float, timeout_s: float) -> bool:
        return True

    def of_current(self, stream: str, stored_at: datetime.datetime | None) -> bool:
        return stored_at is None or stored_at >= RECREATED


def on_two_epochs(epochs: TwoEpochs) -> tuple[batch.BatchProcessor, testing.MemoryStore]:
    async def noop(msg: Message, session: Any) -> None:
        """A handler that does nothing."""

    spec = HandlerSpec(func=noop, name="orders", stream="S", subject="s", durable="eop-orders")
    store = testing.MemoryStore()
    single = processor.Processor(spec=spec, settings=FAST, store=store, epochs=epochs)
    return batch.BatchProcessor(single), store


def stored_at(*seconds: int) -> list[testing.FakeDelivery]:
    return [
        testing.FakeDelivery.make(seq=i, timestamp=T0 + datetime.timedelta(seconds=s))
        for i, s in enumerate(seconds, 1)
    ]


async def test_a_batch_within_one_epoch_needs_two_lookups_whatever_its_size() -> None:
    epochs = TwoEpochs()
    bp, store = on_two_epochs(epochs)
    await bp.handle_batch(stored_at(*range(8)), bp.single.clock())
    assert sorted(k[2] for k in store.inbox) == ["e1"] * 8
    assert epochs.lookups == 2


async def test_a_batch_across_a_recreated_stream_gets_each_messages_own_epoch() -> None:
    epochs = TwoEpochs()
    bp, store = on_two_epochs(epochs)
    await bp.handle_batch(stored_at(8, 9, 10, 11), bp.single.clock())
    assert {k[3]: k[2] for k in store.inbox} == {1: "e1", 2: "e1", 3: "e2", 4: "e2"}
