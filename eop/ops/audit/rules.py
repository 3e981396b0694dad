"""The audit's classification rules: pure functions, one message or row at a time.

They turn what the walk saw (:mod:`eop.ops.audit.walk`) and what the database
holds (:mod:`eop.ops.audit.outcomes`) into verdicts and anomalies; no I/O here,
so each rule is tested on its own.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import re
from collections.abc import Sequence

from eop.ops.audit.outcomes import Recorded
from eop.ops.audit.walk import Consumer, Stream, Walked
from eop.pg import floors, models

ACKED_WITHOUT_OUTCOME = "acked_without_outcome"
OUTCOME_MESSAGE_GONE = "outcome_message_gone"
REUSED_SEQUENCE = "reused_sequence"
STUCK_DELIVERY = "stuck_delivery"
DEAD_LETTER_NOT_BY_RULE = "dead_letter_not_by_rule"
KINDS = (
    ACKED_WITHOUT_OUTCOME,
    DEAD_LETTER_NOT_BY_RULE,
    OUTCOME_MESSAGE_GONE,
    REUSED_SEQUENCE,
    STUCK_DELIVERY,
)

#: The dead-letter reasons that are eop's rules (see :data:`eop.pg.models.RULE_REASONS`):
#: any other reason means something else (infrastructure, a crash loop) took it out.
RULE_REASONS = models.RULE_REASONS

#: How a dead letter reads whose attempts were spent by deliveries that ended
#: without any outcome (workers killed or timed out in them), not by its handler
#: failing: its reason is ``attempts_exhausted`` but no rule earned it.
_WITHOUT_AN_OUTCOME = re.compile(r"delivered \d+ times without an outcome")

#: The in-flight class of a delivered message with no outcome yet (the others
#: are named by their inbox outcome, e.g. ``retrying``).
DELIVERED_NO_OUTCOME = "delivered_no_outcome"


class Verdict(enum.Enum):
    """What the audit concludes about one message of the stream."""

    OUTCOME = "outcome"
    DEAD_LETTER = "dead_letter"
    DUPLICATE = "duplicate_by_msg_id"
    COMPACTED = "compacted"
    DELIVERED = "delivered"
    """Delivered above the ack floor without an outcome yet: in flight."""
    HELD = "held"
    """An inbox row whose outcome is not final (e.g. ``retrying``): in flight."""
    NEVER_DELIVERED = "never_delivered"
    ACKED_WITHOUT_OUTCOME = ACKED_WITHOUT_OUTCOME
    REUSED_SEQUENCE = REUSED_SEQUENCE


@dataclasses.dataclass(frozen=True)
class Position:
    """Where the consumer and the inbox stood when the rows were read."""

    watermark: int
    ack_floor: int
    delivered: int
    """The consumer's delivered stream sequence: above it nothing was delivered yet."""


@dataclasses.dataclass(frozen=True)
class Anomaly:
    """One finding that contradicts exactly-once."""

    kind: str
    seq: int | None
    epoch: str | None
    detail: str


def classify(
    msg: Walked,
    row: Recorded | None,
    dead: Sequence[Recorded],
    by_msg_id: str | None,
    pos: Position,
) -> tuple[Verdict, str]:
    """The verdict on one walked message of the current epoch, and why.

    ``row`` is its inbox row, ``dead`` the dead letters at its sequence,
    ``by_msg_id`` where another row holds its ``Nats-Msg-Id``. A message with
    a row or a dead letter must carry its fingerprint.
    """
    fp = msg.fingerprint
    foreign = [d for d in dead if d.fingerprint != fp]
    if (row is not None and row.fingerprint != fp) or foreign:
        return Verdict.REUSED_SEQUENCE, _reused_detail(msg, row, dead, pos)
    if row is not None:
        if row.outcome == models.OUTCOME_PROCESSED:
            return Verdict.OUTCOME, ""
        if row.outcome == models.OUTCOME_DEAD_LETTERED:
            return Verdict.DEAD_LETTER, ""
        return Verdict.HELD, row.outcome
    if dead:
        return Verdict.DEAD_LETTER, ""
    if by_msg_id is not None:
        return Verdict.DUPLICATE, f"msg-id {msg.msg_id!r} has its outcome at {by_msg_id}"
    if msg.seq <= pos.watermark:
        return Verdict.COMPACTED, ""
    if msg.seq <= pos.ack_floor:
        return Verdict.ACKED_WITHOUT_OUTCOME, (
            f"at or below the ack floor {pos.ack_floor} and above the watermark "
            f"{pos.watermark}, but no inbox row, dead letter or msg-id row"
        )
    if msg.seq <= pos.delivered:
        return Verdict.DELIVERED, ""
    return Verdict.NEVER_DELIVERED, ""


def dead_letter_reason(dead: Sequence[Recorded]) -> tuple[str | None, str]:
    """Why a message was dead-lettered: its reason, and why that is no rule ("" when it is).

    ``dead`` are the message's own dead letters (its fingerprint). None as the
    reason when there is none: the inbox row says dead-lettered but the dead
    letter was purged, so its reason is no longer known.
    """
    if not dead:
        return None, ""
    d = dead[0]
    if d.reason not in RULE_REASONS:
        return d.reason, f"dead letter {d.ref}: {d.reason!r} is not one of eop's rules"
    spent = _WITHOUT_AN_OUTCOME.search(d.error)
    if spent is not None:
        return f"{d.reason} (delivered without an outcome)", (
            f"dead letter {d.ref}: {spent.group(0)}, so its attempts were spent by "
            "deliveries that ended without an outcome, not by its handler failing"
        )
    return d.reason, ""


def _reused_detail(
    msg: Walked, row: Recorded | None, dead: Sequence[Recorded], pos: Position
) -> str:
    own = [d for d in dead if d.fingerprint == msg.fingerprint]
    recorded = "an inbox row" if row is not None and row.fingerprint != msg.fingerprint else ""
    if not recorded:
        recorded = "a dead letter " + ", ".join(
            d.ref for d in dead if d.fingerprint != msg.fingerprint
        )
    text = f"{recorded} of another message (another fingerprint) is recorded at this sequence"
    if own:
        return f"{text}; the message now there was quarantined as dead letter {own[0].ref}"
    if row is not None and row.fingerprint == msg.fingerprint:
        return f"{text}; the message now there has its own inbox row"
    acked = " although the consumer acked it" if msg.seq <= pos.ack_floor else ""
    return f"{text}; the message now there has no outcome{acked}"


def classify_unseen(
    row: Recorded, occupant: Walked | None, stream: Stream, audit_to: int
) -> tuple[str | None, str]:
    """An outcome of the current epoch at a sequence the walk did not deliver.

    ``occupant`` is the message the stream holds there now (fetched by
    sequence, with its fingerprint), None when it holds none. Returns an
    anomaly kind (or None) and a label: ``removed``, ``outside_filter``,
    ``newer`` or the anomaly's detail.
    """
    if row.seq < stream.first_seq:
        return None, "removed"
    if row.seq > stream.last_seq:
        return OUTCOME_MESSAGE_GONE, (
            f"beyond the stream's last sequence {stream.last_seq}: the stream lost its tail"
        )
    if row.seq > audit_to:
        return None, "newer"
    if occupant is None:
        if stream.interior_removal:
            return None, "removed"
        return OUTCOME_MESSAGE_GONE, "the message was deleted from the stream"
    if occupant.fingerprint == row.fingerprint:
        return None, "outside_filter"
    return REUSED_SEQUENCE, (
        "the stream now holds another message (another fingerprint) at this sequence"
    )


def classify_old_epoch(row: Recorded, epoch: str, occupant: Walked | None, current: str) -> Anomaly:
    """An outcome recorded for an earlier incarnation (epoch) of the stream."""
    if occupant is None:
        detail = f"epoch {epoch} of the stream is gone (the stream was recreated as {current})"
        return Anomaly(OUTCOME_MESSAGE_GONE, row.seq, epoch, detail)
    same = occupant.fingerprint == row.fingerprint
    detail = f"the recreated stream (epoch {current}) holds " + (
        "the same message again (same fingerprint): it may take effect once per epoch"
        if same
        else "another message at this sequence"
    )
    return Anomaly(REUSED_SEQUENCE, row.seq, epoch, detail)


def unacked_without_outcome(
    open_count: int, sample: Sequence[int], consumer: Consumer
) -> Anomaly | None:
    """Above the ack floor: more messages lack an outcome than the consumer holds unacked.

    ``open_count`` delivered messages above the floor have no outcome
    (``sample``: some of their sequences). The consumer was read before the
    inbox: every delivered message it did not hold unacknowledged then was
    acked, so its outcome had committed. Which ones cannot be told apart.
    """
    excess = open_count - consumer.ack_pending
    if excess <= 0:
        return None
    listed = ", ".join(str(s) for s in sample)
    return Anomaly(
        ACKED_WITHOUT_OUTCOME,
        None,
        None,
        f"{open_count} delivered messages above the ack floor {consumer.ack_floor} "
        f"have no outcome, but the consumer holds only {consumer.ack_pending} unacknowledged: "
        f"at least {excess} were acked without an outcome (among {listed})",
    )


def stuck(
    first_open: Walked | None,
    consumer: Consumer,
    observed: floors.Observed | None,
    after_s: float,
) -> list[Anomaly]:
    """Deliveries that are not moving: the oldest unacked message, a full window.

    ``observed`` is the consumer as the workers last recorded it (read before
    ``consumer``): while the ack floor stays where a recorded wait began, the
    message just above it has waited unacknowledged since then
    (:func:`eop.pg.floors.waited_s`). Not the floor's ``last_active``: the server
    moves it at every ack, so a message held behind others being acked would
    never look old.
    """
    found = []
    if consumer.max_ack_pending > 0 and consumer.ack_pending >= consumer.max_ack_pending:
        found.append(
            Anomaly(
                STUCK_DELIVERY,
                None,
                None,
                f"ack-pending window full ({consumer.ack_pending}/{consumer.max_ack_pending}): "
                "fetches stall until a delivery is acked",
            )
        )
    if first_open is None or first_open.seq > consumer.delivered or consumer.ack_pending == 0:
        return found
    waited_s = floors.waited_s(observed, consumer.ack_floor, consumer.created_at)
    if waited_s is None or observed is None or first_open.seq > observed.delivered:
        # No recorded wait, or the message above the floor is not the one it began with.
        return found
    if waited_s > after_s:
        found.append(
            Anomaly(
                STUCK_DELIVERY,
                first_open.seq,
                None,
                f"delivered but unacknowledged for at least {waited_s:.0f} s (> {after_s:g} s, "
                f"AckWait {consumer.ack_wait_s:g} s): the ack floor {consumer.ack_floor} has "
                f"not moved since {_utc(observed.waiting_since)}; the consumer holds "
                f"{consumer.ack_pending} unacknowledged, {consumer.redelivered} of them "
                "redelivered",
            )
        )
    return found


def _utc(at: datetime.datetime | None) -> str:
    if at is None:
        return "?"
    return at.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
