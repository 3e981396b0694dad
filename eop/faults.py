"""Named fault points: places in the protocol where a test can crash, fail or stall a worker.

The protocol calls ``await faults.point("after_commit")`` at the crash points
of docs/design.md, 'The hazards'. Disarmed (the default, and always in
production) a point is one check of a module-level boolean.

Only what asks for faults arms them: a test calls :func:`arm`, and a chaos run
starts its workers through its own entry point, ``python -m eop.tools.chaos.armed
worker ...`` (:mod:`eop.tools.chaos.armed`), which calls :func:`arm_from_env` on
these variables of the worker's environment::

    EOP_FAULTS="after_commit=kill#40,mid_handler=stall:6@0.01,before_commit=raise@0.02"
    EOP_FAULT_SEED=1234

``eop worker`` and ``eop relay`` never read them to arm, so a variable left
in a production environment cannot crash a worker: they log one warning
(``fault.ignored``, :func:`warn_if_ignored`) and run disarmed.

Each rule is ``POINT=ACTION[:SECONDS](@PROBABILITY|#NTH)``: fire with that
probability at every pass, or exactly once at the NTH pass. Actions:

- ``kill``: SIGKILL this process (``kill:S`` from a timer within S seconds,
  while the code goes on: a crash *during* the step that follows);
- ``raise``: raise :class:`FaultInjected` at the point;
- ``stall:S``: sleep S seconds without blocking the event loop (a live worker's
  long step: the leases of what it holds are renewed meanwhile);
- ``freeze:S``: block the whole process for S seconds, like a long GC pause
  or a starved CPU (heartbeats stop too).

Every firing logs ``fault.hit`` (flushed before a kill), so a checker can
prove from the logs that each point was really hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Literal, get_args

from eop import errors, log

Point = Literal[
    "after_fetch",
    "after_claim",
    "mid_handler",
    "before_commit",
    "after_commit",
    "during_ack",
    "after_ack",
    "relay_after_publish",
    "relay_after_mark",
]
"""The fault points: a delivery's, in the order it passes them, then the outbox relay's."""

POINTS: tuple[Point, ...] = get_args(Point)
RELAY_POINTS: tuple[Point, ...] = ("relay_after_publish", "relay_after_mark")
"""The relay's points: passed only where outbox rows are published."""
DELIVERY_POINTS: tuple[Point, ...] = tuple(p for p in POINTS if p not in RELAY_POINTS)
"""The points every delivery passes."""

Action = Literal["kill", "raise", "stall", "freeze"]
ACTIONS: tuple[Action, ...] = get_args(Action)

FAULTS_VAR = "EOP_FAULTS"
SEED_VAR = "EOP_FAULT_SEED"


class FaultInjected(errors.EopError):
    """A fault point raised on purpose (an armed rule said ``raise``)."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one point does: an action, and when it fires."""

    point: Point
    action: Action
    seconds: float = 0.0
    """The stall or freeze duration; for ``kill``, the bound of the timer (0: at once)."""
    probability: float = 0.0
    nth: int | None = None
    """Fire exactly once, at this pass (1-based); overrides ``probability``."""

    def render(self) -> str:
        """The rule in the syntax :func:`parse` reads."""
        action = f"{self.action}:{self.seconds:g}" if self.seconds else self.action
        when = f"#{self.nth}" if self.nth is not None else f"@{self.probability:g}"
        return f"{self.point}={action}{when}"


def parse(spec: str) -> list[Rule]:
    """Parse ``EOP_FAULTS``; :class:`eop.ConfigurationError` on anything unknown."""
    rules: list[Rule] = []
    for item in (part.strip() for part in spec.split(",")):
        if item:
            rules.append(_parse_rule(item))
    return rules


def _parse_rule(item: str) -> Rule:
    point, eq, rest = item.partition("=")
    if not eq or point not in POINTS:
        raise errors.ConfigurationError(
            f"{FAULTS_VAR}: {item!r} must look like POINT=ACTION@P or POINT=ACTION#N, "
            f"with POINT one of {', '.join(POINTS)}"
        )
    nth: int | None = None
    probability = 0.0
    try:
        if "#" in rest:
            rest, _, count = rest.partition("#")
            nth = int(count)
            if nth < 1:
                raise ValueError(count)
        else:
            rest, _, chance = rest.partition("@")
            probability = float(chance)
            if not 0.0 <= probability <= 1.0:
                raise ValueError(chance)
        action, _, seconds = rest.partition(":")
        duration = float(seconds) if seconds else 0.0
    except ValueError:
        raise errors.ConfigurationError(f"{FAULTS_VAR}: cannot read {item!r}") from None
    if action not in ACTIONS:
        raise errors.ConfigurationError(
            f"{FAULTS_VAR}: unknown action {action!r} in {item!r} (one of {', '.join(ACTIONS)})"
        )
    return Rule(point, action, duration, probability, nth)


class _Armed:
    """The armed rules of this process, their pass counters and random source."""

    def __init__(self, rules: list[Rule], seed: int) -> None:
        self.rules: dict[str, list[Rule]] = {}
        for rule in rules:
            self.rules.setdefault(rule.point, []).append(rule)
        self.passes: dict[str, int] = dict.fromkeys(POINTS, 0)
        self.rng = random.Random(seed)
        self.seed = seed

    def due(self, name: str) -> Rule | None:
        self.passes[name] = count = self.passes[name] + 1
        for rule in self.rules.get(name, ()):
            if rule.nth is not None:
                if rule.nth == count:
                    return rule
            elif self.rng.random() < rule.probability:
                return rule
        return None


_armed = False
_state: _Armed | None = None


def arm(rules: list[Rule], seed: int | None = None) -> None:
    """Arm the fault points of this process (no rules: disarm)."""
    global _armed, _state
    if not rules:
        disarm()
        return
    seed = seed if seed is not None else random.randrange(2**32)
    _state = _Armed(rules, seed)
    _armed = True
    log.get_logger().warning(
        log.Event.FAULT_ARMED, faults=",".join(r.render() for r in rules), seed=seed
    )


def arm_from_env(environ: Mapping[str, str] | None = None) -> None:
    """Arm from ``EOP_FAULTS`` and ``EOP_FAULT_SEED``.

    What the chaos entry point :mod:`eop.tools.chaos.armed` does at start; never
    ``eop worker`` or ``eop relay`` (see the module docstring).
    """
    environ = os.environ if environ is None else environ
    spec = environ.get(FAULTS_VAR, "")
    if not spec.strip():
        return
    raw_seed = environ.get(SEED_VAR)
    try:
        seed = int(raw_seed) if raw_seed else None
    except ValueError:
        raise errors.ConfigurationError(f"{SEED_VAR}={raw_seed!r} is not an integer") from None
    arm(parse(spec), seed)


def warn_if_ignored(environ: Mapping[str, str] | None = None) -> None:
    """Log ``fault.ignored`` if ``EOP_FAULTS`` is set while this process runs disarmed.

    ``eop worker`` and ``eop relay`` call it at start: they never arm from the
    environment, and an operator who set the variable should learn that it
    does nothing rather than believe the faults are injected.
    """
    environ = os.environ if environ is None else environ
    if _armed or not environ.get(FAULTS_VAR, "").strip():
        return
    log.get_logger().warning(
        log.Event.FAULT_IGNORED,
        variable=FAULTS_VAR,
        detail="fault points are armed by the chaos harness only; this process runs disarmed",
    )


def disarm() -> None:
    """Disarm every fault point of this process."""
    global _armed, _state
    _armed = False
    _state = None


def armed() -> bool:
    """Whether any fault point of this process is armed."""
    return _armed


def ruled(name: Point) -> bool:
    """Whether an armed rule names this point: if not, passing it does nothing at all."""
    state = _state
    return _armed and state is not None and name in state.rules


async def point(name: Point) -> None:
    """A fault point: nothing at all unless armed (see the module docstring)."""
    if not _armed:
        return
    state = _state
    if state is None:
        return
    rule = state.due(name)
    if rule is None:
        return
    await _fire(rule, state.passes[name])


async def _fire(rule: Rule, passes: int) -> None:
    logger = log.get_logger()
    logger.warning(
        log.Event.FAULT_HIT,
        point=rule.point,
        action=rule.action,
        seconds=rule.seconds,
        passes=passes,
        pid=os.getpid(),
    )
    if rule.action == "kill":
        if rule.seconds > 0 and _state is not None:
            # A crash in the middle of the next step (the ack on the wire, its
            # reply on the way back), not before it.
            delay = _state.rng.uniform(0.0, rule.seconds)
            timer = threading.Timer(delay, _kill_self)
            timer.daemon = True
            timer.start()
            return
        _kill_self()
    elif rule.action == "raise":
        raise FaultInjected(f"fault injected at {rule.point}")
    elif rule.action == "stall":
        await asyncio.sleep(rule.seconds)
    else:
        # Blocks the event loop on purpose: nothing of this process moves.
        time.sleep(rule.seconds)  # noqa: ASYNC251  # the point of a freeze


def _kill_self() -> None:
    # The hit was logged; make sure it reached the file before the process vanishes.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os.kill(os.getpid(), signal.SIGKILL)
