"""The worker processes of a chaos run: real ``python -m eop worker`` subprocesses.

A fixed number of slots each hold one incarnation at a time. An incarnation
that dies (SIGKILLed by the harness or by its own fault point, or exiting at
start because a server is down) is replaced by a new one, armed with the next
:class:`~eop.chaos.schedule.WorkerPlan`. Each incarnation logs JSON lines to a
file of its own.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from eop import faults
from eop.chaos import schedule

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


class WorkerPool:
    """``count`` worker slots running ``app``'s ``handler`` with ``env``."""

    def __init__(
        self,
        *,
        app: str,
        handler: str,
        env: Mapping[str, str],
        log_dir: Path,
        count: int,
        seed: int,
        ack_wait_s: float,
        args: Sequence[str] = (),
        batch_mode: BatchMode = "mixed",
    ) -> None:
        self.app, self.handler = app, handler
        self.env = dict(env)
        self.log_dir = log_dir
        self.seed = seed
        self.ack_wait_s = ack_wait_s
        self.args = list(args)
        self.batch_mode = batch_mode
        self.arming = True
        """Whether new incarnations get fault points (off once the run heals)."""
        self.top_up: list[faults.Point] = []
        self.stall_top_up = False
        self.slots: list[Incarnation | None] = [None] * count
        self.incarnations: list[Incarnation] = []
        self.kills_fired: collections.Counter[str] = collections.Counter()
        self.exits: collections.Counter[str] = collections.Counter()
        self._respawn_at: dict[int, float] = {}

    def start(self) -> None:
        """Start every slot."""
        for slot in range(len(self.slots)):
            self._spawn(slot)

    def _next_kill_point(self, slot: int, number: int) -> faults.Point | None:
        # The first slot hosts stallers (schedule.worker_plan): with one always
        # there, every calm spell sees a claim held past AckWait. The others die
        # at the fault point that has fired least so far: all get hit early.
        if slot == 0 and len(self.slots) > 1:
            return None
        fewest = min(self.kills_fired[p] for p in faults.POINTS)
        choices = [p for p in faults.POINTS if self.kills_fired[p] == fewest]
        return choices[number % len(choices)]

    def _spawn(self, slot: int) -> Incarnation:
        number = len(self.incarnations)
        plan = schedule.WorkerPlan((), 0)
        if self.arming:
            point = self._next_kill_point(slot, number)
            plan = schedule.worker_plan(self.seed, number, point, ack_wait_s=self.ack_wait_s)
        elif self.stall_top_up:
            self.stall_top_up = False
            plan = schedule.stall_plan(self.seed, number, self.ack_wait_s)
        elif self.top_up:
            plan = schedule.kill_plan(self.seed, number, self.top_up.pop(0))
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
        if plan.rules and plan.kill_point is None:
            # A staller holds twice the claims: more overlaps per calm spell.
            env["EOP_CONCURRENCY"] = str(2 * int(env.get("EOP_CONCURRENCY", "4")))
        # One process per worker: the harness kills and stops worker processes by PID.
        argv = [sys.executable, "-m", "eop", "worker", self.app, "--handler", self.handler]
        argv += ["--processes", "1"]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*argv, *self.args], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        inc = Incarnation(number, slot, proc, plan, log)
        self.incarnations.append(inc)
        self.slots[slot] = inc
        return inc

    def kill(self, slot: int) -> bool:
        """SIGKILL the worker in ``slot``; False if it was not running."""
        inc = self.slots[slot]
        if inc is None or inc.proc.poll() is not None:
            return False
        inc.killed_by_harness = True
        with contextlib.suppress(ProcessLookupError):
            inc.proc.send_signal(signal.SIGKILL)
        return True

    def pause(self, slot: int) -> Incarnation | None:
        """SIGSTOP the worker in ``slot``; returns it, to :meth:`resume` later."""
        inc = self.slots[slot]
        if inc is None or inc.stopped or inc.proc.poll() is not None:
            return None
        inc.stopped = True
        with contextlib.suppress(ProcessLookupError):
            inc.proc.send_signal(signal.SIGSTOP)
        return inc

    def resume(self, inc: Incarnation) -> None:
        """SIGCONT a paused worker."""
        if inc.stopped:
            inc.stopped = False
            with contextlib.suppress(ProcessLookupError):
                inc.proc.send_signal(signal.SIGCONT)

    def poll(self) -> None:
        """Record exited workers and replace them (after a short pause if they failed fast)."""
        now = time.monotonic()
        for slot, inc in enumerate(self.slots):
            if inc is None:
                if now >= self._respawn_at.get(slot, 0.0):
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
            if inc.plan.kill_point is not None:
                self.kills_fired[inc.plan.kill_point] += 1
        else:
            self.exits[f"exit_{code}"] += 1

    def running(self) -> list[Incarnation]:
        """The incarnations alive now."""
        return [inc for inc in self.slots if inc is not None and inc.proc.poll() is None]

    def resume_all(self) -> None:
        """SIGCONT every paused worker."""
        for inc in self.incarnations:
            self.resume(inc)

    def replace_all(self, *, stall: bool = False) -> None:
        """Stop every worker gracefully (SIGTERM) and start unarmed ones (the heal step).

        A fault point that no worker died at yet gets one last worker armed
        to die there early in the drain, where the backlog passes every point;
        with ``stall``, one more holds its first claims past AckWait.
        """
        self.arming = False
        self.top_up = [p for p in faults.POINTS if not self.kills_fired[p]]
        self.stall_top_up = stall
        self.resume_all()
        old = self.running()
        for inc in old:
            inc.proc.send_signal(signal.SIGTERM)
        for inc in old:
            self._wait(inc, 30.0)
        self.poll()

    def stop_all(self, timeout_s: float = 30.0, start_wait_s: float = 20.0) -> dict[int, int]:
        """SIGTERM every worker and wait; returns exit codes by incarnation number.

        A worker started a moment ago may still be importing, before its
        SIGTERM handler exists, and would die of the signal: that proves
        nothing about a graceful stop, so each gets up to ``start_wait_s`` to
        log ``worker.starting`` (handlers installed) first.
        """
        self.resume_all()
        alive = self.running()
        deadline = time.monotonic() + start_wait_s
        for inc in alive:
            while inc.proc.poll() is None and time.monotonic() < deadline and not _starting(inc):
                time.sleep(0.05)
        for inc in alive:
            inc.proc.send_signal(signal.SIGTERM)
        codes = {inc.number: self._wait(inc, timeout_s) for inc in alive}
        self.slots = [None] * len(self.slots)
        return codes

    def _wait(self, inc: Incarnation, timeout_s: float) -> int:
        try:
            code = inc.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
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
                with contextlib.suppress(ProcessLookupError):
                    os.kill(inc.proc.pid, signal.SIGCONT)
                inc.proc.kill()
                inc.proc.wait()


def _starting(inc: Incarnation) -> bool:
    """Whether the worker logged ``worker.starting``: its signal handlers are installed."""
    try:
        return b'"worker.starting"' in inc.log.read_bytes()
    except OSError:
        return False
