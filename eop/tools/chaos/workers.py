"""The worker processes of a chaos run: real ``eop worker`` subprocesses, fault points armed.

Each runs ``python -m eop.tools.chaos.armed worker ...`` (:data:`ENTRY_POINT`): the
``eop worker`` command, with its fault points armed from the ``EOP_FAULTS`` its
:class:`~eop.tools.chaos.schedule.WorkerPlan` puts in its environment (``eop worker``
itself never arms them).

A fixed number of slots each hold one incarnation at a time. An incarnation
that dies (SIGKILLed by the harness or by its own fault point, or exiting at
start because a server is down) is replaced by a new one, armed with the next
:class:`~eop.tools.chaos.schedule.WorkerPlan`. Each incarnation logs JSON lines to a
file of its own.

Armed incarnations die at a kill spot (:class:`~eop.tools.chaos.schedule.KillSpot`):
always the one that has fired least so far, so all get hit early. A scenario
with ``relay_spots`` arms one of those too in every incarnation: only the
worker whose relay leads passes them, and it must not be the one that never
dies. Each slot keeps the same relay spot (given enough slots): the lease
passes from a dead leader to another slot, so each takeover tries another spot.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from eop import faults
from eop.tools.chaos import checker, schedule

ENTRY_POINT = "eop.tools.chaos.armed"
"""The module the workers run (:mod:`eop.tools.chaos.armed`; named, not imported: it is the
CLI's)."""

BatchMode = Literal["mixed", "on", "off"]
"""Which workers run one transaction per fetched batch (``--batch-transactions``)."""


@dataclasses.dataclass
class Incarnation:
    """One worker process."""

    number: int
    slot: int
    proc: subprocess.Popen[bytes]
    plan: schedule.WorkerPlan
    log: Path
    stopped: bool = False
    killed_by_harness: bool = False
    terminated_at: float | None = None
    """When the harness sent it SIGTERM (``time.monotonic()``), if it did."""
    group: bool = False
    """It leads a process group of its own (an ``eop worker --processes N`` command):
    SIGKILL, SIGSTOP and SIGCONT go to the whole group, the children too."""

    def send(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process, or to its group (not SIGTERM: that one goes to the
        leader, which passes it on, as an orchestrator's would)."""
        with contextlib.suppress(ProcessLookupError):
            if self.group and sig != signal.SIGTERM:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)


class WorkerPool:
    """``count`` worker slots running ``app``'s ``handlers`` with ``env``."""

    def __init__(
        self,
        *,
        app: str,
        handlers: Sequence[str],
        env: Mapping[str, str],
        log_dir: Path,
        count: int,
        seed: int,
        ack_wait_s: float,
        args: Sequence[str] = (),
        batch_mode: BatchMode = "mixed",
        slot_env: Callable[[int], Mapping[str, str | None]] | None = None,
        arm: bool = True,
        kill_spots: Sequence[schedule.KillSpot] = schedule.HANDLER_SPOTS,
        relay_spots: Sequence[schedule.KillSpot] = (),
        slot_args: Callable[[int], Sequence[str]] | None = None,
        active: int | None = None,
    ) -> None:
        self.app, self.handlers = app, list(handlers)
        self.kill_spots = tuple(kill_spots)
        """Armed workers die at one of these (all but the stallers)."""
        self.relay_spots = tuple(relay_spots)
        """And at one of these (every armed worker, stallers included)."""
        self.env = dict(env)
        self.slot_env = slot_env
        """Per-slot environment changes (None values unset a variable)."""
        self.grace_s = float(self.env.get("EOP_SHUTDOWN_GRACE_S") or 30.0)
        """The workers' shutdown_grace_s: a stop may take this plus 5 s."""
        self.stops: list[checker.Stop] = []
        self.log_dir = log_dir
        self.seed = seed
        self.ack_wait_s = ack_wait_s
        self.args = list(args)
        self.batch_mode = batch_mode
        self.arming = arm
        """Whether new incarnations get fault points (off once the run heals)."""
        self.top_up: list[schedule.KillSpot] = []
        self.relay_top_up = False
        self.stall_top_up = False
        self.slots: list[Incarnation | None] = [None] * count
        self.slot_args = slot_args
        """Per-slot ``eop worker`` arguments, after the pool's (``--processes 2``)."""
        self.active = count if active is None else max(1, min(active, count))
        """How many slots run a worker (:meth:`scale`); the others stay empty."""
        self.incarnations: list[Incarnation] = []
        self.kills_fired: collections.Counter[str] = collections.Counter()
        self.exits: collections.Counter[str] = collections.Counter()
        self._respawn_at: dict[int, float] = {}

    def start(self) -> None:
        """Start every active slot."""
        for slot in range(self.active):
            self._spawn(slot)

    def scale(self, count: int) -> list[Incarnation]:
        """Run ``count`` worker commands from now on (at least one, at most the slots).

        More: :meth:`poll` starts the new slots. Fewer: the workers of the slots
        beyond get SIGTERM (a paused one is resumed first, so that it can exit) and
        are returned, for the caller to time their stops; they are not replaced.
        """
        self.active = max(1, min(count, len(self.slots)))
        leaving = []
        for inc in self.slots[self.active :]:
            if inc is None or inc.proc.poll() is not None or inc.terminated_at is not None:
                continue
            self.resume(inc)
            self.send_term(inc)
            leaving.append(inc)
        return leaving

    def _active_slot(self, slot: int) -> int:
        """A fault aimed at ``slot`` hits an active one: scaled down, the pool is smaller."""
        return slot % self.active

    def _least_fired(
        self, spots: Sequence[schedule.KillSpot], number: int
    ) -> schedule.KillSpot | None:
        if not spots:
            return None
        fewest = min(self.kills_fired[s.name] for s in spots)
        choices = [s for s in spots if self.kills_fired[s.name] == fewest]
        return choices[number % len(choices)]

    def _next_spots(self, slot: int, number: int) -> tuple[list[schedule.KillSpot], bool]:
        """The kill spots of a new armed incarnation, and whether it is a staller."""
        # The first slot hosts stallers (schedule.worker_plan): with one always
        # there, every calm spell sees a claim held past AckWait.
        stall = slot == 0 and len(self.slots) > 1
        spots = [] if stall else [self._least_fired(self.kill_spots, number)]
        # Every one may lead the relay, stallers too: the leader must die at times.
        if self.relay_spots and len(self.slots) >= len(self.relay_spots):
            spots.append(self.relay_spots[slot % len(self.relay_spots)])
        else:
            spots.append(self._least_fired(self.relay_spots, number))
        return [s for s in spots if s is not None], stall

    def _unfired_relay_spot(self, slot: int) -> list[schedule.KillSpot]:
        # Spread over the slots: whichever takes the lease next carries one.
        unfired = [s for s in self.relay_spots if not self.kills_fired[s.name]]
        return [unfired[slot % len(unfired)]] if unfired else []

    def _spawn(self, slot: int) -> Incarnation:
        number = len(self.incarnations)
        plan = schedule.WorkerPlan((), 0)
        if self.arming:
            spots, stall = self._next_spots(slot, number)
            plan = schedule.worker_plan(
                self.seed, number, spots, ack_wait_s=self.ack_wait_s, stall=stall
            )
        elif self.stall_top_up:
            self.stall_top_up = False
            plan = schedule.stall_plan(self.seed, number, self.ack_wait_s)
        elif self.top_up or (self.relay_top_up and self._unfired_relay_spot(slot)):
            # The relay spots go to every drain worker until they fire: only the
            # one that takes the lease can.
            relay = self._unfired_relay_spot(slot) if self.relay_top_up else []
            plan = schedule.kill_plan(self.seed, number, self.top_up[:1], first_pass=relay)
            del self.top_up[:1]
        log = self.log_dir / f"worker-{number:04d}.log"
        env = dict(self.env)
        env.pop(faults.FAULTS_VAR, None)
        if self.batch_mode == "mixed":
            # Both protocol paths under fire: per message on even slots, one
            # transaction per fetched batch on odd ones.
            env["EOP_BATCH_TRANSACTIONS"] = "true" if slot % 2 else "false"
        else:
            env["EOP_BATCH_TRANSACTIONS"] = "true" if self.batch_mode == "on" else "false"
        env.update(plan.env())
        for name, value in (self.slot_env(slot) if self.slot_env else {}).items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        if plan.staller:
            # A staller holds twice the claims: more overlaps per calm spell.
            env["EOP_CONCURRENCY"] = str(2 * int(env.get("EOP_CONCURRENCY", "4")))
        # One process per worker: the harness kills and stops worker processes by PID.
        # A slot given --processes N leads a process group instead (Incarnation.group).
        argv = [sys.executable, "-m", ENTRY_POINT, "worker", self.app]
        for handler in self.handlers:
            argv += ["--handler", handler]
        argv += ["--processes", "1", *self.args]
        extra = list(self.slot_args(slot)) if self.slot_args else []
        group = "--processes" in extra
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*argv, *extra],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=group,
            )
        inc = Incarnation(number, slot, proc, plan, log, group=group)
        self.incarnations.append(inc)
        self.slots[slot] = inc
        return inc

    def kill(self, slot: int) -> bool:
        """SIGKILL the worker in ``slot``; False if it was not running."""
        inc = self.slots[self._active_slot(slot)]
        if inc is None or inc.proc.poll() is not None:
            return False
        inc.killed_by_harness = True
        inc.send(signal.SIGKILL)
        return True

    def pause(self, slot: int) -> Incarnation | None:
        """SIGSTOP the worker in ``slot``; returns it, to :meth:`resume` later.

        Not one that is stopping: a frozen process cannot exit, and its timed stop
        would count the pause as the worker's own stall.
        """
        inc = self.slots[self._active_slot(slot)]
        if inc is None or inc.stopped or inc.terminated_at is not None:
            return None
        if inc.proc.poll() is not None:
            return None
        inc.stopped = True
        inc.send(signal.SIGSTOP)
        return inc

    def resume(self, inc: Incarnation) -> None:
        """SIGCONT a paused worker."""
        if inc.stopped:
            inc.stopped = False
            inc.send(signal.SIGCONT)

    def poll(self) -> None:
        """Record exited workers and replace them (after a short pause if they failed fast)."""
        now = time.monotonic()
        for slot, inc in enumerate(self.slots):
            if inc is None:
                if slot < self.active and now >= self._respawn_at.get(slot, 0.0):
                    self._spawn(slot)
                continue
            code = inc.proc.poll()
            if code is None:
                continue
            self._record_exit(inc, code)
            self.slots[slot] = None
            # A worker that exits by itself met a server that is down at start:
            # give the server a moment rather than spinning.
            delay = 0.0 if code == -signal.SIGKILL else 0.5
            self._respawn_at[slot] = now + delay

    def _record_exit(self, inc: Incarnation, code: int) -> None:
        if code == -signal.SIGKILL and inc.killed_by_harness:
            self.exits["killed_by_harness"] += 1
        elif code == -signal.SIGKILL:
            self.exits["killed_at_fault_point"] += 1
            spot = _killed_at(inc)
            if spot is not None:
                self.kills_fired[spot] += 1
        else:
            self.exits[f"exit_{code}"] += 1

    def wait_started(self, timeout_s: float) -> bool:
        """Wait until the worker of every slot has logged ``worker.started`` (or time out).

        A fault aimed at running workers (a long outage, a held lock) tests
        nothing if it lands while they are still connecting.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            current = self.slots[: self.active]
            if all(inc is not None and _logged(inc, b'"worker.started"') for inc in current):
                return True
            time.sleep(0.1)
        return False

    def running(self) -> list[Incarnation]:
        """The incarnations alive now."""
        return [inc for inc in self.slots if inc is not None and inc.proc.poll() is None]

    def resume_all(self) -> None:
        """SIGCONT every paused worker."""
        for inc in self.incarnations:
            self.resume(inc)

    def replace_all(self, *, stall: bool = False) -> None:
        """Stop every worker gracefully (SIGTERM) and start unarmed ones (the heal step).

        A kill spot that no worker died at yet gets one last worker armed
        to die there early in the drain, where the backlog passes every point
        (a relay spot: every drain worker, until one dies there); with
        ``stall``, one more holds its first claims past AckWait.
        """
        armed, self.arming = self.arming, False
        # Top-ups only complete an armed run's evidence; an unarmed run stays unarmed.
        unfired = [s for s in self.kill_spots if not self.kills_fired[s.name]]
        self.top_up = unfired if armed else []
        self.relay_top_up = armed
        self.stall_top_up = stall and armed
        self.resume_all()
        self._stop(self.running(), "heal", None)
        self.poll()

    @property
    def stop_limit_s(self) -> float:
        """How long a worker may take to exit after SIGTERM: shutdown_grace_s + 5 s."""
        return self.grace_s + 5.0

    def stop_all(
        self, timeout_s: float | None = None, start_wait_s: float = 20.0
    ) -> dict[int, int]:
        """SIGTERM every worker and wait; returns exit codes by incarnation number.

        A worker started a moment ago may still be importing, before its
        SIGTERM handler exists, and would die of the signal: that proves
        nothing about a graceful stop, so each gets up to ``start_wait_s`` to
        log ``worker.starting`` (handlers installed) first. Each stop is timed
        (:attr:`stops`); one still running after ``timeout_s`` (default: the stop
        limit plus 5 s) is SIGKILLed.
        """
        self.resume_all()
        alive = self.running()
        deadline = time.monotonic() + start_wait_s
        for inc in alive:
            while inc.proc.poll() is None and time.monotonic() < deadline and not _starting(inc):
                time.sleep(0.05)
        codes = self._stop(alive, "final", timeout_s)
        self.slots = [None] * len(self.slots)
        return codes

    def _stop(
        self, incs: Sequence[Incarnation], when: str, timeout_s: float | None
    ) -> dict[int, int]:
        for inc in incs:
            self.send_term(inc)
        return {inc.number: self._wait(inc, when, timeout_s) for inc in incs}

    def send_term(self, inc: Incarnation) -> None:
        """SIGTERM ``inc`` and note when, to time its stop."""
        inc.terminated_at = time.monotonic()
        inc.send(signal.SIGTERM)

    def started(self, slot: int) -> Incarnation | None:
        """The worker in ``slot`` if it runs, is neither paused nor stopping, and has its
        signal handlers installed."""
        inc = self.slots[slot]
        if inc is None or inc.stopped or inc.terminated_at is not None:
            return None  # a stop already under way is timed once
        if inc.proc.poll() is not None or not _starting(inc):
            return None
        return inc

    def record_stop(self, inc: Incarnation, when: str, code: int | None) -> checker.Stop:
        """Time the stop of ``inc`` since its SIGTERM (``code`` None: it did not exit)."""
        sent = inc.terminated_at if inc.terminated_at is not None else time.monotonic()
        stop = checker.Stop(
            worker=inc.number,
            pid=inc.proc.pid,
            when=when,
            seconds=time.monotonic() - sent,
            code=code,
            limit_s=self.stop_limit_s + _injected_delay_s(inc.plan),
        )
        self.stops.append(stop)
        return stop

    def _wait(self, inc: Incarnation, when: str, timeout_s: float | None) -> int:
        limit = self.stop_limit_s + 5.0 if timeout_s is None else timeout_s
        sent = inc.terminated_at or time.monotonic()
        try:
            code = inc.proc.wait(max(0.0, sent + limit - time.monotonic()))
            self.record_stop(inc, when, code)
        except subprocess.TimeoutExpired:
            self.record_stop(inc, when, None)
            inc.proc.kill()
            code = inc.proc.wait()
            self.exits["hung_at_stop"] += 1
        self._record_exit(inc, code)
        if self.slots[inc.slot] is inc:
            self.slots[inc.slot] = None
            self._respawn_at[inc.slot] = 0.0
        return code

    def logs(self) -> list[Path]:
        """Every incarnation's log file."""
        return [inc.log for inc in self.incarnations]

    def close(self) -> None:
        """SIGKILL whatever still runs (after a failure of the harness itself)."""
        for inc in self.incarnations:
            if inc.proc.poll() is None:
                inc.send(signal.SIGCONT)
                inc.send(signal.SIGKILL)
                inc.proc.wait()


def _injected_delay_s(plan: schedule.WorkerPlan) -> float:
    """The longest stall or freeze the plan may put in the way of a stop: the harness's own."""
    return max((r.seconds for r in plan.rules if r.action in ("stall", "freeze")), default=0.0)


def _killed_at(inc: Incarnation, tail_bytes: int = 256 * 1024) -> str | None:
    """The kill spot ``inc`` died at: its last ``fault.hit`` kill line (a timer's kill
    lets a few more lines through)."""
    try:
        with inc.log.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - tail_bytes))
            lines = log.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"fault.hit"' not in line or '"kill"' not in line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("action") == "kill":
            return schedule.spot_name(str(record.get("point")), float(record.get("seconds") or 0))
    return None


def _starting(inc: Incarnation) -> bool:
    """Whether the worker logged ``worker.starting``: its signal handlers are installed."""
    return _logged(inc, b'"worker.starting"')


def _logged(inc: Incarnation, needle: bytes) -> bool:
    try:
        return needle in inc.log.read_bytes()
    except OSError:
        return False
