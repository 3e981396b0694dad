"""The audit's report: what was walked and found per handler, as text and as JSON."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

from eop.audit.rules import KINDS, Anomaly

#: Anomalies listed per kind and handler (all are counted).
LISTED_PER_KIND = 100


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
    checked: int = 0
    outcomes: int = 0
    dead_letters: int = 0
    duplicates: int = 0
    compacted: int = 0
    verified_below_watermark: int = 0
    unsettled: int = 0
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

    @property
    def clean(self) -> bool:
        """True when nothing contradicts exactly-once."""
        return not self.counts

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able view."""
        data = dataclasses.asdict(self)
        data["counts"] = {kind: self.counts.get(kind, 0) for kind in KINDS}
        data["clean"] = self.clean
        return data


@dataclasses.dataclass
class Report:
    """The audit of every handler asked for."""

    handlers: list[HandlerAudit]

    @property
    def clean(self) -> bool:
        """True when no handler has an anomaly."""
        return all(h.clean for h in self.handlers)

    def as_json(self) -> str:
        """The report as JSON, for scripts."""
        return json.dumps(
            {"clean": self.clean, "handlers": [h.as_dict() for h in self.handlers]}, indent=2
        )


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
    total = sum(sum(h.counts.values()) for h in report.handlers)
    lines.append(_WATERMARK_NOTE)
    lines.append(
        "result: clean, every message checked has exactly one outcome or is still in flight"
        if report.clean
        else f"result: {total} anomal{'y' if total == 1 else 'ies'}"
    )
    return "\n".join(lines)


def _render_handler(h: HandlerAudit) -> list[str]:
    walked = f"{h.range_from}..{h.range_to}" if h.range_to >= h.range_from else "nothing"
    if h.truncated:
        walked += f" (stopped at --limit; go on with --from-seq {h.next_seq})"
    lines = [
        f"handler {h.handler}: stream {h.stream} (epoch {h.epoch}), consumer {h.durable}, "
        f"filter {', '.join(h.filters) or '(all subjects)'}",
        f"  range walked      {walked}; the stream holds {h.stream_first_seq}..{h.stream_last_seq}",
        f"  messages checked  {h.checked}",
        f"  outcomes found    {h.outcomes} processed, {h.dead_letters} dead-lettered, "
        f"{h.duplicates} duplicates of an earlier msg-id",
        f"  dead letters      {h.dead_letters}",
        f"  compacted         {h.compacted} at or below the watermark {h.watermark} "
        f"({h.verified_below_watermark} more there verified by retained rows)",
        f"  in flight         {h.unsettled} above the ack floor without an outcome yet",
        f"  consumer          ack floor {h.ack_floor}, delivered {h.delivered}, "
        f"ack pending {h.ack_pending}, redelivered {h.redelivered}",
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
