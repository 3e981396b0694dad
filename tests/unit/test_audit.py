"""The audit's classification rules, one case at a time (no servers)."""

from __future__ import annotations

import datetime
import json

from eop import audit, models
from eop.audit import Position, Recorded, Verdict, Walked

FP, OTHER = b"fp-now", b"fp-before"
POS = Position(watermark=10, ack_floor=20)
NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.timezone.utc)


def msg(seq: int, fp: bytes | None = FP, msg_id: str | None = None) -> Walked:
    """A walked message at ``seq``."""
    return Walked(seq=seq, subject="ORDERS.created", msg_id=msg_id, fingerprint=fp)


def row(seq: int, fp: bytes = FP, outcome: str = models.OUTCOME_PROCESSED) -> Recorded:
    """An inbox row at ``seq``."""
    return Recorded(seq, fp, outcome)


def dead(seq: int, fp: bytes = FP) -> Recorded:
    """A dead letter at ``seq``."""
    return Recorded(seq, fp, "dead_letter", "#7 (rejected)")


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


def test_no_row_above_the_ack_floor_is_unsettled() -> None:
    """Above the ack floor a message may be in flight: not an anomaly by itself."""
    assert audit.classify(msg(21, fp=None), None, [], None, POS)[0] is Verdict.UNSETTLED


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


def test_stuck_delivery_needs_age_and_a_pending_delivery() -> None:
    """Unacked longer than the threshold since the floor last moved and since it was stored."""
    old = NOW - datetime.timedelta(seconds=200)
    first = Walked(seq=21, subject="s", msg_id=None, stored_at=old)
    c = consumer(ack_pending=1, redelivered=1, ack_floor_at=old)
    (found,) = audit.stuck(first, c, NOW, 90.0)
    assert (found.kind, found.seq) == (audit.STUCK_DELIVERY, 21)
    assert audit.stuck(first, c, NOW, 300.0) == []
    assert audit.stuck(first, consumer(ack_pending=0, ack_floor_at=old), NOW, 90.0) == []
    recent = consumer(ack_pending=1, ack_floor_at=NOW - datetime.timedelta(seconds=5))
    assert audit.stuck(first, recent, NOW, 90.0) == []


def test_full_ack_pending_window_is_stuck() -> None:
    """A full MaxAckPending window stalls fetches silently."""
    (found,) = audit.stuck(None, consumer(ack_pending=1000, max_ack_pending=1000), NOW, 90.0)
    assert "window full" in found.detail


def test_fingerprint_matches_the_message_fingerprint() -> None:
    """The audit hashes exactly as the inbox does (subject, msg-id, payload)."""
    from eop.message import Message

    m = Message("h", "ORDERS.created", b"x", {"Nats-Msg-Id": "1"}, "ORDERS", "e", 3, 1)
    assert audit.fingerprint("ORDERS.created", {"Nats-Msg-Id": "1"}, b"x") == m.fingerprint


def test_report_counts_lists_and_renders() -> None:
    """Anomalies are counted by kind; the text and JSON say clean or not."""
    h = audit.HandlerAudit(handler="billing", stream="ORDERS", durable="eop-billing")
    report = audit.Report([h])
    assert report.clean
    assert "result: clean" in audit.render(report)
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
