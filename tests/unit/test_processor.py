"""The per-message protocol (docs/design.md, 'The protocol'), branch by branch, on eop.testing's
fakes."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import nats.errors
import pytest
from sqlalchemy import exc as sa_exc
from structlog.testing import capture_logs

import eop
from eop import backoff, log, testing
from eop.message import Message
from eop.pg import models
from eop.pg.retries import ParkedDelivery
from eop.protocol.processor import Critical
from eop.types import Outcome

from .support import FAST, STREAM, Harness, MakeHarness, delivery, effect_of, events


def backoff_of(num_delivered: int) -> float:
    return backoff.backoff_s(num_delivered, FAST.backoff_base_s, FAST.backoff_max_s)


async def decode_json(msg: eop.Message, session: Any) -> None:
    msg.json()


class UniqueViolation(Exception):
    """What the driver raises when the handler's pending INSERT hits a unique index."""

    sqlstate = "23505"


# ------------------------------------------------------------------ processed


async def test_processed_message_commits_its_effect_with_its_inbox_row_and_is_acked(
    harness: Harness,
) -> None:
    d = delivery()
    assert await harness.handle(d) is Outcome.PROCESSED
    [msg] = harness.calls
    assert harness.store.effects == [effect_of(msg)]
    assert harness.store.outcome_of(msg) == models.OUTCOME_PROCESSED
    assert (d.acked, d.naked, d.termed) == (True, False, False)


async def test_handler_gets_message_keyed_on_handler_name_and_current_epoch(
    harness: Harness,
) -> None:
    await harness.handle(delivery(b"x", seq=7, headers={"Nats-Msg-Id": "m-7"}))
    [msg] = harness.calls
    assert (msg.subscription, msg.stream, msg.stream_epoch, msg.seq) == ("orders", STREAM, "e1", 7)
    assert (msg.data, msg.msg_id, msg.num_delivered) == (b"x", "m-7", 1)


# ----------------------------------------------------------------- duplicates


async def test_redelivery_of_processed_message_is_acked_without_running_handler(
    harness: Harness,
) -> None:
    first = delivery()
    await harness.handle(first)
    again = first.redeliver()
    assert await harness.handle(again) is Outcome.DUPLICATE
    assert len(harness.calls) == 1
    assert len(harness.store.effects) == 1
    assert again.acked


async def test_republish_with_same_msg_id_after_duplicate_window_is_acked_without_running(
    harness: Harness,
) -> None:
    """Same Nats-Msg-Id under a new sequence: the msg-id guard skips it."""
    await harness.handle(delivery(seq=1, headers={"Nats-Msg-Id": "order-1"}))
    republished = delivery(seq=9, headers={"Nats-Msg-Id": "order-1"})
    assert await harness.handle(republished) is Outcome.DUPLICATE
    assert len(harness.calls) == 1
    assert len(harness.store.effects) == 1
    assert republished.acked


async def test_without_msg_id_guard_a_republish_is_processed_again(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(msg_id_guard=False)
    await harness.handle(delivery(seq=1, headers={"Nats-Msg-Id": "order-1"}))
    assert await harness.handle(delivery(seq=9, headers={"Nats-Msg-Id": "order-1"})) is (
        Outcome.PROCESSED
    )
    assert len(harness.store.effects) == 2


# ------------------------------------------------------- reused sequence, epochs


async def test_reused_sequence_with_other_payload_is_quarantined_and_termed(
    harness: Harness,
) -> None:
    await harness.handle(delivery(b"first", seq=1))
    other = delivery(b"second", seq=1)
    assert await harness.handle(other) is Outcome.QUARANTINED
    assert len(harness.calls) == 1
    [dead] = harness.store.dead_letters
    assert (dead.reason, dead.payload, dead.stream_seq) == (
        models.REASON_SEQUENCE_REUSED,
        b"second",
        1,
    )
    assert other.termed
    assert not other.acked


async def test_quarantine_raises_an_alarm(harness: Harness) -> None:
    await harness.handle(delivery(b"first"))
    with capture_logs() as logs:
        await harness.handle(delivery(b"second"))
    [alarm] = events(logs, log.Event.MESSAGE_QUARANTINED)
    assert alarm["log_level"] == "error"
    assert alarm["alarm"] is True
    assert alarm["action"] == log.Action.TERM


async def test_redelivered_reused_sequence_is_quarantined_once(harness: Harness) -> None:
    await harness.handle(delivery(b"first"))
    other = delivery(b"second")
    await harness.handle(other)
    assert await harness.handle(other.redeliver()) is Outcome.QUARANTINED
    assert len(harness.store.dead_letters) == 1


async def test_reused_sequence_after_stream_recreated_is_processed_under_new_epoch(
    harness: Harness,
) -> None:
    await harness.handle(delivery(b"old stream", seq=1))
    harness.epochs.set(STREAM, "e2")  # recreated: the cached epoch is stale
    new = delivery(b"new stream", seq=1)
    assert await harness.handle(new) is Outcome.PROCESSED
    assert [m.stream_epoch for m in harness.calls] == ["e1", "e2"]
    assert sorted(key[2] for key in harness.store.inbox) == ["e1", "e2"]
    assert harness.store.dead_letters == []
    assert new.acked


# ------------------------------------------------------------ handler failures


async def test_handler_error_rolls_back_counts_the_failure_and_parks_the_message(
    harness: Harness,
) -> None:
    """The retry waits in the database (acked, inbox row retrying), out of MaxAckPending."""
    harness.then(RuntimeError("boom"))
    d = delivery(num_delivered=2)
    assert await harness.handle(d) is Outcome.RETRY
    assert harness.store.effects == []
    [row] = harness.store.inbox.values()
    assert row.outcome == models.OUTCOME_RETRYING
    assert list(harness.store.attempts.values()) == [1]
    assert harness.store.parked == {row.key}
    assert d.acked
    assert not d.naked


async def test_attempts_are_handler_failures_not_the_servers_delivery_count(
    harness: Harness,
) -> None:
    """A message delivered many times (outages, lost leases) still gets its max_attempts."""
    harness.then(RuntimeError("boom"))
    d = delivery(num_delivered=FAST.max_attempts + 5)
    assert await harness.handle(d) is Outcome.RETRY
    assert harness.store.dead_letters == []
    assert list(harness.store.attempts.values()) == [1]


async def test_ordered_handler_retry_naks_with_the_delay_the_handler_asked_for(
    make_harness: MakeHarness,
) -> None:
    """An ordered handler's retry stays a nak'ed redelivery (its key's followers wait)."""
    harness = make_harness(order_by="subject:1").then(eop.Retry("later", delay_s=7.5))
    d = delivery()
    assert await harness.handle(d) is Outcome.RETRY
    assert d.nak_delay == 7.5
    assert harness.store.effects == []
    assert harness.store.inbox == {}
    assert list(harness.store.attempts.values()) == [1]
    assert harness.store.parked == set()


async def test_ordered_handler_backs_off_by_its_failures(make_harness: MakeHarness) -> None:
    harness = make_harness(order_by="subject:1").then(RuntimeError("boom"))
    d = delivery(num_delivered=9)
    harness.failed_before(d, 1)
    assert await harness.handle(d) is Outcome.RETRY
    assert d.nak_delay == backoff_of(2)


async def test_ordered_handler_success_forgets_its_counted_failures(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(order_by="subject:1")
    d = delivery(num_delivered=2)
    harness.failed_before(d, 1)
    assert await harness.handle(d) is Outcome.PROCESSED
    assert harness.store.attempts == {}


async def test_reject_dead_letters_at_once_and_terms(harness: Harness) -> None:
    harness.then(eop.Reject("never valid"))
    d = delivery()
    assert await harness.handle(d) is Outcome.DEAD_LETTERED
    [dead] = harness.store.dead_letters
    assert dead.reason == models.REASON_REJECTED
    assert harness.store.outcome_of(harness.calls[0]) == models.OUTCOME_DEAD_LETTERED
    assert harness.store.effects == []
    assert d.termed
    assert not d.naked


async def test_rejected_message_redelivered_is_acked_without_running_again(
    harness: Harness,
) -> None:
    harness.then(eop.Reject("never valid"))
    d = delivery()
    await harness.handle(d)
    assert await harness.handle(d.redeliver()) is Outcome.DUPLICATE
    assert len(harness.calls) == 1


async def test_undecodable_json_dead_letters_as_undecodable(harness: Harness) -> None:
    harness.then(decode_json)
    d = delivery(b"\x00not json")
    assert await harness.handle(d) is Outcome.DEAD_LETTERED
    [dead] = harness.store.dead_letters
    assert dead.reason == models.REASON_UNDECODABLE
    assert "UndecodableMessage" in dead.error
    assert d.termed


async def test_failure_on_last_attempt_dead_letters_attempts_exhausted(harness: Harness) -> None:
    harness.then(RuntimeError("still broken"))
    d = delivery(num_delivered=2)
    harness.failed_before(d, FAST.max_attempts - 1)
    assert await harness.handle(d) is Outcome.DEAD_LETTERED
    [dead] = harness.store.dead_letters
    assert dead.reason == models.REASON_ATTEMPTS_EXHAUSTED
    assert "RuntimeError: still broken" in dead.error
    assert d.termed
    assert harness.store.attempts == {}


async def test_retry_request_on_last_attempt_dead_letters(harness: Harness) -> None:
    harness.then(eop.Retry(delay_s=1))
    d = delivery(num_delivered=FAST.max_attempts)
    harness.failed_before(d, FAST.max_attempts - 1)
    assert await harness.handle(d) is Outcome.DEAD_LETTERED
    assert harness.store.dead_letters[0].reason == models.REASON_ATTEMPTS_EXHAUSTED


async def test_handler_max_attempts_overrides_settings(make_harness: MakeHarness) -> None:
    harness = make_harness(max_attempts=1).then(RuntimeError("boom"))
    assert await harness.handle(delivery(num_delivered=1)) is Outcome.DEAD_LETTERED


async def test_crash_looping_message_is_dead_lettered_without_running_handler(
    harness: Harness,
) -> None:
    """Run max_deliveries times without an outcome (its worker died in each), each run
    counted before it started: the next delivery is dead-lettered without running."""
    d = delivery(num_delivered=FAST.max_deliveries + 1)
    harness.ran_before(d, FAST.max_deliveries)
    assert await harness.handle(d) is Outcome.DEAD_LETTERED
    assert harness.calls == []
    [dead] = harness.store.dead_letters
    assert dead.reason == models.REASON_CRASH_LOOP
    assert dead.error is not None
    assert f"in each of its {FAST.max_deliveries} runs" in dead.error
    assert f"(max_deliveries={FAST.max_deliveries})" in dead.error
    assert dead.traceback is None
    assert d.termed


async def test_a_redelivery_is_counted_before_it_runs_and_not_when_it_has_its_outcome(
    harness: Harness,
) -> None:
    """A redelivered message's run is committed before its handler starts (a run that
    kills its process still counts) and forgotten with its outcome; a redelivery of a
    message that has its outcome counts no run."""
    d = delivery(num_delivered=2)
    harness.ran_before(d, 1)
    key = ("orders", STREAM, "e1", 1)
    assert await harness.handle(d) is Outcome.PROCESSED
    assert key not in harness.store.runs
    again = delivery(num_delivered=3)
    assert await harness.handle(again) is Outcome.DUPLICATE
    assert key not in harness.store.runs


async def test_a_redelivery_found_settled_forgets_earlier_runs_but_not_a_parked_retry(
    harness: Harness,
) -> None:
    """Runs counted by earlier redeliveries of a message that its first delivery then
    processed (knowing nothing of them) are forgotten by the next redelivery, which finds
    it done; a redelivery of a parked message, a duplicate too, leaves its parked retry
    (failures and all) as it was."""
    done, parked = delivery(seq=1), delivery(seq=2)
    harness.ran_before(done, 2)
    harness.then(None, RuntimeError("boom"))
    assert await harness.handle(done) is Outcome.PROCESSED
    assert await harness.handle(parked) is Outcome.RETRY
    assert await harness.handle(delivery(seq=1, num_delivered=3)) is Outcome.DUPLICATE
    assert await harness.handle(delivery(seq=2, num_delivered=2)) is Outcome.DUPLICATE
    assert harness.store.runs == {}
    key = ("orders", STREAM, "e1", 2)
    assert harness.store.parked == {key}
    assert harness.store.attempts == {key: 1}


async def test_neighbours_of_a_killing_message_are_not_counted_runs_they_never_had(
    harness: Harness,
) -> None:
    """Redelivered many times because a neighbour killed their worker before they started,
    messages with no counted run are attempted, not dead-lettered as a crash loop."""
    d = delivery(num_delivered=FAST.max_deliveries + 5)
    assert await harness.handle(d) is Outcome.PROCESSED
    assert harness.store.dead_letters == []


async def test_dead_letter_claim_finding_an_outcome_acks_as_duplicate(harness: Harness) -> None:
    """An earlier delivery committed (its ack was lost); a crash-loop dead letter must not."""
    d = delivery(num_delivered=FAST.max_attempts + 1)
    msg = eop.Message(
        subscription="orders",
        subject=d.subject,
        data=d.data,
        headers={},
        stream=STREAM,
        stream_epoch="e1",
        seq=1,
        num_delivered=1,
    )
    harness.store.record(msg)
    assert await harness.handle(d) is Outcome.DUPLICATE
    assert harness.store.dead_letters == []
    assert d.acked
    assert not d.termed


async def test_dead_letter_keeps_the_evidence_with_secrets_redacted(harness: Harness) -> None:
    harness.then(eop.Reject("bad order"))
    headers = {"Nats-Msg-Id": "m-1", "Authorization": "Bearer s3cr3t", "X-Trace": "t-1"}
    await harness.handle(delivery(b'{"id": 1}', seq=4, headers=headers, num_delivered=2))
    [dead] = harness.store.dead_letters
    assert dead.reason == models.REASON_REJECTED
    assert dead.error == "Reject: bad order"
    assert dead.traceback is not None
    assert "Traceback" in dead.traceback
    assert "bad order" in dead.traceback
    assert (dead.subject, dead.payload, dead.stream_seq, dead.delivery_count) == (
        "orders.new",
        b'{"id": 1}',
        4,
        2,
    )
    assert dead.headers == {"Nats-Msg-Id": "m-1", "Authorization": "***", "X-Trace": "t-1"}
    assert dead.msg_id == "m-1"


async def test_a_failed_statements_bound_values_stay_out_of_dead_letter_and_logs(
    harness: Harness,
) -> None:
    """SQLAlchemy prints a failed statement's parameters (payload data): the dead
    letter's error and traceback, and the log line, keep the SQL and drop them."""
    orig = UniqueViolation('duplicate key value violates unique constraint "orders_pkey"')
    params = ("s3cr3t-id",)  # not on the raising line: the traceback quotes that line
    try:
        raise sa_exc.IntegrityError("INSERT INTO orders VALUES ($1)", params, orig)
    except sa_exc.IntegrityError as exc:
        failure = exc
    harness.then(failure)
    with capture_logs() as logs:
        d = delivery(num_delivered=FAST.max_attempts)
        harness.failed_before(d, FAST.max_attempts - 1)
        assert await harness.handle(d) is Outcome.DEAD_LETTERED
    [dead] = harness.store.dead_letters
    assert dead.traceback is not None
    [line] = events(logs, log.Event.MESSAGE_DEAD_LETTERED)
    for text in (dead.error, dead.traceback, line["error"]):
        assert "orders_pkey" in text
        assert "[SQL: INSERT INTO orders VALUES ($1)]" in text
        assert "s3cr3t-id" not in text


# ------------------------------------------------------- transactions retried


async def test_conflict_on_commit_retries_whole_transaction_and_applies_effect_once(
    harness: Harness,
) -> None:
    harness.store.conflict_commits(1)
    d = delivery()
    assert await harness.handle(d) is Outcome.PROCESSED
    assert len(harness.calls) == 2
    assert harness.store.effects == [effect_of(harness.calls[0])]
    assert d.acked


async def test_conflicts_are_retried_until_the_transaction_commits(harness: Harness) -> None:
    """Deadlocks and serialization failures never count as attempts, however many."""
    harness.store.conflict_commits(FAST.max_attempts + 4)
    d = delivery()
    assert await harness.handle(d) is Outcome.PROCESSED
    assert len(harness.calls) == FAST.max_attempts + 5
    assert harness.store.effects == [effect_of(harness.calls[0])]
    assert harness.store.attempts == {}
    assert d.acked


async def test_a_stop_hands_a_message_waiting_to_retry_back_at_once(harness: Harness) -> None:
    """While the database fails, a stopping worker naks (no delay) instead of waiting: left
    for redelivery, not counted as a retry (nothing failed)."""
    harness.store.conflict_commits(1000)
    harness.processor.stopping.set()
    d = delivery()
    assert await harness.handle(d) is Outcome.LEFT
    assert d.naked
    assert d.nak_delay == 0.0
    assert harness.store.attempts == {}
    assert harness.store.dead_letters == []


class DatabaseBusy(Exception):
    """A driver error carrying one of the SQLSTATEs of a busy or unwilling database."""

    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"sqlstate {sqlstate}")
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    "sqlstate",
    ["55P03", "57014", "25006", "53300", "40P01", "40001", "57P01", "08006"],
)
async def test_database_failure_raised_in_handler_is_retried_and_never_counted(
    harness: Harness, sqlstate: str
) -> None:
    """Lock and statement timeouts, read-only, too many connections, deadlocks, outages."""
    harness.then(*[DatabaseBusy(sqlstate)] * (FAST.max_attempts + 2))
    d = delivery()
    assert await harness.handle(d) is Outcome.PROCESSED
    assert len(harness.calls) == FAST.max_attempts + 3
    assert harness.store.dead_letters == []
    assert harness.store.attempts == {}
    assert harness.store.effects == [effect_of(harness.calls[-1])]


async def test_serialization_failure_raised_in_handler_retries_the_transaction(
    harness: Harness,
) -> None:
    class SerializationFailure(Exception):
        sqlstate = "40001"

    harness.then(SerializationFailure("could not serialize access"))
    assert await harness.handle(delivery()) is Outcome.PROCESSED
    assert len(harness.calls) == 2
    assert len(harness.store.effects) == 1


async def test_database_unavailable_when_opening_transaction_is_retried(
    harness: Harness, fast_sleep: None
) -> None:
    harness.store.fail_transactions(2)
    assert await harness.handle(delivery()) is Outcome.PROCESSED
    assert len(harness.calls) == 1


async def test_a_transaction_retry_line_counts_in_retry_not_the_messages_attempt(
    harness: Harness, fast_sleep: None
) -> None:
    """`transaction.retry` counts the transaction's retries in `retry`: a parked retry's
    line carries the message's own `attempt`, which the count must not overwrite."""
    harness.store.fail_transactions(2)
    with capture_logs() as logs:
        assert await harness.handle(delivery()) is Outcome.PROCESSED
    retries = events(logs, "transaction.retry")
    assert [e["retry"] for e in retries] == [1, 2]
    assert all("attempt" not in e for e in retries)


async def test_a_failure_of_the_database_once_the_worker_stops_hands_the_message_back_quietly(
    harness: Harness, fast_sleep: None
) -> None:
    """Once a stop is asked for, a transaction failing on the database is not retried: the
    message is nak'ed at once for redelivery, without a `transaction.retry` line saying it
    would run again (a misconfiguration stopping the worker would otherwise print one per
    message in flight)."""
    harness.store.fail_transactions(1)
    harness.processor.stopping.set()
    d = delivery()
    with capture_logs() as logs:
        await harness.handle(d)
    assert d.naked
    assert d.nak_delay == 0.0
    assert events(logs, "transaction.retry") == []
    assert harness.calls == []


async def test_after_a_deadlock_the_retry_waits_for_its_turn_across_the_fleet(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deadlocked transaction is retried contended: one at a time in the process, and it
    takes its turn across the fleet before its claim, so that processes each running one
    at a time stop crossing each other. The first, uncontended run takes no turn."""
    turns: list[bool] = []
    real_claim = testing.MemoryTransaction.claim

    async def take_turn(self: testing.MemoryTransaction) -> None:
        turns.append(True)

    async def claim(self: testing.MemoryTransaction, message: Any, outcome: str) -> bool:
        turns.append(False)
        return await real_claim(self, message, outcome)

    monkeypatch.setattr(testing.MemoryTransaction, "take_turn", take_turn)
    monkeypatch.setattr(testing.MemoryTransaction, "claim", claim)
    harness.then(DatabaseBusy("40P01"))
    assert await harness.handle(delivery()) is Outcome.PROCESSED
    # The first run's claim without a turn, then the retry's turn before its claim.
    assert turns == [False, True, False]
    assert len(harness.store.effects) == 1


async def test_a_settled_message_arriving_contended_is_acked_without_waiting_for_the_turn(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a handler runs contended, a late republish of a settled message (its msg-id
    taken) is looked up first and acked as a duplicate: it does not queue for the
    fleet's turn behind the contended transactions it has nothing to write beside."""
    turns: list[int] = []

    async def take_turn(self: testing.MemoryTransaction) -> None:
        turns.append(1)

    monkeypatch.setattr(testing.MemoryTransaction, "take_turn", take_turn)
    await harness.handle(delivery(seq=1, headers={"Nats-Msg-Id": "order-1"}))
    harness.processor.contention.note()
    republished = delivery(seq=9, headers={"Nats-Msg-Id": "order-1"})
    assert await harness.handle(republished) is Outcome.DUPLICATE
    assert republished.acked
    assert turns == []
    # A message not settled yet still takes its turn before its claim.
    assert await harness.handle(delivery(seq=10)) is Outcome.PROCESSED
    assert turns == [1]
    assert len(harness.calls) == 2


async def test_a_message_queued_for_its_turn_when_the_worker_stops_is_handed_back_unrun(
    harness: Harness,
) -> None:
    """After a deadlock a handler's messages queue to run one at a time; those still
    queued when a stop is asked for are nak'ed at once, not run one by one through the
    stop's grace period."""
    contention = harness.processor.contention
    contention.note()
    # Another message's turn, under way.
    await _stopped_while_queued(harness, contention._one_at_a_time, delivery())


async def test_a_redelivery_queued_behind_others_when_the_worker_stops_is_handed_back_unrun(
    harness: Harness,
) -> None:
    """Redeliveries with a counted run run one at a time in a process (their runs counted
    first); one still queued when a stop is asked for is nak'ed at once, its run not
    counted, rather than run through the stop's grace period behind the others."""
    d = delivery().redeliver()
    harness.ran_before(d, 1)
    # Another redelivery's run, under way.
    await _stopped_while_queued(harness, harness.processor.suspects, d)
    assert harness.store.runs == {("orders", STREAM, "e1", 1): 1}


async def test_a_first_run_without_an_outcome_does_not_wait_for_other_redeliveries(
    harness: Harness,
) -> None:
    """A redelivery with no run counted yet (its first delivery died with a neighbour, or
    was handed back) runs at once, beside the process's other redeliveries, its run
    counted before it starts and forgotten with its outcome: after a crash, a process's
    redeliveries do not queue one by one behind each other (nor behind the hot rows its
    new messages wait on)."""
    d = delivery().redeliver()
    seen = _runs_seen_by_the_handler(harness)
    async with harness.processor.suspects:  # another redelivery's run, under way
        outcome = await asyncio.wait_for(harness.handle(d), 5)
    assert outcome is Outcome.PROCESSED
    assert seen == [{("orders", STREAM, "e1", 1): 1}]
    assert harness.store.runs == {}


async def test_a_redelivery_with_a_counted_run_waits_its_turn_and_counts_another(
    harness: Harness,
) -> None:
    """A message whose counted run ended with no outcome (its process died in it) runs
    alone: it waits while another redelivery runs, and its run is counted only when its
    turn comes, so a process dying meanwhile blames no message that was only waiting."""
    d = delivery(num_delivered=3)
    harness.ran_before(d, 1)
    key = ("orders", STREAM, "e1", 1)
    seen = _runs_seen_by_the_handler(harness)
    async with harness.processor.suspects:
        handling = asyncio.ensure_future(harness.handle(d))
        await asyncio.sleep(0.05)
        assert not handling.done()
        assert harness.store.runs == {key: 1}
    assert await handling is Outcome.PROCESSED
    assert seen == [{key: 2}]
    assert harness.store.runs == {}


async def test_with_max_deliveries_1_even_a_first_redelivery_runs_alone(
    make_harness: MakeHarness,
) -> None:
    """A first run beside others may cost a good neighbour one count; at max_deliveries=1
    that count alone would dead-letter it on its next delivery, so every redelivery runs
    alone there."""
    harness = make_harness(settings=dataclasses.replace(FAST, max_deliveries=1))
    d = delivery().redeliver()
    async with harness.processor.suspects:
        handling = asyncio.ensure_future(harness.handle(d))
        await asyncio.sleep(0.05)
        assert not handling.done()
    assert await handling is Outcome.PROCESSED


def _runs_seen_by_the_handler(harness: Harness) -> list[dict[tuple[str, str, str, int], int]]:
    """Script the next handler call to note the committed run counts as it starts; the
    list it appends them to."""
    seen: list[dict[tuple[str, str, str, int], int]] = []

    async def note_runs(msg: Message, session: Any) -> None:
        seen.append(dict(harness.store.runs))

    harness.then(note_runs)
    return seen


async def _stopped_while_queued(harness: Harness, held: asyncio.Lock, d: Any) -> None:
    """Handle ``d`` while ``held`` is taken, ask for a stop, then let it go: ``d`` must
    be nak'ed at once (no delay) with its handler never run, left for redelivery."""
    async with held:
        handling = asyncio.ensure_future(harness.handle(d))
        await asyncio.sleep(0.01)
        assert not handling.done()
        harness.processor.stopping.set()
    assert await handling is Outcome.LEFT
    assert (d.naked, d.nak_delay, harness.calls) == (True, 0.0, [])


async def test_row_vanished_between_claim_and_lookup_retries_the_transaction(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed claim whose row is gone on look-up (compacted meanwhile): claim again."""
    d = delivery()
    await harness.handle(d)
    real_find = testing.MemoryTransaction.find
    finds: list[Any] = []

    async def find_vanishing_once(self: testing.MemoryTransaction, message: Any) -> Any:
        finds.append(message)
        return None if len(finds) == 1 else await real_find(self, message)

    monkeypatch.setattr(testing.MemoryTransaction, "find", find_vanishing_once)
    assert await harness.handle(d.redeliver()) is Outcome.DUPLICATE
    assert len(finds) == 2


async def test_non_transient_store_error_is_raised(harness: Harness) -> None:
    harness.store.fail_claims(1, ValueError("schema mismatch"))
    with pytest.raises(ValueError, match="schema mismatch"):
        await harness.handle(delivery())
    assert harness.calls == []


# ------------------------------------------------------------- claim timeouts


async def test_claim_lock_timeout_naks_without_running_handler(harness: Harness) -> None:
    harness.store.lock_timeout_claims(1)
    d = delivery(num_delivered=2)
    assert await harness.handle(d) is Outcome.RETRY
    assert harness.calls == []
    assert d.naked
    assert d.nak_delay == backoff_of(2)


async def test_redelivery_overlapping_a_live_run_waits_and_is_acked_as_duplicate(
    harness: Harness,
) -> None:
    """A redelivery blocks on the claim of the live run, then finds its committed row."""
    release = asyncio.Event()
    started = asyncio.Event()

    async def slow(msg: eop.Message, session: Any) -> None:
        started.set()
        await release.wait()

    harness.then(slow)
    first = delivery()
    live = asyncio.create_task(harness.handle(first))
    await started.wait()
    overlapping = asyncio.create_task(harness.handle(first.redeliver()))
    await asyncio.sleep(0)
    release.set()
    assert await live is Outcome.PROCESSED
    assert await overlapping is Outcome.DUPLICATE
    assert len(harness.calls) == 1
    assert len(harness.store.effects) == 1


async def test_redelivery_overlapping_a_live_run_times_out_on_claim_and_naks(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(lock_timeout_s=0.01)
    release = asyncio.Event()
    started = asyncio.Event()

    async def slow(msg: eop.Message, session: Any) -> None:
        started.set()
        await release.wait()

    harness.then(slow)
    first = delivery()
    live = asyncio.create_task(harness.handle(first))
    await started.wait()
    second = first.redeliver()
    assert await harness.handle(second) is Outcome.RETRY
    assert second.naked
    release.set()
    assert await live is Outcome.PROCESSED
    assert len(harness.calls) == 1


# ---------------------------------------------------------- ambiguous commits


async def test_ambiguous_commit_that_committed_is_acked_and_not_rerun(harness: Harness) -> None:
    harness.store.ambiguous_commit(committed=True)
    d = delivery()
    assert await harness.handle(d) is Outcome.PROCESSED
    assert len(harness.calls) == 1
    assert len(harness.store.effects) == 1
    assert d.acked


async def test_ambiguous_commit_that_did_not_commit_is_naked_and_not_rerun(
    harness: Harness,
) -> None:
    harness.store.ambiguous_commit(committed=False)
    d = delivery()
    assert await harness.handle(d) is Outcome.RETRY
    assert len(harness.calls) == 1
    assert harness.store.effects == []
    assert d.naked
    assert not d.acked


async def test_ambiguous_commit_resolution_retries_a_lost_look_up(
    harness: Harness, fast_sleep: None
) -> None:
    harness.store.ambiguous_commit(committed=True).fail_has_outcome(2)
    d = delivery()
    assert await harness.handle(d) is Outcome.PROCESSED
    assert d.acked


async def test_ambiguous_commit_left_unresolved_leaves_the_delivery(
    harness: Harness, fast_sleep: None
) -> None:
    """The inbox stays unreachable: neither ack nor nak; redelivery decides."""
    harness.store.ambiguous_commit(committed=True).fail_has_outcome(3)
    d = delivery()
    assert await harness.handle(d) is Outcome.LEFT
    assert not d.is_acked
    assert len(harness.calls) == 1


async def test_ambiguous_commit_look_up_failing_for_good_is_raised(harness: Harness) -> None:
    harness.store.ambiguous_commit(committed=True).fail_has_outcome(1, ValueError("bad query"))
    d = delivery()
    with pytest.raises(ValueError, match="bad query"):
        await harness.handle(d)
    assert not d.acked


async def test_ambiguous_commit_of_a_dead_letter_that_committed_settles_it(
    harness: Harness,
) -> None:
    harness.then(eop.Reject("no"))
    harness.store.ambiguous_commit(committed=True)
    d = delivery()
    await harness.handle(d)
    assert len(harness.store.dead_letters) == 1
    assert d.acked or d.termed
    assert not d.naked


async def test_ambiguous_commit_of_a_dead_letter_that_committed_is_reported_dead_lettered(
    harness: Harness,
) -> None:
    harness.then(eop.Reject("no"))
    harness.store.ambiguous_commit(committed=True)
    assert await harness.handle(delivery()) is Outcome.DEAD_LETTERED


# ----------------------------------------------------------------- the lease


async def test_spent_lease_leaves_delivery_without_running_handler(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(clock=lambda: 1000.0)
    d = delivery()
    outcome = await harness.handle(d, received_at=1000.0 - FAST.ack_wait_s)
    assert outcome is Outcome.LEFT
    assert harness.calls == []
    assert harness.store.transactions == 0
    assert not d.is_acked


async def test_handler_ack_wait_overrides_settings_for_the_lease(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(clock=lambda: 1000.0, ack_wait_s=120.0)
    outcome = await harness.handle(delivery(), received_at=1000.0 - FAST.ack_wait_s)
    assert outcome is Outcome.PROCESSED


async def test_heartbeat_sends_in_progress_while_a_slow_handler_runs(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(settings=FAST.replace(ack_wait_s=0.15, lease_margin_s=0.0))
    d = delivery()

    async def slow(msg: eop.Message, session: Any) -> None:
        await asyncio.wait_for(d.wait_for_in_progress(2), timeout=10)

    harness.then(slow)
    assert await harness.handle(d) is Outcome.PROCESSED
    assert d.in_progress_calls >= 2


# ---------------------------------------------------------------------- acks


async def test_lost_ack_replies_are_retried_until_the_ack_is_confirmed(harness: Harness) -> None:
    d = delivery().fail_acks(2)
    assert await harness.handle(d) is Outcome.PROCESSED
    assert d.ack_attempts == 3
    assert d.acked


async def test_ack_that_keeps_timing_out_is_given_up_and_the_outcome_stands(
    harness: Harness,
) -> None:
    d = delivery().fail_acks(10_000)
    with capture_logs() as logs:
        assert await harness.handle(d) is Outcome.PROCESSED
    assert not d.acked
    assert d.ack_attempts >= 2
    assert len(harness.store.effects) == 1
    assert events(logs, log.Event.ACK_GAVE_UP)


async def test_already_acked_error_counts_as_a_confirmed_ack(harness: Harness) -> None:
    d = delivery().fail_acks(1, nats.errors.MsgAlreadyAckdError)
    with capture_logs() as logs:
        assert await harness.handle(d) is Outcome.PROCESSED
    assert d.ack_attempts == 1
    assert events(logs, log.Event.ACK_GAVE_UP) == []


# -------------------------------------------------------------- cancellation


async def cancel_during_commit(harness: Harness, d: testing.FakeDelivery) -> None:
    """Start handling ``d``, cancel it while its COMMIT is held, then let the COMMIT go.

    The cancelled caller waits for its critical section, so the COMMIT is let
    go before the caller is awaited.
    """
    harness.store.pause_commits()
    task = asyncio.create_task(harness.handle(d))
    await harness.store.commit_started.wait()
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()
    harness.store.resume_commits()
    with pytest.raises(asyncio.CancelledError):
        await task
    await harness.processor.critical.drain()


async def test_cancellation_during_commit_still_commits_and_acks(harness: Harness) -> None:
    """The Critical shield: a stop never cuts between COMMIT and the ack."""
    d = delivery()
    await cancel_during_commit(harness, d)
    assert len(harness.store.effects) == 1
    assert d.acked


async def test_cancellation_during_dead_letter_commit_still_terms(harness: Harness) -> None:
    harness.then(eop.Reject("no"))
    d = delivery()
    await cancel_during_commit(harness, d)
    assert len(harness.store.dead_letters) == 1
    assert d.termed


async def test_cancellation_during_quarantine_commit_still_terms(harness: Harness) -> None:
    await harness.handle(delivery(b"first"))
    other = delivery(b"second")
    await cancel_during_commit(harness, other)
    assert len(harness.store.dead_letters) == 1
    assert other.termed


async def test_cancellation_does_not_close_the_transaction_under_its_running_commit(
    harness: Harness,
) -> None:
    await cancel_during_commit(harness, delivery())
    assert harness.store.misuse == []


async def test_critical_section_finishes_before_its_cancelled_caller_returns() -> None:
    """A cancelled caller of Critical.run waits for the section, then sees the cancellation."""
    critical = Critical()
    release = asyncio.Event()
    done: list[str] = []

    async def section() -> str:
        await release.wait()
        done.append("section")
        return "ok"

    caller = asyncio.create_task(critical.run(section()))
    await asyncio.sleep(0)
    caller.cancel()
    await asyncio.sleep(0.01)
    assert not caller.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await critical.drain()
    assert done == ["section"]


# ------------------------------------------------------------------- logging


async def test_processed_log_line_carries_coordinates_and_action_never_the_payload(
    harness: Harness,
) -> None:
    payload = b'{"card": "4111-1111-SECRET"}'
    with capture_logs() as logs:
        await harness.handle(delivery(payload, seq=12, num_delivered=2))
    [line] = events(logs, log.Event.MESSAGE_PROCESSED)
    assert line["handler"] == "orders"
    assert line["stream"] == STREAM
    assert line["seq"] == 12
    assert line["delivered"] == 2
    assert line["action"] == log.Action.ACK
    for entry in logs:
        assert "SECRET" not in repr(entry)


async def test_dead_letter_log_line_never_carries_the_payload(harness: Harness) -> None:
    harness.then(decode_json)
    with capture_logs() as logs:
        await harness.handle(delivery(b"\x00SECRET-GARBAGE"))
    [line] = events(logs, log.Event.MESSAGE_DEAD_LETTERED)
    assert line["reason"] == models.REASON_UNDECODABLE
    assert line["action"] == log.Action.TERM
    for entry in logs:
        assert "SECRET" not in repr(entry)


# ------------------------------------------------------------ parked retries


async def park(harness: Harness, d: testing.FakeDelivery) -> ParkedDelivery:
    """Fail ``d`` once (parking it) and take it back as the retry loop would."""
    harness.then(RuntimeError("first"))
    assert await harness.handle(d) is Outcome.RETRY
    msg = harness.calls[-1]
    again = dataclasses.replace(msg, num_delivered=2)
    return ParkedDelivery(again, failures=1, runs=1)


async def test_parked_run_that_succeeds_commits_the_effect_and_forgets_the_failures(
    harness: Harness,
) -> None:
    parked = await park(harness, delivery())
    assert await harness.processor.retry_parked(parked) is Outcome.PROCESSED
    [row] = harness.store.inbox.values()
    assert row.outcome == models.OUTCOME_PROCESSED
    assert harness.store.attempts == {}
    assert harness.store.parked == set()
    assert harness.store.effects == [effect_of(harness.calls[-1])]


async def test_parked_run_that_fails_again_counts_and_stays_parked(harness: Harness) -> None:
    """The run's handler fails in a savepoint: its failure is counted, and the message
    parked again, in the run's own transaction (one transaction per failing run: a
    poison flood's retries cost half what they did)."""
    parked = await park(harness, delivery())
    harness.then(RuntimeError("second"))
    opened = harness.store.transactions
    assert await harness.processor.retry_parked(parked) is Outcome.RETRY
    assert harness.store.transactions == opened + 1
    assert list(harness.store.attempts.values()) == [2]
    [row] = harness.store.inbox.values()
    assert row.outcome == models.OUTCOME_RETRYING
    assert harness.store.effects == []


async def test_parked_run_of_the_last_attempt_dead_letters_it(harness: Harness) -> None:
    parked = await park(harness, delivery())
    harness.failed_before(delivery(), FAST.max_attempts - 1)
    harness.then(RuntimeError("last"))
    assert await harness.processor.retry_parked(parked) is Outcome.DEAD_LETTERED
    [row] = harness.store.inbox.values()
    assert row.outcome == models.OUTCOME_DEAD_LETTERED
    [dead] = harness.store.dead_letters
    assert dead.reason == models.REASON_ATTEMPTS_EXHAUSTED
    assert harness.store.attempts == {}


async def test_parked_run_rejected_by_its_handler_is_dead_lettered(harness: Harness) -> None:
    parked = await park(harness, delivery())
    harness.then(eop.Reject("never"))
    assert await harness.processor.retry_parked(parked) is Outcome.DEAD_LETTERED
    [dead] = harness.store.dead_letters
    assert dead.reason == models.REASON_REJECTED
    assert harness.store.attempts == {}


async def test_parked_run_over_the_crash_loop_bound_is_dead_lettered_without_running(
    harness: Harness,
) -> None:
    parked = await park(harness, delivery())
    looping = ParkedDelivery(parked.message, failures=1, runs=1 + FAST.max_deliveries + 1)
    calls = len(harness.calls)
    assert await harness.processor.retry_parked(looping) is Outcome.DEAD_LETTERED
    assert len(harness.calls) == calls
    assert harness.store.dead_letters[0].reason == models.REASON_CRASH_LOOP


async def test_redelivery_of_a_parked_message_is_acked_without_running(harness: Harness) -> None:
    """Its ack was lost after the parking committed: the retrying row is its claim."""
    d = delivery()
    await park(harness, d)
    again = d.redeliver()
    assert await harness.handle(again) is Outcome.DUPLICATE
    assert len(harness.calls) == 1
    assert again.acked


async def test_parked_run_of_a_settled_message_leaves_it(harness: Harness) -> None:
    parked = await park(harness, delivery())
    assert await harness.processor.retry_parked(parked) is Outcome.PROCESSED
    assert await harness.processor.retry_parked(parked) is Outcome.LEFT
    assert len(harness.store.effects) == 1


# ------------------------------------------------------------ reported bugs


async def test_handler_os_error_on_last_attempt_is_dead_lettered_with_its_traceback(
    harness: Harness, fast_sleep: None
) -> None:
    harness.then(FileNotFoundError("/data/rates.csv"))
    d = delivery(num_delivered=FAST.max_attempts)
    harness.failed_before(d, FAST.max_attempts - 1)
    assert await harness.handle(d) is Outcome.DEAD_LETTERED
    assert len(harness.calls) == 1
    assert "FileNotFoundError" in harness.store.dead_letters[0].error


async def test_permanent_error_at_commit_on_last_attempt_is_dead_lettered(
    harness: Harness,
) -> None:
    harness.store.fail_commits(1, UniqueViolation("duplicate key value violates orders_pkey"))
    # A first delivery (a redelivery's run is counted in a COMMIT of its own first).
    d = delivery(num_delivered=1)
    harness.failed_before(d, FAST.max_attempts - 1)
    assert await harness.handle(d) is Outcome.DEAD_LETTERED
    assert "orders_pkey" in harness.store.dead_letters[0].error


async def test_ambiguous_commit_of_a_quarantine_is_resolved_not_raised(harness: Harness) -> None:
    await harness.handle(delivery(b"first"))
    harness.store.ambiguous_commit(committed=True)
    other = delivery(b"second")
    await harness.handle(other)
    assert other.is_acked
    assert len(harness.store.dead_letters) == 1
