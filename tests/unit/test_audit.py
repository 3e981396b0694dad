"""The audit's classification rules, one case at a time (no servers)."""

from __future__ import annotations

import datetime
import json

from eop.ops import audit
from eop.ops.audit import Position, Recorded, Verdict, Walked
from eop.pg import models
from eop.pg.floors import Observed

FP, OTHER = b"fp-now", b"fp-before"
POS = Position(watermark=10, ack_floor=20, delivered=30)
NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.timezone.utc)


def msg(seq: int, fp: bytes | None = FP, msg_id: str | None = None) -> Walked:
    """A walked message at ``seq``."""
    return Walked(seq=seq, subject="ORDERS.created", msg_id=msg_id, fingerprint=fp)


def row(seq: int, fp: bytes = FP, outcome: str = models.OUTCOME_PROCESSED) -> Recorded:
    """An inbox row at ``seq``."""
    return Recorded(seq, fp, outcome)


def dead(seq: int, fp: bytes = FP, reason: str = "rejected", error: str = "Reject: x") -> Recorded:
    """A dead letter at ``seq``."""
    return Recorded(seq, fp, "dead_letter", f"#7 ({reason})", reason, error)


def test_matching_row_is_an_outcome_anywhere() -> None:
    """A row with the message's fingerprint is its outcome, above or below the watermark."""
    assert audit.classify(msg(15), row(15), [], None, POS)[0] is Verdict.OUTCOME
    assert audit.classify(msg(5), row(5), [], None, POS)[0] is Verdict.OUTCOME


def test_dead_lettered_row_or_dead_letter_alone_is_a_dead_letter() -> None:
    """Outcome 'dead_lettered', or a dead letter with the fingerprint and no row."""
    dl_row = row(15, outcome=models.OUTCOME_DEAD_LETTERED)
    assert audit.classify(msg(15), dl_row, [dead(15)], None, POS)[0] is Verdict.DEAD_LETTER
    assert audit.classify(msg(15), None, [dead(15)], None, POS)[0] is Verdict.DEAD_LETTER


def test_no_row_below_the_watermark_is_compacted() -> None:
    """At or below the watermark a missing row proves nothing: compacted."""
    assert audit.classify(msg(10, fp=None), None, [], None, POS)[0] is Verdict.COMPACTED


def test_no_row_between_watermark_and_ack_floor_is_acked_without_outcome() -> None:
    """Above the watermark and at or below the ack floor, a missing outcome is an anomaly."""
    verdict, detail = audit.classify(msg(11, fp=None), None, [], None, POS)
    assert verdict is Verdict.ACKED_WITHOUT_OUTCOME
    assert "ack floor 20" in detail


def test_msg_id_row_elsewhere_makes_a_duplicate_not_an_anomaly() -> None:
    """A republish skipped by the msg-id guard has its outcome at the first copy."""
    verdict, detail = audit.classify(msg(15, fp=None, msg_id="a"), None, [], "seq 3", POS)
    assert verdict is Verdict.DUPLICATE
    assert "seq 3" in detail


def test_no_row_above_the_ack_floor_is_delivered_or_never_delivered() -> None:
    """Above the ack floor: in flight up to the delivered sequence, never delivered above it."""
    assert audit.classify(msg(21, fp=None), None, [], None, POS)[0] is Verdict.DELIVERED
    assert audit.classify(msg(30, fp=None), None, [], None, POS)[0] is Verdict.DELIVERED
    assert audit.classify(msg(31, fp=None), None, [], None, POS)[0] is Verdict.NEVER_DELIVERED


def test_row_with_an_outcome_that_is_not_final_is_held_by_its_value() -> None:
    """An inbox outcome other than processed or dead_lettered (e.g. retrying) is in flight."""
    held = row(5, outcome="retrying")
    assert audit.classify(msg(5), held, [], None, POS) == (Verdict.HELD, "retrying")


def test_dead_letter_reasons_that_are_rules_and_those_that_are_not() -> None:
    """eop's four reasons are rules; any other reason, or spent deliveries, is not."""
    for reason in sorted(audit.RULE_REASONS):
        assert audit.dead_letter_reason([dead(5, reason=reason)]) == (reason, "")
    reason, why = audit.dead_letter_reason([dead(5, reason="crash_loop")])
    assert reason == "crash_loop"
    assert "'crash_loop' is not one of eop's rules" in why
    spent = dead(5, reason="attempts_exhausted", error="delivered 6 times without an outcome (…)")
    reason, why = audit.dead_letter_reason([spent])
    assert reason == "attempts_exhausted (delivered without an outcome)"
    assert "delivered 6 times without an outcome" in why
    assert audit.dead_letter_reason([]) == (None, "")


def test_row_of_another_fingerprint_is_a_reused_sequence() -> None:
    """Same epoch, same sequence, another message: reused, quarantined or not."""
    verdict, detail = audit.classify(msg(15), row(15, OTHER), [], None, POS)
    assert verdict is Verdict.REUSED_SEQUENCE
    assert "no outcome although the consumer acked it" in detail
    verdict, detail = audit.classify(msg(15), row(15, OTHER), [dead(15)], None, POS)
    assert verdict is Verdict.REUSED_SEQUENCE
    assert "quarantined as dead letter #7" in detail
    verdict, _ = audit.classify(msg(15), row(15), [dead(15, OTHER)], None, POS)
    assert verdict is Verdict.REUSED_SEQUENCE


STREAM = audit.Stream(
    name="ORDERS", epoch="e2", first_seq=5, last_seq=50, now=NOW, interior_removal=False
)


def test_unseen_rows_by_where_they_lie() -> None:
    """Removed below the first sequence; gone beyond the last or deleted; reused if replaced."""
    assert audit.classify_unseen(row(3), None, STREAM, 50) == (None, "removed")
    assert audit.classify_unseen(row(60), None, STREAM, 50)[0] == audit.OUTCOME_MESSAGE_GONE
    assert audit.classify_unseen(row(20), None, STREAM, 50)[0] == audit.OUTCOME_MESSAGE_GONE
    assert audit.classify_unseen(row(20), msg(20), STREAM, 50) == (None, "outside_filter")
    assert audit.classify_unseen(row(20, OTHER), msg(20), STREAM, 50)[0] == audit.REUSED_SEQUENCE
    assert audit.classify_unseen(row(45), None, STREAM, 40) == (None, "newer")


def test_interior_removal_by_retention_is_not_an_anomaly() -> None:
    """Interest, work-queue or per-subject retention removes messages from the middle."""
    interest = audit.Stream(**{**STREAM.__dict__, "interior_removal": True})
    assert audit.classify_unseen(row(20), None, interest, 50) == (None, "removed")


def test_old_epoch_rows_are_reused_or_gone() -> None:
    """Outcomes of a deleted stream: reused where the new one holds the sequence, else gone."""
    gone = audit.classify_old_epoch(row(3), "e1", None, "e2")
    assert gone.kind == audit.OUTCOME_MESSAGE_GONE
    same = audit.classify_old_epoch(row(3), "e1", msg(3), "e2")
    assert same.kind == audit.REUSED_SEQUENCE
    assert "same message again" in same.detail
    other = audit.classify_old_epoch(row(3, OTHER), "e1", msg(3), "e2")
    assert "another message" in other.detail


def consumer(**changes: object) -> audit.Consumer:
    """A consumer at ack floor 20 with 100 delivered."""
    base = audit.Consumer(
        exists=True, filters=("ORDERS.created",), ack_floor=20, delivered=100, ack_wait_s=30.0
    )
    return audit.Consumer(**{**base.__dict__, **changes})


def test_counting_proves_acks_without_outcome_above_the_floor() -> None:
    """More delivered messages without an outcome than the consumer holds unacked."""
    assert audit.unacked_without_outcome(3, [21, 22, 23], consumer(ack_pending=3)) is None
    found = audit.unacked_without_outcome(5, [21, 22], consumer(ack_pending=3))
    assert found is not None
    assert "at least 2" in found.detail


def observed(floor: int = 20, waited_s: float | None = 200.0, delivered: int = 100) -> Observed:
    """The consumer as a worker recorded it: a wait above ``floor`` for ``waited_s``."""
    return Observed(
        consumer="eop-orders",
        partition=None,
        consumer_created=None,
        floor=floor,
        delivered=delivered,
        waiting_since=None if waited_s is None else NOW - datetime.timedelta(seconds=waited_s),
        waited_s=waited_s,
        observed_at=NOW,
    )


def test_stuck_delivery_needs_a_recorded_wait_at_the_same_floor() -> None:
    """Stuck: the floor is where a recorded wait began, longer ago than the bound."""
    first = Walked(seq=21, subject="s", msg_id=None, stored_at=NOW)
    c = consumer(ack_pending=1, redelivered=1)
    (found,) = audit.stuck(first, c, observed(), 90.0)
    assert (found.kind, found.seq) == (audit.STUCK_DELIVERY, 21)
    assert "at least 200 s" in found.detail
    assert audit.stuck(first, c, observed(), 300.0) == []
    assert audit.stuck(first, consumer(ack_pending=0), observed(), 90.0) == []
    # The floor moved since the wait was recorded: nothing is known to have waited.
    assert audit.stuck(first, c, observed(floor=19), 90.0) == []
    assert audit.stuck(first, c, observed(waited_s=None), 90.0) == []
    assert audit.stuck(first, c, None, 90.0) == []
    # The message above the floor lies beyond what was delivered when the wait began.
    assert audit.stuck(first, c, observed(delivered=20), 90.0) == []


def test_stuck_delivery_ignores_the_floors_last_active_time() -> None:
    """The server moves ``ack_floor.last_active`` at every ack, the floor's or not: a
    message held behind others being acked is stuck however recent that time is."""
    first = Walked(seq=21, subject="s", msg_id=None, stored_at=NOW)
    acking = consumer(ack_pending=1, ack_floor_at=NOW - datetime.timedelta(seconds=1))
    (found,) = audit.stuck(first, acking, observed(), 90.0)
    assert found.seq == 21


def test_full_ack_pending_window_is_stuck() -> None:
    """A full MaxAckPending window stalls fetches silently."""
    full = consumer(ack_pending=1000, max_ack_pending=1000)
    (found,) = audit.stuck(None, full, None, 90.0)
    assert "window full" in found.detail


def test_fingerprint_matches_the_message_fingerprint() -> None:
    """The audit hashes exactly as the inbox does (subject, msg-id, payload)."""
    from eop.message import Message

    m = Message("h", "ORDERS.created", b"x", {"Nats-Msg-Id": "1"}, "ORDERS", "e", 3, 1)
    assert audit.fingerprint("ORDERS.created", {"Nats-Msg-Id": "1"}, b"x") == m.fingerprint


def test_tally_counts_all_and_samples_a_few() -> None:
    """A class counts every message and keeps the first SAMPLED_PER_CLASS sequences."""
    t = audit.Tally()
    for seq in range(1, audit.SAMPLED_PER_CLASS + 4):
        t.add(seq)
    assert t.count == audit.SAMPLED_PER_CLASS + 3
    assert t.sample == list(range(1, audit.SAMPLED_PER_CLASS + 1))


def test_summary_never_says_clean_while_messages_are_unsettled() -> None:
    """In flight and never delivered are named in the summary; clean only once settled."""
    h = audit.HandlerAudit(handler="billing", stream="ORDERS", durable="eop-billing")
    report = audit.Report([h])
    assert report.summary() == "clean: every message checked has exactly one outcome"
    h.compacted = 4
    assert "except 4 compacted below the watermark: acked" in report.summary()
    for seq in (21, 22):
        h.tally(h.in_flight, audit.DELIVERED_NO_OUTCOME, seq)
    h.tally(h.in_flight, "retrying", 5)
    h.never_delivered.add(40)
    assert report.clean
    assert not report.settled
    assert report.summary().startswith("clean so far: 3 in flight, 1 never delivered")
    text = audit.render(report)
    assert "in flight         2 delivered_no_outcome (seq 21, 22); 1 retrying (seq 5)" in text
    assert "never delivered   1 (seq 40)" in text
    h.add(audit.Anomaly(audit.DEAD_LETTER_NOT_BY_RULE, 7, "e", "x"))
    assert report.summary() == "1 anomaly; also 3 in flight, 1 never delivered"
    data = json.loads(report.as_json())
    assert (data["clean"], data["settled"]) == (False, False)
    assert data["handlers"][0]["in_flight"]["retrying"] == {"count": 1, "sample": [5]}
    assert data["handlers"][0]["never_delivered"] == {"count": 1, "sample": [40]}


def test_report_counts_lists_and_renders() -> None:
    """Anomalies are counted by kind; the text and JSON say clean or not."""
    h = audit.HandlerAudit(handler="billing", stream="ORDERS", durable="eop-billing")
    report = audit.Report([h])
    assert report.clean
    assert "result: clean: every message checked has exactly one outcome" in audit.render(report)
    for seq in range(audit.LISTED_PER_KIND + 5):
        h.add(audit.Anomaly(audit.REUSED_SEQUENCE, seq, "e", "x"))
    assert not report.clean
    assert len(h.anomalies) == audit.LISTED_PER_KIND
    text = audit.render(report)
    assert "and 5 more" in text
    assert f"result: {audit.LISTED_PER_KIND + 5} anomalies" in text
    data = json.loads(report.as_json())
    assert data["clean"] is False
    assert data["handlers"][0]["counts"][audit.REUSED_SEQUENCE] == audit.LISTED_PER_KIND + 5


def test_a_partitioned_handlers_never_delivered_is_judged_by_its_own_partition() -> None:
    """An ordered handler's never-delivered messages are read against their partition's
    consumer, not against the highest delivered sequence of all partitions."""
    h = audit.HandlerAudit(handler="ledger", stream="LEDGER", durable="eop-ledger")
    h.partitions = [
        audit.PartitionConsumer(0, "eop-ledger-p0-e1", ack_floor=900, delivered=900),
        audit.PartitionConsumer(1, "eop-ledger-p1-e1", ack_floor=400, delivered=450),
    ]
    h.ack_floor, h.delivered = 400, 900
    h.never_delivered.add(500)
    text = audit.render(audit.Report([h]))
    assert "never delivered   1 (seq 500), each above its partition's delivered sequence" in text
    assert "above the consumer's delivered sequence 900" not in text
    assert "all partitions    lowest ack floor 400, highest delivered 900" in text
    assert "partition 1       eop-ledger-p1-e1: ack floor 400, delivered 450" in text
