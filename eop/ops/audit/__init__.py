"""``eop audit``: check on your own data that every message has exactly one outcome.

The audit walks a handler consumer's range of the stream (the consumer's
subject filters, skipping deleted messages) with a throwaway ordered
consumer, headers only when few inbox rows need a fingerprint, and reads
the inbox and the dead letters by sequence ranges beside it. An ordered
handler has a consumer per partition instead: the walk takes all their
filters and judges each message by its own partition's consumer.

Each message checked falls into one class, counted per handler with a few
sample sequences: processed; dead-lettered by one of eop's rules
(:data:`RULE_REASONS`); dead-lettered for another reason (an anomaly,
``dead_letter_not_by_rule``); dead-lettered with its dead letter purged; a
duplicate of an earlier msg-id; compacted below the watermark; in flight
(delivered above the ack floor without an outcome yet, or an inbox outcome that
is not final, by its value); never delivered (above the consumer's delivered
sequence); or an anomaly. In flight and never delivered are not anomalies, but
a report with any of them is not settled, and says so. The anomalies:

- ``dead_letter_not_by_rule``: a dead letter whose reason is not one of eop's
  rules, or whose error says its attempts were spent by deliveries that ended
  without an outcome: a good message may have taken effect zero times.

- ``acked_without_outcome``: the consumer's ack floor passed a message (or,
  above the floor, more messages lack an outcome than the consumer holds
  unacknowledged), yet the message has no inbox row, no dead letter and no
  msg-id row, and lies above the inbox watermark.
- ``outcome_message_gone``: an inbox row or dead letter whose message the
  stream no longer holds (deleted from its middle, beyond its last sequence,
  or of an epoch whose stream was deleted).
- ``reused_sequence``: an outcome recorded at a sequence that now holds
  another message (another fingerprint in the same epoch, or a new epoch).
- ``stuck_delivery``: a delivered message left unacknowledged for longer
  than ``stuck_after_ack_waits`` AckWaits, timed from the workers' record of
  when the consumer's ack floor stopped below it (:mod:`eop.pg.floors`), or a
  full ack-pending window.

What the watermark hides: eop deletes inbox rows at or below the watermark,
which only ever rises to the consumer's ack floor (or below the stream's first
sequence), and eop acks a message only after its outcome committed. Below the
watermark the audit can therefore only show that the consumer acked (or
termed) every message, that no retained row or dead letter belongs to another
message, and, through msg-id rows kept for ``msg_id_retention_s``, the
outcomes of recent messages that carry a ``Nats-Msg-Id``; it cannot show a
compacted message's outcome individually.

The package, by what each module is about:

- :mod:`eop.ops.audit.walk`: the stream side: the stream's and the consumer's
  state, the walk over the consumer's messages, messages fetched by sequence;
- :mod:`eop.ops.audit.outcomes`: the database side: inbox rows, dead letters,
  msg-id rows and the watermark, read by sequence range;
- :mod:`eop.ops.audit.rules`: the classification rules, pure functions that
  turn what both sides hold into verdicts and anomalies;
- :mod:`eop.ops.audit.report`: the findings per handler, as text and as JSON;
- :mod:`eop.ops.audit.auditor`: :func:`run`, which audits each handler with the
  modules above.
"""

from __future__ import annotations

from eop.ops.audit.auditor import Options, run
from eop.ops.audit.outcomes import Recorded
from eop.ops.audit.report import (
    LISTED_PER_KIND,
    SAMPLED_PER_CLASS,
    HandlerAudit,
    PartitionConsumer,
    Report,
    Tally,
    render,
)
from eop.ops.audit.rules import (
    ACKED_WITHOUT_OUTCOME,
    DEAD_LETTER_NOT_BY_RULE,
    DELIVERED_NO_OUTCOME,
    KINDS,
    OUTCOME_MESSAGE_GONE,
    REUSED_SEQUENCE,
    RULE_REASONS,
    STUCK_DELIVERY,
    Anomaly,
    Position,
    Verdict,
    classify,
    classify_old_epoch,
    classify_unseen,
    dead_letter_reason,
    stuck,
    unacked_without_outcome,
)
from eop.ops.audit.walk import Consumer, Stream, Walked, fingerprint

__all__ = [
    # running it
    "Options",
    "run",
    # the report
    "HandlerAudit",
    "LISTED_PER_KIND",
    "PartitionConsumer",
    "Report",
    "SAMPLED_PER_CLASS",
    "Tally",
    "render",
    # the classes and the anomaly kinds
    "ACKED_WITHOUT_OUTCOME",
    "DEAD_LETTER_NOT_BY_RULE",
    "DELIVERED_NO_OUTCOME",
    "KINDS",
    "OUTCOME_MESSAGE_GONE",
    "REUSED_SEQUENCE",
    "RULE_REASONS",
    "STUCK_DELIVERY",
    # the classification rules and what they read
    "Anomaly",
    "Consumer",
    "Position",
    "Recorded",
    "Stream",
    "Verdict",
    "Walked",
    "classify",
    "classify_old_epoch",
    "classify_unseen",
    "dead_letter_reason",
    "fingerprint",
    "stuck",
    "unacked_without_outcome",
]
