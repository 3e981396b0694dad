"""The result of a chaos run: verdicts, faults injected, evidence, and its rendering."""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any

from eop.tools.chaos import checker, relayed
from eop.tools.chaos.checker import LogEvidence, OrderVerdict, Outcomes


@dataclasses.dataclass
class Report:
    """Everything a chaos run found. :attr:`ok` is the verdict."""

    seed: int
    command: str
    messages: int
    scenario: str = "classic"
    publishes: int = 0
    stored: int = 0
    faults: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Harness faults by kind (skipped ones counted as ``KIND (skipped)``)."""
    outcomes: Outcomes = dataclasses.field(default_factory=Outcomes)
    stages: dict[str, Outcomes] = dataclasses.field(default_factory=dict)
    """The verdicts of each downstream handler of a pipeline, by name."""
    outbox: relayed.Verdict | None = None
    """The outbox against the streams it was published to (a pipeline)."""
    invariant_problems: list[str] = dataclasses.field(default_factory=list)
    order: OrderVerdict | None = None
    """Per-key order of an ordered handler's effects (a target with ``order_sql``)."""
    logs: LogEvidence = dataclasses.field(default_factory=LogEvidence)
    evidence: dict[str, int] = dataclasses.field(default_factory=dict)
    missing_evidence: list[str] = dataclasses.field(default_factory=list)
    liveness: str | None = None
    """Why the run did not drain in time (None: it did)."""
    worker_exits: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    final_exit_codes: list[int] = dataclasses.field(default_factory=list)
    incarnations: int = 0
    proxy: dict[str, int] = dataclasses.field(default_factory=dict)
    timings_s: dict[str, float] = dataclasses.field(default_factory=dict)
    log_dir: str = ""
    stops: list[checker.Stop] = dataclasses.field(default_factory=list)
    """Every SIGTERM of a worker, timed."""
    stop_limit_s: float = 35.0
    """shutdown_grace_s + 5 s: a stop that takes longer is a stall."""
    healed_at: str | None = None
    """When every fault was healed (ISO 8601), to time the stuck deliveries after it
    (:attr:`stuck_after_heal`). None: not timed."""
    figures: dict[str, str] = dataclasses.field(default_factory=dict)
    """Measured, not asserted (e.g. the poison flood's time until its good messages are done)."""

    @property
    def stalls(self) -> list[str]:
        """Workers that overran their stop, a drain that did not finish, and deliveries
        stuck past their bound after the heal."""
        found = checker.check_stops(self.stops)
        if self.liveness:
            found.append(f"liveness: {self.liveness}")
        found += [f"stuck: {item}" for item in self.stuck_after_heal]
        return found

    @property
    def stuck_after_heal(self) -> list[str]:
        """Deliveries still stuck past their bound once every fault was healed: stalls
        (:func:`~eop.tools.chaos.checker.stuck_stalls`)."""
        if self.healed_at is None:
            return []
        return checker.stuck_stalls(self.logs, self.healed_at)

    @property
    def fault_count(self) -> int:
        """Faults injected by the harness plus fault-point firings in the workers."""
        injected = sum(n for kind, n in self.faults.items() if not kind.endswith("(skipped)"))
        return injected + sum(self.logs.fault_hits.values())

    @property
    def problems(self) -> list[str]:
        """Every reason the run failed (empty: exactly-once held)."""
        o = self.outcomes
        found = [f"lost: {key}" for key in o.lost]
        found += [f"duplicated: {item}" for item in o.duplicated]
        found += [f"unexpected: {item}" for item in o.unexpected]
        found += [f"dead-lettered good message: {item}" for item in o.dead_lettered]
        for name, stage in self.stages.items():
            found += [f"{name}: lost: {key}" for key in stage.lost]
            found += [f"{name}: duplicated: {item}" for item in stage.duplicated]
            found += [f"{name}: unexpected: {item}" for item in stage.unexpected]
            found += [f"{name}: dead-lettered good message: {item}" for item in stage.dead_lettered]
        if self.outbox is not None:
            found += self.outbox.problems
        found += [f"invariant: {item}" for item in self.invariant_problems]
        if self.order is not None:
            found += [f"order: {item}" for item in self.order.violations]
        found += [f"secret leaked in a log line: {item}" for item in self.logs.leaks]
        found += [f"no evidence of {item}" for item in self.missing_evidence]
        bad_exits = [code for code in self.final_exit_codes if code != 0]
        if bad_exits:
            found.append(f"workers did not stop cleanly at the end: exit codes {bad_exits}")
        found += [f"stall: {item}" for item in self.stalls]
        return found

    @property
    def ok(self) -> bool:
        """True when exactly-once held, the run drained, and nothing leaked."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary."""
        o = self.outcomes
        return {
            "ok": self.ok,
            "seed": self.seed,
            "command": self.command,
            "messages": self.messages,
            "publishes": self.publishes,
            "stored": self.stored,
            "lost": len(o.lost),
            "duplicated": len(o.duplicated),
            "unexpected": len(o.unexpected),
            "dead_lettered_good": len(o.dead_lettered),
            "order_violations": None if self.order is None else len(self.order.violations),
            "order": None if self.order is None else _order(self.order),
            "stages": {name: _verdicts(stage) for name, stage in self.stages.items()},
            "outbox": None if self.outbox is None else self.outbox.to_dict(),
            "scenario": self.scenario,
            "effects": o.effects,
            "good_dead_letters_by_reason": dict(o.good_dead_by_reason),
            "poison_dead_letters_by_reason": dict(o.poison_dead_by_reason),
            "stalls": len(self.stalls),
            "stuck_deliveries": len(self.logs.stuck),
            "stuck_after_heal": len(self.stuck_after_heal),
            "stops": [dataclasses.asdict(stop) for stop in self.stops],
            "stop_limit_s": self.stop_limit_s,
            "figures": self.figures,
            "poison_dead_lettered": o.poison_dead_lettered,
            "poison": o.poison,
            "faults_total": self.fault_count,
            "faults": dict(sorted(self.faults.items())),
            "fault_points": dict(sorted(self.logs.fault_hits.items())),
            "evidence": self.evidence,
            "worker_exits": dict(self.worker_exits),
            "incarnations": self.incarnations,
            "proxy": self.proxy,
            "log_lines": self.logs.lines,
            "timings_s": self.timings_s,
            "problems": self.problems[:50],
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def _injected_limits(self) -> str:
        """The longest limit of a stop whose worker's fault plan injects a stall or a
        freeze (its limit grows by it: :class:`checker.Stop`), when there is one."""
        longest = max((stop.limit_s for stop in self.stops), default=self.stop_limit_s)
        if longest <= self.stop_limit_s:
            return ""
        return f", up to {longest:g} s for a worker whose faults inject a stall or a freeze"

    def _render_scenario(self) -> list[str]:
        """The scenario's figures: effects, dead letters by reason, stalls, stops."""
        o = self.outcomes
        times = sorted(stop.seconds for stop in self.stops)
        stops = (
            f"{len(times)}, median {times[len(times) // 2]:.1f} s, max {times[-1]:.1f} s"
            if times
            else "none"
        )
        lines = [
            f"  scenario {self.scenario}: {o.effects} effects; dead letters of good messages "
            f"{_counts(o.good_dead_by_reason)}, of poison {_counts(o.poison_dead_by_reason)}",
            f"  stalls: {len(self.stalls)}; stops after SIGTERM: {stops} "
            f"(limit {self.stop_limit_s:g} s{self._injected_limits()})",
            f"  stuck deliveries (delivery.stuck logged): {len(self.logs.stuck)}",
        ]
        lines += [f"    {item}" for item in self.logs.stuck[:10]]
        late = self.stuck_after_heal
        lines.append(f"  stuck past the bound after the heal: {len(late)}")
        lines += [f"    {item}" for item in late[:10]]
        lines += [
            f"    stop of worker {s.worker} (pid {s.pid}, {s.when}): {s.seconds:.1f} s"
            for s in self.stops
            if s.code is None or s.seconds > s.limit_s
        ]
        lines += [f"  {name}: {value}" for name, value in self.figures.items()]
        return lines

    def _render_stages(self) -> list[str]:
        """Each downstream handler's verdicts, and the outbox's, as the first handler's."""
        lines = []
        for name, s in self.stages.items():
            lines.append(
                f"  {name}: exactly once {s.exactly_once}/{s.good} good; lost {len(s.lost)}, "
                f"duplicated {len(s.duplicated)}, unexpected {len(s.unexpected)}, "
                f"good dead-lettered {len(s.dead_lettered)}"
            )
        v = self.outbox
        if v is not None:
            stored = ", ".join(f"{name} {n}" for name, n in v.stored.items())
            lines.append(
                f"  outbox: {v.rows} rows; parked {len(v.parked)}, never published "
                f"{len(v.pending)}, missing from their stream {len(v.missing)}, two rows for "
                f"one message {len(v.doubled)}; stored: {stored}"
            )
            lines.append(
                f"  sent again after the duplicate window: {len(v.copies)} messages "
                f"({v.extra_copies} extra copies), absorbed {v.absorbed}/{len(v.copies)} "
                "(exactly one effect downstream)"
            )
        return lines

    def _render_order(self) -> list[str]:
        v = self.order
        if v is None:
            return []
        return [
            f"  order violations {len(v.violations)} ({v.effects} effects of {v.keys} keys in "
            f"commit order): ahead of an earlier step {v.ahead}, after a later one "
            f"{v.behind}, before the dead letter ahead of it {v.unsettled}"
        ]

    def render(self) -> str:
        """The report for people."""
        o = self.outcomes
        lines = [
            f"eop chaos: seed {self.seed}  (replay: {self.command})",
            f"  messages: {self.messages} logical ({o.good} good, {o.poison} poison), "
            f"{self.publishes} publishes, {self.stored} stored by the server",
            f"  exactly once: {o.exactly_once}/{o.good} good; poison dead-lettered once: "
            f"{o.poison_dead_lettered}/{o.poison}",
            f"  lost {len(o.lost)}, duplicated {len(o.duplicated)}, unexpected "
            f"{len(o.unexpected)}, good dead-lettered {len(o.dead_lettered)}",
            *self._render_stages(),
            *self._render_order(),
            *self._render_scenario(),
            f"  faults: {self.fault_count} in all; injected by the harness:",
        ]
        lines += [f"    {kind:<28} {n:>6}" for kind, n in sorted(self.faults.items())]
        lines.append("  fault points fired in workers:")
        lines += [f"    {hit:<28} {n:>6}" for hit, n in sorted(self.logs.fault_hits.items())]
        lines.append("  evidence from the workers' logs:")
        lines += [f"    {label:<42} {n:>6}" for label, n in self.evidence.items()]
        lines.append(
            f"  workers: {self.incarnations} processes; exits "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.worker_exits.items()))
        )
        lines.append(f"  proxies: {self.proxy}")
        lines.append(
            f"  log lines scanned: {self.logs.lines} ({self.logs.foreign_lines} not eop's JSON); "
            f"canary leaks: {len(self.logs.leaks)}"
        )
        lines.extend(f"    foreign: {sample}" for sample in self.logs.foreign_samples)
        lines.append("  timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.timings_s.items()))
        if self.log_dir:
            lines.append(f"  logs: {self.log_dir}")
        problems = self.problems
        if problems:
            lines.append(f"  FAILED ({len(problems)} problems; seed {self.seed}):")
            lines += [f"    {p}" for p in problems[:40]]
        else:
            in_order = "" if self.order is None else ", in order per key"
            lines.append(f"  OK: every message took effect exactly once{in_order}")
        return "\n".join(lines)


def _verdicts(o: Outcomes) -> dict[str, int]:
    return {
        "good": o.good,
        "exactly_once": o.exactly_once,
        "lost": len(o.lost),
        "duplicated": len(o.duplicated),
        "unexpected": len(o.unexpected),
        "dead_lettered_good": len(o.dead_lettered),
    }


def _order(v: OrderVerdict) -> dict[str, int]:
    return {
        "keys": v.keys,
        "effects": v.effects,
        "ahead": v.ahead,
        "behind": v.behind,
        "unsettled": v.unsettled,
    }


def _counts(counter: collections.Counter[str]) -> str:
    if not counter:
        return "none"
    return ", ".join(f"{reason} {n}" for reason, n in counter.most_common())
