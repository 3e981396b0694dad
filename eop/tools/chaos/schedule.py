"""The seeded fault schedule: which fault, when, for how long, at whom.

A schedule is a pure function of the seed and the run's shape, so the same
seed replays the same faults at the same offsets (the processes' timing
still varies: what the faults hit is up to the race, which is the point).
Outages of one server never overlap each other.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from typing import Literal, get_args

from eop import faults

Kind = Literal[
    "worker_kill",
    "worker_stop",
    "nats_kill",
    "nats_restart",
    "pg_restart",
    "pg_crash",
    "pg_terminate",
    "nats_latency",
    "pg_latency",
    "nats_blackhole",
    "pg_blackhole",
    "nats_reset",
    "pg_reset",
    "drop_ack_reply",
    "drop_commit_reply",
    "consumer_recreate",
    # The "never zero times" hunts (eop.tools.chaos.scenarios): faults after which a
    # good message must still take effect, and a worker must still stop.
    "pg_outage_long",
    "pg_read_only",
    "row_lock_hold",
    "worker_term",
    "long_msg_id",
    "raw_bad_subject",
    "poison_flood",
    # The ``ordered`` scenario's: a SIGSTOP that always outlasts AckWait, and a change
    # in the number of worker commands (``target`` is the new count).
    "worker_stop_long",
    "scale_workers",
]
KINDS: tuple[Kind, ...] = get_args(Kind)

# Relative frequencies: cheap, local faults often; server outages, which
# cost seconds of recovery each, rarely.
WEIGHTS: dict[Kind, float] = {
    "worker_kill": 1,
    "worker_stop": 2,
    "nats_kill": 0.6,
    "nats_restart": 0.4,
    "pg_restart": 0.5,
    "pg_crash": 0.4,
    "pg_terminate": 2,
    "nats_latency": 2,
    "pg_latency": 2,
    "nats_blackhole": 1,
    "pg_blackhole": 1,
    "nats_reset": 1.5,
    "pg_reset": 1.5,
    "drop_ack_reply": 5,
    "drop_commit_reply": 5,
    "consumer_recreate": 0.4,
}
"""The classic mix: the faults of every run of the ``classic`` scenario."""

HUNT_WEIGHTS: dict[Kind, float] = {
    "pg_outage_long": 0.1,
    "pg_read_only": 0.1,
    "row_lock_hold": 0.3,
    "worker_term": 0.5,
    "long_msg_id": 0.3,
    "raw_bad_subject": 0.2,
    "poison_flood": 0.1,
}
"""The faults a good message must survive, added to the classic mix by ``mixed``."""

# Which resource an outage holds: two outages of one resource never overlap.
_RESOURCE: dict[Kind, str] = {
    "nats_kill": "nats",
    "nats_restart": "nats",
    "nats_blackhole": "nats",
    "pg_restart": "pg",
    "pg_crash": "pg",
    "pg_blackhole": "pg",
    "consumer_recreate": "consumer",
    "pg_outage_long": "pg",
    "pg_read_only": "pg",
    "row_lock_hold": "locks",
    "poison_flood": "flood",
}


# Faults that hit every connection or a whole server. Every other window of
# CALM_EVERY_S goes without them: a claim held past AckWait then survives long
# enough for the redelivery to wait it out (the overlap race), which a storm of
# server-wide faults would cut short every time.
_SERVER_WIDE = {
    "nats_kill",
    "nats_restart",
    "nats_blackhole",
    "nats_reset",
    "pg_restart",
    "pg_crash",
    "pg_terminate",
    "pg_blackhole",
    "pg_reset",
    "consumer_recreate",
    "pg_outage_long",
    "pg_read_only",
    "row_lock_hold",
    "poison_flood",
}
CALM_EVERY_S = 12.0
# A recreated consumer redelivers the whole stream (DeliverPolicy all): in a long
# run, recreating it every few seconds would leave nothing but replays.
_SPACING_S: dict[Kind, float] = {"consumer_recreate": 60.0, "poison_flood": 30.0}


@dataclasses.dataclass(frozen=True)
class Shape:
    """Durations of the hunts, derived from the workers' settings."""

    attempts_budget_s: float = 10.0
    """Longer than a message's whole attempts budget (max_attempts x (backoff_max_s +
    the in-process retries)): an outage, a read-only window or a held lock this long
    outlasts every delivery of the messages in flight."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One scheduled fault."""

    at_s: float
    """Offset from the start of the chaos phase."""
    kind: Kind
    duration_s: float = 0.0
    """How long it lasts (stop, outage, latency, black hole); 0 for instant ones."""
    target: int = 0
    """Which worker slot (worker faults) or how many replies (drops)."""
    amount: float = 0.0
    """Latency in seconds (latency faults)."""


def build(
    seed: int,
    duration_s: float,
    *,
    mean_gap_s: float,
    workers: int,
    ack_wait_s: float,
    weights: Mapping[Kind, float] | None = None,
    required: tuple[Kind, ...] = (),
    shape: Shape | None = None,
) -> list[Fault]:
    """The faults of a chaos phase of ``duration_s``, about every ``mean_gap_s``.

    ``weights`` picks the mix (default: the classic :data:`WEIGHTS`); each kind in
    ``required`` happens once, between 30 and 50 % of the phase, whatever
    the draw, so that a short run of a scenario always meets its fault.
    """
    rng = random.Random(f"eop-chaos-schedule:{seed}")
    weights = WEIGHTS if weights is None else weights
    shape = shape or Shape()
    storm = [k for k, w in weights.items() if w > 0]
    calm = [k for k in storm if k not in _SERVER_WIDE] or storm
    busy_until: dict[str, float] = {}
    schedule: list[Fault] = []
    for kind in required:
        at = rng.uniform(0.3, 0.5) * duration_s
        schedule.append(_make(rng, kind, at, workers, ack_wait_s, shape))
        if kind in _RESOURCE:
            busy_until[_RESOURCE[kind]] = at + schedule[-1].duration_s + 2.0
    now = rng.uniform(0.5, 1.5)
    while storm and now < duration_s:
        kinds = calm if int(now // CALM_EVERY_S) % 2 else storm
        kind = rng.choices(kinds, [weights[k] for k in kinds])[0]
        fault = _make(rng, kind, now, workers, ack_wait_s, shape)
        resource = _RESOURCE.get(kind)
        if resource is None or busy_until.get(resource, 0.0) <= now:
            if resource is not None:
                # Leave time to recover before the next outage of the same thing.
                busy_until[resource] = now + fault.duration_s + _SPACING_S.get(kind, 2.0)
            schedule.append(fault)
        now += rng.expovariate(1.0 / mean_gap_s)
    schedule.sort(key=lambda f: f.at_s)
    return schedule


def _make(
    rng: random.Random, kind: Kind, at_s: float, workers: int, ack_wait_s: float, shape: Shape
) -> Fault:
    slot = rng.randrange(workers)
    if kind in ("pg_outage_long", "pg_read_only", "row_lock_hold"):
        return Fault(at_s, kind, shape.attempts_budget_s * rng.uniform(1.0, 1.3))
    if kind in ("long_msg_id", "raw_bad_subject", "poison_flood"):
        return Fault(at_s, kind, target=rng.randrange(2**31))
    if kind == "worker_stop_long":
        # Past AckWait every time: the server redelivers the frozen worker's messages
        # to the others, and the frozen one resumes with them still in hand.
        return Fault(at_s, kind, rng.uniform(1.25, 2.0) * ack_wait_s, slot)
    if kind == "worker_stop":
        # Half the stops outlast AckWait: the server redelivers to a live worker
        # while the stopped one still holds its claims.
        return Fault(at_s, kind, rng.uniform(0.5, ack_wait_s * 2.5), slot)
    if kind in ("nats_kill", "nats_restart", "pg_crash", "pg_restart"):
        return Fault(at_s, kind, rng.uniform(0.2, 1.5))
    if kind.endswith("_latency"):
        return Fault(at_s, kind, rng.uniform(0.5, 3.0), amount=rng.uniform(0.005, 0.08))
    if kind.endswith("_blackhole"):
        return Fault(at_s, kind, rng.uniform(0.2, ack_wait_s * 0.4))
    if kind.startswith("drop_"):
        return Fault(at_s, kind, target=rng.randint(1, 3))
    if kind == "consumer_recreate":
        return Fault(at_s, kind, rng.uniform(0.1, 1.5))
    if kind.endswith(("_reset", "_terminate")):
        # Some cut every connection, others only some: a held claim may survive.
        return Fault(at_s, kind, target=rng.choice((0, 1, 2)))
    return Fault(at_s, kind, target=slot)


def timeline(
    seed: int,
    duration_s: float,
    steps: Sequence[tuple[float, Kind, int]],
    *,
    ack_wait_s: float,
) -> list[Fault]:
    """Faults at fixed points of the phase: ``(fraction of duration_s, kind, target)``.

    A scenario's script (scaling the workers up and down, a kill while one worker
    runs), on top of the seeded draw of :func:`build`. Durations are drawn as
    :func:`build` draws them; ``target`` is the worker slot, or the new worker count
    of ``scale_workers``.
    """
    rng = random.Random(f"eop-chaos-timeline:{seed}")
    return [
        dataclasses.replace(
            _make(rng, kind, fraction * duration_s, 1, ack_wait_s, Shape()), target=target
        )
        for fraction, kind, target in steps
    ]


@dataclasses.dataclass(frozen=True)
class KillSpot:
    """Where an armed worker SIGKILLs itself: at a fault point, or from a timer started there."""

    name: str
    """How the report names it (``kills at NAME``)."""
    point: faults.Point
    timer_s: float = 0.0
    """0: at the point. Else a timer started there kills within this many seconds, while
    the code goes on: a crash *during* the step that follows the point."""
    passes: int = 8
    """An armed worker dies at one of its first this many passes."""

    def rule(self, nth: int) -> faults.Rule:
        """The fault rule that kills here at the ``nth`` pass."""
        return faults.Rule(self.point, "kill", self.timer_s, nth=nth)


HANDLER_SPOTS: tuple[KillSpot, ...] = tuple(
    # during_ack dies from a timer while the ack and its reply are on the wire.
    KillSpot(point, point, 0.004 if point == "during_ack" else 0.0)
    for point in faults.DELIVERY_POINTS
)
"""The spots of a delivery, from fetch to ack: every scenario with armed workers."""

RELAY_SPOTS: tuple[KillSpot, ...] = (
    # Within a leader's first rounds: a leader is rare (one at a time, a takeover waits
    # for the lease), and each of its deaths is the hazard.
    KillSpot("relay_after_publish", "relay_after_publish", passes=3),
    # The mark is one short transaction: a timer of up to 50 ms lands in it, or just
    # after it (a crash between the mark and the next round).
    KillSpot("relay_during_mark", "relay_after_publish", 0.05, passes=3),
    KillSpot("relay_after_mark", "relay_after_mark", passes=3),
)
"""The outbox relay's spots: after its messages are published but not marked, during
the mark, after it. They fire only in the worker whose relay leads, and only when
there are rows to publish (the ``pipeline`` scenario)."""


def spot_name(point: str, timer_s: float) -> str:
    """The spot a ``fault.hit`` kill line names (its point and timer), else the point."""
    for spot in (*HANDLER_SPOTS, *RELAY_SPOTS):
        if spot.point == point and spot.timer_s == timer_s:
            return spot.name
    return point


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    """The fault points armed in one worker incarnation."""

    rules: tuple[faults.Rule, ...]
    seed: int
    spots: tuple[str, ...] = ()
    """The names of the kill spots armed (it dies at the first one it passes)."""
    staller: bool = False
    """It holds claims past AckWait (:func:`worker_plan`)."""

    @property
    def kill_point(self) -> faults.Point | None:
        """The point this incarnation is planned to die at first, if any."""
        return next((r.point for r in self.rules if r.action == "kill"), None)

    def env(self) -> dict[str, str]:
        """The environment variables that arm it."""
        if not self.rules:
            return {}
        spec = ",".join(rule.render() for rule in self.rules)
        return {faults.FAULTS_VAR: spec, faults.SEED_VAR: str(self.seed)}


def kill_plan(
    seed: int,
    incarnation: int,
    spots: Sequence[KillSpot],
    *,
    first_pass: Sequence[KillSpot] = (),
) -> WorkerPlan:
    """Only kills at ``spots``, each at one of its first passes, and at ``first_pass``
    spots at their first (a relay may lead for a few rounds only)."""
    rng = random.Random(f"eop-chaos-worker:{seed}:{incarnation}")
    rules = tuple(spot.rule(rng.randint(1, spot.passes)) for spot in spots)
    rules += tuple(spot.rule(1) for spot in first_pass)
    names = tuple(s.name for s in (*spots, *first_pass))
    return WorkerPlan(rules, rng.randrange(2**31), names)


def stall_plan(seed: int, incarnation: int, ack_wait_s: float) -> WorkerPlan:
    """Freeze the process at its first two claims for 2 x AckWait each.

    A live worker keeps its deliveries' leases however long a claim takes
    (eop.broker.leases): only a frozen process lets them run out while it still
    holds the claim, so that the redelivery's claim waits it out.
    """
    stall_s = round(ack_wait_s * 2.0, 2)
    rules = tuple(faults.Rule("after_claim", "freeze", stall_s, nth=n) for n in range(1, 3))
    return WorkerPlan(rules, seed + incarnation)


def worker_plan(
    seed: int,
    incarnation: int,
    spots: Sequence[KillSpot],
    *,
    ack_wait_s: float,
    stall: bool = False,
) -> WorkerPlan:
    """Arm a kill at each of ``spots`` (at a random pass), plus rare raises and stalls.

    With ``stall`` it is a staller: half its claims are held past AckWait, its
    leases renewed meanwhile (a live worker's long claim), and a few of them in a
    frozen process, past the lock timeout of the redeliveries that wait on them
    (overlapping deliveries).
    """
    rng = random.Random(f"eop-chaos-worker:{seed}:{incarnation}")
    rules: list[faults.Rule] = []
    stall_s = round(ack_wait_s * 2.0, 2)
    if stall:
        rules.append(faults.Rule("after_claim", "stall", stall_s, probability=0.5))
        rules.append(faults.Rule("before_commit", "freeze", stall_s, probability=0.02))
    rules += [spot.rule(rng.randint(1, spot.passes)) for spot in spots]
    extra = [
        faults.Rule(rng.choice(faults.DELIVERY_POINTS), "raise", probability=0.01),
        faults.Rule(rng.choice(("after_claim", "before_commit")), "stall", stall_s, 0.01),
        faults.Rule("mid_handler", "freeze", stall_s, 0.001),
    ]
    killing = {spot.point for spot in spots}
    rules += [r for r in extra if r.point not in killing]
    return WorkerPlan(tuple(rules), rng.randrange(2**31), tuple(s.name for s in spots), stall)
