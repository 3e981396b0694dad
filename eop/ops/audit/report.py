"""The audit's report: what was walked and found per handler, as text and as JSON."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

from eop.ops import tables
from eop.ops.audit.rules import KINDS, Anomaly

#: Anomalies listed per kind and handler (all are counted).
LISTED_PER_KIND = 100

#: Sequences kept as a sample of each class of messages (all are counted).
SAMPLED_PER_CLASS = 10


@dataclasses.dataclass
class Tally:
    """How many messages fell into one class, and the first few sequences of them."""

    count: int = 0
    sample: list[int] = dataclasses.field(default_factory=list)

    def add(self, seq: int) -> None:
        """Count ``seq``; keep it while the sample has fewer than :data:`SAMPLED_PER_CLASS`."""
        self.count += 1
        if len(self.sample) < SAMPLED_PER_CLASS:
            self.sample.append(seq)


@dataclasses.dataclass
class PartitionConsumer:
    """The consumer of one partition of an ordered handler, as the audit read it."""

    partition: int
    consumer: str | None
    """None when the partition was never owned."""
    ack_floor: int = 0
    delivered: int = 0
    pending: int = 0
    ack_pending: int = 0
    redelivered: int = 0


@dataclasses.dataclass
class HandlerAudit:
    """The audit of one handler: what was walked, what was found."""

    handler: str
    stream: str
    durable: str
    epoch: str = ""
    filters: list[str] = dataclasses.field(default_factory=list)
    stream_first_seq: int = 0
    stream_last_seq: int = 0
    range_from: int = 0
    range_to: int = 0
    truncated: bool = False
    next_seq: int | None = None
    watermark: int = 0
    ack_floor: int = 0
    delivered: int = 0
    ack_pending: int = 0
    redelivered: int = 0
    consumer_pending: int = 0
    partitions: list[PartitionConsumer] = dataclasses.field(default_factory=list)
    """An ordered handler's consumers, one per partition (the consumer figures above are
    theirs combined: the lowest ack floor, the highest delivered, the counts summed)."""
    checked: int = 0
    processed: Tally = dataclasses.field(default_factory=Tally)
    dead_lettered_by_rule: dict[str, Tally] = dataclasses.field(default_factory=dict)
    """By reason: the dead letters eop's rules explain (rejected, attempts exhausted, ...)."""
    dead_lettered_other: dict[str, Tally] = dataclasses.field(default_factory=dict)
    """By reason: dead letters no rule explains; each is also a ``dead_letter_not_by_rule``."""
    dead_lettered_purged: Tally = dataclasses.field(default_factory=Tally)
    """Inbox rows that say dead-lettered whose dead letter was purged (reason unknown)."""
    in_flight: dict[str, Tally] = dataclasses.field(default_factory=dict)
    """By state: delivered without an outcome yet, or an inbox outcome that is not final."""
    never_delivered: Tally = dataclasses.field(default_factory=Tally)
    duplicates: int = 0
    compacted: int = 0
    verified_below_watermark: int = 0
    removed_with_outcome: int = 0
    outside_filter: int = 0
    counts: Counter[str] = dataclasses.field(default_factory=Counter)
    anomalies: list[Anomaly] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def add(self, anomaly: Anomaly) -> None:
        """Count an anomaly; list it while its kind has fewer than :data:`LISTED_PER_KIND`."""
        self.counts[anomaly.kind] += 1
        if self.counts[anomaly.kind] <= LISTED_PER_KIND:
            self.anomalies.append(anomaly)

    @staticmethod
    def tally(tallies: dict[str, Tally], key: str, seq: int) -> None:
        """Count ``seq`` under ``key`` of one class of tallies."""
        tallies.setdefault(key, Tally()).add(seq)

    @property
    def clean(self) -> bool:
        """True when nothing contradicts exactly-once (messages may still be unsettled)."""
        return not self.counts

    @property
    def in_flight_count(self) -> int:
        """Messages delivered or held without a final outcome yet."""
        return sum(t.count for t in self.in_flight.values())

    @property
    def settled(self) -> bool:
        """True when no message checked is in flight or waiting for its first delivery."""
        return self.in_flight_count == 0 and self.never_delivered.count == 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able view."""
        data = dataclasses.asdict(self)
        data["counts"] = {kind: self.counts.get(kind, 0) for kind in KINDS}
        data["clean"], data["settled"] = self.clean, self.settled
        return data


@dataclasses.dataclass
class Report:
    """The audit of every handler asked for."""

    handlers: list[HandlerAudit]

    @property
    def clean(self) -> bool:
        """True when no handler has an anomaly (``eop audit`` exits 0)."""
        return all(h.clean for h in self.handlers)

    @property
    def settled(self) -> bool:
        """True when no handler has a message in flight or never delivered."""
        return all(h.settled for h in self.handlers)

    def summary(self) -> str:
        """The result in one line: anomalies, or how clean, and what is not settled yet."""
        anomalies = sum(sum(h.counts.values()) for h in self.handlers)
        in_flight = sum(h.in_flight_count for h in self.handlers)
        never = sum(h.never_delivered.count for h in self.handlers)
        open_parts = [f"{in_flight} in flight"] if in_flight else []
        open_parts += [f"{never} never delivered"] if never else []
        unsettled = ", ".join(open_parts)
        if anomalies:
            text = f"{anomalies} anomal{'y' if anomalies == 1 else 'ies'}"
            return f"{text}; also {unsettled}" if unsettled else text
        if unsettled:
            # Not anomalies: these messages have no outcome *yet*.
            return f"clean so far: {unsettled} (audit again once they settle)"
        compacted = sum(h.compacted for h in self.handlers)
        below = (
            f", except {compacted} compacted below the watermark: acked, their outcomes not "
            "shown one by one"
            if compacted
            else ""
        )
        return f"clean: every message checked has exactly one outcome{below}"

    def as_json(self) -> str:
        """The report as JSON, for scripts."""
        data = {
            "clean": self.clean,
            "settled": self.settled,
            "summary": self.summary(),
            "handlers": [h.as_dict() for h in self.handlers],
        }
        return json.dumps(data, indent=2)


_WATERMARK_NOTE = (
    "Below the watermark eop deleted the inbox rows once the consumer's ack floor passed "
    "them (eop acks only after the outcome committed): there the audit shows that the "
    "consumer acked every message and that no retained row or dead letter belongs to "
    "another message, and verifies the rows kept for msg_id_retention_s; it cannot show "
    "each compacted message's outcome."
)


def render(report: Report) -> str:
    """The report as text: a summary per handler, then its anomalies."""
    lines: list[str] = []
    for h in report.handlers:
        lines.extend(_render_handler(h))
        lines.append("")
    lines.append(_WATERMARK_NOTE)
    lines.append(f"result: {report.summary()}")
    return "\n".join(lines)


def _render_handler(h: HandlerAudit) -> list[str]:
    walked = f"{h.range_from}..{h.range_to}" if h.range_to >= h.range_from else "nothing"
    if h.truncated:
        walked += f" (stopped at --limit; go on with --from-seq {h.next_seq})"
    consumer = f"consumer {h.durable}"
    never = f"above the consumer's delivered sequence {h.delivered}"
    combined = f"consumer          ack floor {h.ack_floor}, delivered {h.delivered}"
    if h.partitions:
        consumer = f"consumers {h.durable} ({tables.counted(len(h.partitions), 'partition')})"
        # A message of one partition is never delivered by its own partition's consumer;
        # the highest delivered over all of them says nothing about it.
        never = "each above its partition's delivered sequence (below)"
        combined = (
            f"all partitions    lowest ack floor {h.ack_floor}, highest delivered {h.delivered}"
        )
    lines = [
        f"handler {h.handler}: stream {h.stream} (epoch {h.epoch}), {consumer}, "
        f"filter {', '.join(h.filters) or '(all subjects)'}",
        f"  range walked      {walked}; the stream holds {h.stream_first_seq}..{h.stream_last_seq}",
        f"  messages checked  {h.checked}",
        f"  processed         {_tally(h.processed)}",
        f"  dead-lettered     by rule: {_tallies(h.dead_lettered_by_rule)}",
        f"                    not by rule (anomaly): {_tallies(h.dead_lettered_other)}",
        f"                    dead letter purged (reason unknown): "
        f"{_tally(h.dead_lettered_purged)}",
        f"  duplicates        {h.duplicates} of an earlier msg-id, skipped",
        f"  compacted         {h.compacted} at or below the watermark {h.watermark} without "
        f"a row: acked, outcome not shown; {h.verified_below_watermark} there still have one, "
        "checked",
        f"  in flight         {_tallies(h.in_flight)}",
        f"  never delivered   {_tally(h.never_delivered)}, {never}",
        f"  {combined}, pending {h.consumer_pending}, ack pending {h.ack_pending}, "
        f"redelivered {h.redelivered}",
        *(
            f"  partition {p.partition:<7} {p.consumer or '(none yet)'}: ack floor {p.ack_floor}, "
            f"delivered {p.delivered}, pending {p.pending}, ack pending {p.ack_pending}, "
            f"redelivered {p.redelivered}"
            for p in h.partitions
        ),
        f"  other outcomes    {h.removed_with_outcome} of messages removed by retention, "
        f"{h.outside_filter} of messages outside the consumer's filter or start",
    ]
    lines.extend(f"  note: {note}" for note in h.notes)
    if h.clean:
        lines.append("  anomalies         none")
        return lines
    counts = ", ".join(f"{h.counts[k]} {k}" for k in KINDS if h.counts.get(k))
    lines.append(f"  anomalies         {counts}")
    for a in h.anomalies:
        where = f"seq {a.seq}" if a.seq is not None else "consumer"
        epoch = f" (epoch {a.epoch})" if a.epoch and a.epoch != h.epoch else ""
        lines.append(f"    {a.kind}  {where}{epoch}: {a.detail}")
    hidden = sum(h.counts.values()) - len(h.anomalies)
    if hidden:
        lines.append(f"    ... and {hidden} more (see --json for the counts)")
    return lines


def _tally(t: Tally, what: str = "") -> str:
    """``12 what (seq 1, 2, ...)``: the count and the sample."""
    counted = f"{t.count} {what}".rstrip()
    if not t.sample:
        return counted
    more = ", ..." if t.count > len(t.sample) else ""
    return f"{counted} (seq {', '.join(str(seq) for seq in t.sample)}{more})"


def _tallies(tallies: dict[str, Tally]) -> str:
    if not tallies:
        return "0"
    return "; ".join(_tally(t, key) for key, t in sorted(tallies.items()))
