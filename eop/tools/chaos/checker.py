"""The checker: what became of every logical message, and what the workers' logs prove.

Per logical message (its key), a good one must have exactly one effect and no
dead letter; a poison one exactly one dead letter and no effect. Anything
else is lost, duplicated, or dead-lettered by mistake; effects or dead letters
of keys never published are unexpected. The logs must show that the hard
races happened (kills at every fault point, ambiguous commits, lost ack
replies, overlapping deliveries), and must not hold a single canary secret.

Never zero times: a good message dead-lettered is a failure like a lost one
(the infrastructure failed under it, not the message), and so is a worker that
stalls: the run must drain, every worker must exit within its
``shutdown_grace_s`` + 5 s of a SIGTERM (:func:`check_stops`), and once every
fault is healed no delivery may stay unacknowledged past its stuck bound
(:func:`stuck_stalls`).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from eop.pg import models
from eop.tools.chaos import schedule
from eop.tools.chaos.target import Payload


@dataclasses.dataclass
class Outcomes:
    """The per-message verdicts."""

    good: int = 0
    poison: int = 0
    exactly_once: int = 0
    poison_dead_lettered: int = 0
    lost: list[str] = dataclasses.field(default_factory=list)
    duplicated: list[str] = dataclasses.field(default_factory=list)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    dead_lettered: list[str] = dataclasses.field(default_factory=list)
    """Good messages that were dead-lettered: they took effect zero times."""
    effects: int = 0
    """Effects counted, of every key."""
    good_dead_by_reason: collections.Counter[str] = dataclasses.field(
        default_factory=collections.Counter
    )
    poison_dead_by_reason: collections.Counter[str] = dataclasses.field(
        default_factory=collections.Counter
    )


def check_outcomes(
    payloads: Sequence[Payload],
    effects: Mapping[str, int],
    dead_letters: Mapping[str | None, Sequence[str]],
) -> Outcomes:
    """Compare effects and dead letters (reasons by msg-id) with what was published."""
    out = Outcomes(effects=sum(int(n) for n in effects.values()))
    planned = {p.key: p for p in payloads}
    for key, payload in planned.items():
        reasons = list(dead_letters.get(key, ()))
        by_reason = out.poison_dead_by_reason if payload.poison else out.good_dead_by_reason
        by_reason.update(reasons)
        _judge(out, short(key), payload.poison, int(effects.get(key, 0)), reasons)
    for key, n in effects.items():
        if key not in planned:
            out.unexpected.append(f"{n} effects of unknown key {short(key)!r}")
    for msg_id, dead in dead_letters.items():
        if msg_id is None or msg_id not in planned:
            shown = None if msg_id is None else short(msg_id)
            out.unexpected.append(f"dead letters {list(dead)} of unknown msg-id {shown!r}")
        elif models.REASON_SEQUENCE_REUSED in dead:
            out.unexpected.append(f"{short(msg_id)}: quarantined as a reused sequence")
    return out


def planned_at(payloads: Sequence[Payload], stage: int) -> list[Payload]:
    """What stage ``stage`` of a pipeline must settle: the messages that enter there, and
    the good ones of earlier stages (which passed them on)."""
    return [p for p in payloads if p.stage == stage or (p.stage < stage and not p.poison)]


def short(key: str, limit: int = 48) -> str:
    """``key`` for a report line: a 5,000-character msg-id is shown by its ends."""
    if len(key) <= limit:
        return key
    return f"{key[:20]}...{key[-12:]} ({len(key)} chars)"


@dataclasses.dataclass(frozen=True)
class Stop:
    """One SIGTERM of a worker and how long it took to exit."""

    worker: int
    """The incarnation number (its log is ``worker-NNNN.log``)."""
    pid: int
    when: str
    """``mid-run`` (a scheduled SIGTERM), ``heal`` or ``final``."""
    seconds: float
    code: int | None
    """Its exit status; None when it had not exited and was SIGKILLed."""
    limit_s: float
    """shutdown_grace_s + 5 s, plus the longest stall or freeze its fault plan may inject."""


def check_stops(stops: Iterable[Stop]) -> list[str]:
    """Every stop that took longer than its limit, or never ended."""
    found = []
    for stop in stops:
        if stop.code is None:
            found.append(
                f"worker {stop.worker} (pid {stop.pid}) did not exit within {stop.seconds:.1f} s "
                f"of SIGTERM ({stop.when}; limit {stop.limit_s:g} s); SIGKILLed"
            )
        elif stop.seconds > stop.limit_s:
            found.append(
                f"worker {stop.worker} (pid {stop.pid}) took {stop.seconds:.1f} s to exit after "
                f"SIGTERM ({stop.when}; limit {stop.limit_s:g} s)"
            )
    return found


def _judge(out: Outcomes, key: str, poison: bool, n_effects: int, reasons: list[str]) -> None:
    """One message's verdict: good ones need one effect, poison ones one dead letter."""
    outcomes = n_effects + len(reasons)
    if outcomes == 0:
        out.lost.append(key)
    elif outcomes > 1:
        out.duplicated.append(f"{key}: {n_effects} effects, dead letters {reasons}")
    if poison:
        out.poison += 1
        if n_effects == 0 and len(reasons) == 1:
            out.poison_dead_lettered += 1
        elif outcomes == 1:
            out.unexpected.append(f"{key}: poison, yet it took effect")
        return
    out.good += 1
    if n_effects == 1 and not reasons:
        out.exactly_once += 1
    elif outcomes == 1:
        out.dead_lettered.append(f"{key}: {reasons[0]}")


@dataclasses.dataclass
class LogEvidence:
    """What the workers' logs say."""

    lines: int = 0
    events: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    fault_hits: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """``point:action`` of every fault-point firing."""
    kills: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Kills by :class:`~eop.tools.chaos.schedule.KillSpot` name (point and timer)."""
    guard_skips: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Deliveries skipped by the msg-id guard (a republish after the duplicate window), by
    handler."""
    deadlocks: int = 0
    stuck: list[str] = dataclasses.field(default_factory=list)
    """Every ``delivery.stuck`` a worker logged: a message unacknowledged for longer than
    ``stuck_after_ack_waits`` AckWaits (file, sequence, consumer and how long)."""
    stuck_waits: list[StuckWait] = dataclasses.field(default_factory=list)
    """The same, each with how long it stayed stuck as far as its worker saw."""
    settled: dict[tuple[str, int], list[str]] = dataclasses.field(default_factory=dict)
    """When each delivery (handler, stream sequence) was settled: processed, acked as a
    duplicate or dead-lettered (the workers' timestamps, ISO 8601)."""
    faults_end: datetime.datetime | None = None
    """When the last fault-point firing ended (its timestamp plus its freeze or stall;
    None: none fired): the drain arms a few workers too, so faults outlast the heal."""
    leaks: list[str] = dataclasses.field(default_factory=list)
    """Where a canary appeared (file, line number and which canary; never its value)."""
    foreign_lines: int = 0
    """Lines that are not eop's JSON (a traceback, a library's print)."""
    foreign_samples: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StuckWait:
    """A delivery a worker reported stuck, and how long it waited unacknowledged."""

    where: str
    """The log file, sequence and consumer."""
    waited_s: float
    """Its wait when reported stuck, plus the time until the same worker saw it
    acknowledged (``delivery.unstuck``): a lower bound when it never did."""
    stuck_after_s: float
    handler: str = ""
    seq: int | None = None
    """The stream sequence reported (None: not in the report)."""
    reported_at: str = ""
    reported_waited_s: float = 0.0
    """Its wait when reported: it began that long before ``reported_at``."""
    resolved: bool = False


def stuck_stalls(ev: LogEvidence, healed_at: str) -> list[str]:
    """The stuck deliveries still unacknowledged longer than their bound once every fault
    was healed: while faults run they explain any wait, in calm a stuck delivery is a
    stall like a worker that overran its stop.

    Calm begins at ``healed_at`` (ISO 8601), or later when a fault point fired after it
    (the drain's armed workers). A wait ends when its delivery was first settled, by any
    worker, or else when its worker saw the floor move (``delivery.unstuck``); a wait
    whose end no log shows is left to the drain, which judges the message.
    """
    calm = max(_instant(healed_at), ev.faults_end, key=_epoch_s)
    found = []
    for wait in ev.stuck_waits:
        reported = _instant(wait.reported_at)
        if calm is None or reported is None:
            continue
        began = reported - datetime.timedelta(seconds=wait.reported_waited_s)
        ended = _wait_end(ev, wait, began)
        if ended is None:
            continue
        after_calm = (ended - max(calm, began)).total_seconds()
        if after_calm > wait.stuck_after_s:
            found.append(
                f"{wait.where} unacknowledged for {(ended - began).total_seconds():.1f} s, "
                f"{after_calm:.1f} s of them after every fault was healed "
                f"(stuck after {wait.stuck_after_s:g} s)"
            )
    return found


def _wait_end(
    ev: LogEvidence, wait: StuckWait, began: datetime.datetime
) -> datetime.datetime | None:
    """When the delivery ``wait`` reported was first settled after its wait began."""
    if wait.seq is not None:
        times = [_instant(t) for t in ev.settled.get((wait.handler, wait.seq), [])]
        after = [t for t in times if t is not None and t >= began]
        if after:
            return min(after)
    if wait.resolved:
        return began + datetime.timedelta(seconds=wait.waited_s)
    return None


def _instant(text: str | None) -> datetime.datetime | None:
    """An ISO 8601 timestamp (a trailing ``Z`` too, which Python 3.10 does not read)."""
    if not text:
        return None
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)


def _epoch_s(moment: datetime.datetime | None) -> float:
    return moment.timestamp() if moment is not None else float("-inf")


def _seconds_between(start: str, end: str) -> float | None:
    began, ended = _instant(start), _instant(end)
    if began is None or ended is None:
        return None
    return (ended - began).total_seconds()


def scan_logs(paths: Iterable[Path], canaries: Mapping[str, str]) -> LogEvidence:
    """Read every line of every log: count events, collect fault hits, find canaries."""
    ev = LogEvidence()
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            ev.lines += 1
            for label, secret in canaries.items():
                if secret and secret in line:
                    ev.leaks.append(f"{path.name}:{number}: {label}")
            _count_line(ev, line, path.name)
    return ev


def _count_line(ev: LogEvidence, line: str, name: str) -> None:
    try:
        record = json.loads(line) if line.startswith("{") else None
    except json.JSONDecodeError:
        record = None  # the last line of a killed process may be cut short
    if not isinstance(record, dict):
        if line.strip():
            ev.foreign_lines += 1
            if len(ev.foreign_samples) < 5:
                ev.foreign_samples.append(f"{name}: {line[:200]}")
        return
    event = str(record.get("event"))
    ev.events[event] += 1
    if event == "fault.hit":
        ev.fault_hits[f"{record.get('point')}:{record.get('action')}"] += 1
        _note_fault_end(ev, record)
        if record.get("action") == "kill":
            timer_s = float(record.get("seconds") or 0.0)
            ev.kills[schedule.spot_name(str(record.get("point")), timer_s)] += 1
    elif event == "message.duplicate" and record.get("by") == "msg_id":
        ev.guard_skips[str(record.get("handler"))] += 1
    elif event == "transaction.retry" and "eadlock" in str(record.get("error", "")):
        ev.deadlocks += 1
    elif event in ("delivery.stuck", "delivery.unstuck"):
        _count_stuck(ev, event, record, name)
    if event in _SETTLED and isinstance(record.get("seq"), int):
        key = (str(record.get("handler")), int(record["seq"]))
        ev.settled.setdefault(key, []).append(str(record.get("timestamp") or ""))


# The events that end a delivery's wait: it was acked or terminated.
_SETTLED = frozenset({"message.processed", "message.duplicate", "message.dead_lettered"})


def _note_fault_end(ev: LogEvidence, record: Mapping[str, Any]) -> None:
    """Move :attr:`LogEvidence.faults_end` to this firing's end, if later."""
    hit = _instant(str(record.get("timestamp") or ""))
    if hit is None:
        return
    ends = hit + datetime.timedelta(seconds=float(record.get("seconds") or 0.0))
    if _epoch_s(ends) > _epoch_s(ev.faults_end):
        ev.faults_end = ends


def _count_stuck(ev: LogEvidence, event: str, record: Mapping[str, Any], name: str) -> None:
    """A stuck delivery's report, or the end of one (the same worker saw it acknowledged)."""
    if event == "delivery.stuck":
        where = f"{name}: seq {record.get('seq')} of {record.get('consumer')}"
        ev.stuck.append(
            f"{where} unacknowledged for "
            f"{record.get('waited_s')} s (> {record.get('stuck_after_s')} s)"
        )
        ev.stuck_waits.append(
            StuckWait(
                where=where,
                handler=str(record.get("handler")),
                seq=record["seq"] if isinstance(record.get("seq"), int) else None,
                waited_s=float(record.get("waited_s") or 0.0),
                stuck_after_s=float(record.get("stuck_after_s") or 0.0),
                reported_at=str(record.get("timestamp") or ""),
                reported_waited_s=float(record.get("waited_s") or 0.0),
            )
        )
    elif event == "delivery.unstuck":
        consumer = f" of {record.get('consumer')}"
        for wait in reversed(ev.stuck_waits):
            if wait.where.startswith(f"{name}:") and wait.where.endswith(consumer):
                if not wait.resolved:
                    more = _seconds_between(wait.reported_at, str(record.get("timestamp") or ""))
                    wait.waited_s += max(more or 0.0, 0.0)
                    wait.resolved = True
                break


EVIDENCE_EVENTS = {
    "ambiguous commits": "commit.ambiguous",
    "ack retries (lost ack replies)": "ack.retry",
    "overlapping deliveries (claim waited out)": "message.claim_timeout",
}


def evidence(
    ev: LogEvidence, spots: Sequence[schedule.KillSpot] = schedule.HANDLER_SPOTS
) -> dict[str, int]:
    """The counts that show the hard races happened, with the kills at each of ``spots``."""
    found = {label: ev.events[event] for label, event in EVIDENCE_EVENTS.items()}
    found["acks given up"] = ev.events["ack.gave_up"]
    found["transactions retried"] = ev.events["transaction.retry"]
    found["deadlocks retried"] = ev.deadlocks
    found["duplicate deliveries skipped"] = ev.events["message.duplicate"]
    found["republishes skipped by the msg-id guard"] = sum(ev.guard_skips.values())
    found["nats reconnects"] = ev.events["nats.reconnected"]
    for spot in spots:
        found[f"kills at {spot.name}"] = ev.kills[spot.name]
    return found


def missing_evidence(
    found: Mapping[str, int],
    spots: Sequence[schedule.KillSpot] = schedule.HANDLER_SPOTS,
    *,
    races: bool = True,
) -> list[str]:
    """The races (unless not ``races``) and kills at ``spots`` a full run must show but this
    one did not."""
    required = [*(EVIDENCE_EVENTS if races else ()), *(f"kills at {s.name}" for s in spots)]
    return [label for label in required if not found.get(label)]


@dataclasses.dataclass
class OrderVerdict:
    """Per-key order of an ordered handler's effects, read in commit order.

    For two messages of one key, the earlier one's outcome must commit before
    the later one's handler starts: each key's positions commit as 1, 2, 3...
    """

    keys: int = 0
    effects: int = 0
    ahead: int = 0
    """Effects that committed while an earlier position of their key had not (a gap)."""
    behind: int = 0
    """Effects that committed after a later position of their key (an inversion), or
    again (a duplicate)."""
    unsettled: int = 0
    """Effects whose handler ran before the message published just before it (one
    that is dead-lettered) had its outcome committed."""
    violations: list[str] = dataclasses.field(default_factory=list)
    """One line per effect that broke the order: the invariant is none."""


def check_order(rows: Iterable[Sequence[Any]]) -> OrderVerdict:
    """Judge ``(key, position, prior_settled)`` rows, given in commit order."""
    verdict = OrderVerdict()
    top: dict[str, int] = {}
    for key, position, prior_settled in rows:
        name, step = str(key), int(position)
        last = top.get(name, 0)
        verdict.effects += 1
        reasons = []
        if step > last + 1:
            verdict.ahead += 1
            reasons.append(f"committed while step {last + 1} had not (gap)")
        elif step <= last:
            verdict.behind += 1
            reasons.append(f"committed after step {last} (inversion or duplicate)")
        if not prior_settled:
            verdict.unsettled += 1
            reasons.append("ran before the dead letter published ahead of it committed")
        if reasons:
            verdict.violations.append(f"{name}: step {step} " + "; ".join(reasons))
        top[name] = max(last, step)
    verdict.keys = len(top)
    return verdict
