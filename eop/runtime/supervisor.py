"""Several worker processes under one ``eop worker``: started together, stopped together.

One Python process runs one core at most, and eop's per-message work (the
claim, the confirmed ack, the handler) is CPU work. ``eop worker`` therefore
starts ``processes`` ordinary worker processes on the same durable consumers,
as an operator starting that many ``eop worker`` commands would: every
guarantee of a worker holds for each, and JetStream spreads the messages.

The supervisor is deliberately small:

- Each child is ``eop worker`` again, with the same arguments plus
  ``--processes 1`` and its share of the worker's database connections
  (``--db-pool-size``, unless set), through the same entry point:
  ``python -m eop``, or the chaos harness's :mod:`eop.tools.chaos.armed`, whose
  children arm their fault points too.
- With ``--metrics-port P``, the supervisor alone serves P: the children write
  their metrics and readiness to a directory it reads
  (:mod:`eop.runtime.gathered`), and serve nothing.
- Every child runs every handler: an ordered handler's partitions are shared
  out among all the processes that run it, here and on other machines
  (:mod:`eop.ordering.share`).
- SIGTERM and SIGINT are passed on to every child. A child that exits on its
  own (a fatal error, or killed) stops the others with SIGTERM, and the
  supervisor exits with that first child's status: an orchestrator restarts
  the whole worker rather than running it short of a process.
- A child's ``eop: error:`` lines come to the supervisor (``--error-file``),
  which prints each distinct one once as its child exits: processes that all
  meet the same misconfiguration give the user one line, not one each.
- A stop ends: children still running well after their own stop deadline
  (:func:`eop.runtime.shutdown.deadline_s`, after which they end themselves) are
  killed with SIGKILL.
- The children die with the supervisor (Linux's parent-death signal, SIGTERM),
  so a supervisor killed with SIGKILL leaves no worker running behind it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from eop import log
from eop.runtime import gathered

MAX_AUTO_PROCESSES = 4
"""The most processes ``processes=0`` starts: each holds its own connections."""

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.05
# Flags whose value the supervisor sets per child; stripped from the arguments it passes on.
_PER_CHILD_FLAGS = (
    "--processes",
    "--handler",
    "--metrics-port",
    "--metrics-dir",
    "--db-pool-size",
    "--error-file",
)


def available_cpus(cgroup_cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota.

    A container limited to 1.5 CPUs on a 32-core node sees 32 cores but gets
    1.5 of them; ``cpu.max`` says so (``150000 100000``).
    """
    # No affinity on macOS and Windows: every core then.
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    with contextlib.suppress(OSError, ValueError, IndexError):
        quota, period = cgroup_cpu_max.read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    return max(1, cpus)


def process_count(setting: int) -> int:
    """``processes`` resolved: the setting, or for 0, :func:`available_cpus` up to the cap."""
    return setting if setting > 0 else min(available_cpus(), MAX_AUTO_PROCESSES)


@dataclasses.dataclass(frozen=True)
class Child:
    """What one child process runs."""

    handlers: tuple[str, ...]
    db_pool_size: int


def plan(count: int, handlers: Sequence[tuple[str, bool]], db_pool_size: int) -> list[Child]:
    """The children for ``count`` processes and ``(name, ordered)`` handlers.

    Every child runs every handler, ordered ones included (their partitions
    are shared out among the processes). Each keeps ``db_pool_size`` connections.
    """
    everything = tuple(name for name, _ in handlers)
    return [Child(everything, db_pool_size) for _ in range(count)]


def child_argv(argv: Sequence[str], child: Child, metrics_dir: str | None = None) -> list[str]:
    """The ``eop`` arguments of a child: ``argv`` without its per-child flags, then the child's.

    With ``metrics_dir`` the child reports its metrics and readiness there
    (``--metrics-dir``) and serves nothing (``--metrics-port 0``).
    """
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _PER_CHILD_FLAGS:
            skip = True
            continue
        if arg.startswith(tuple(f"{flag}=" for flag in _PER_CHILD_FLAGS)):
            continue
        kept.append(arg)
    kept += ["--processes", "1"]
    for name in child.handlers:
        kept += ["--handler", name]
    if metrics_dir is not None:
        # 0 given, not left out: EOP_METRICS_PORT in the environment must not reach a child.
        kept += ["--metrics-port", "0", "--metrics-dir", metrics_dir]
    kept += ["--db-pool-size", str(child.db_pool_size)]
    return kept


def supervise(
    argvs: Sequence[Sequence[str]],
    stop_deadline_s: float | None = None,
    served: gathered.Gathered | None = None,
    program: Sequence[str] | None = None,
) -> int:
    """Run one ``eop`` child per argument list until they have all exited; the exit status.

    Each child is ``program`` (default: ``python -m eop``) with its arguments.

    0 when every child exited 0 (after a SIGTERM or SIGINT passed on to them);
    otherwise the status of the first child that exited by itself, or else the
    first non-zero status of a stopped child (128 + the signal number for a
    child killed by a signal, except by the SIGTERM or SIGINT passed on: a child
    still importing when the stop came dies of it, having taken no message,
    which is a stop as asked, not a failure). Once stopping, children still running
    ``stop_deadline_s`` later (their own deadline has passed: they should have
    ended themselves) are killed with SIGKILL. With ``served``, the children's
    metrics and health are served on its port until they have all exited.
    """
    try:
        made = tempfile.TemporaryDirectory(prefix="eop-errors-")
    except OSError:
        # No writable temporary directory (a read-only root filesystem without a /tmp
        # volume): each process prints its own errors, as a lone process does.
        return _supervise(argvs, None, stop_deadline_s, served, program)
    with made as errors_dir:
        return _supervise(argvs, Path(errors_dir), stop_deadline_s, served, program)


def _supervise(
    argvs: Sequence[Sequence[str]],
    errors_dir: Path | None,
    stop_deadline_s: float | None,
    served: gathered.Gathered | None,
    program: Sequence[str] | None,
) -> int:
    logger = log.get_logger()
    env = {**os.environ, **(served.env() if served is not None else {})}
    command = list(program) if program else [sys.executable, "-m", "eop"]
    files = [None if errors_dir is None else errors_dir / str(i) for i in range(len(argvs))]
    children = [
        subprocess.Popen(
            [*command, *argv, *(["--error-file", str(file)] if file is not None else [])],
            preexec_fn=_die_with_parent(os.getpid()),
            env=env,
        )
        for argv, file in zip(argvs, files, strict=True)
    ]
    error_files = {c.pid: file for c, file in zip(children, files, strict=True)}
    printed: set[str] = set()
    logger.info(log.Event.PROCESSES_STARTED, pids=[c.pid for c in children])
    if served is not None:
        for child in children:
            served.started(child.pid)
        served.serve()
    running = {c.pid: c for c in children}
    stop = _Stop()

    def pass_on(signum: int, _: Any) -> None:
        stop.begin()
        _signal_all(running.values(), signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while running:
            pid, returncode = _wait_any(running)
            if pid is None:
                if stop.overdue(stop_deadline_s):
                    _signal_all(running.values(), signal.SIGKILL)
                continue
            if running.pop(pid, None) is None:
                continue
            code = _exit_code(returncode)
            _print_once(error_files[pid], printed)
            if served is not None:
                served.gone(pid)  # before the line: once it is logged, /readyz says so
            _log_exit(logger, stop, pid, code, returncode)
            if not stop.started:
                # A child ended by itself: the worker is not whole any more.
                stop.begin()
                stop.first_failure = code or 1
                _signal_all(running.values(), signal.SIGTERM)
            elif code != 0 and stop.first_failure is None and returncode not in _STOP_DEATHS:
                stop.first_failure = code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return stop.first_failure or 0


def _print_once(error_file: Path | None, printed: set[str]) -> None:
    """The ``eop: error:`` lines an exited child wrote, on stderr unless already printed."""
    if error_file is None:
        return
    try:
        report = error_file.read_text()
    except OSError:  # it met no error of its own
        return
    key = _said(report)
    if report and key not in printed:
        printed.add(key)
        sys.stderr.write(report)
        sys.stderr.flush()


def _said(report: str) -> str:
    """What a report says: a JSON line's error and causes, without its pid and time."""
    try:
        entry = json.loads(report)
    except ValueError:
        return report
    if not isinstance(entry, dict):
        return report
    return json.dumps([entry.get("error"), entry.get("caused_by")])


_STOP_DEATHS = (-signal.SIGTERM, -signal.SIGINT)
"""Return codes of a child killed by the stop signal the supervisor passed on."""


def _log_exit(logger: log.Logger, stop: _Stop, pid: int, code: int, returncode: int) -> None:
    """The ``processes.exited`` line: an error when a child ended by itself (a crash, a
    SIGKILL, the OOM killer), a warning when one failed its stop, else info."""
    if not stop.started:
        logger.error(log.Event.PROCESS_EXITED, pid=pid, code=code, by_itself=True)
    elif code != 0 and returncode not in _STOP_DEATHS:
        logger.warning(log.Event.PROCESS_EXITED, pid=pid, code=code)
    else:
        logger.info(log.Event.PROCESS_EXITED, pid=pid, code=code)


class _Stop:
    """When the supervisor began stopping, and the status it will exit with."""

    def __init__(self) -> None:
        self.started_at: float | None = None
        self.first_failure: int | None = None

    @property
    def started(self) -> bool:
        return self.started_at is not None

    def begin(self) -> None:
        if self.started_at is None:
            self.started_at = time.monotonic()

    def overdue(self, deadline_s: float | None) -> bool:
        return (
            deadline_s is not None
            and self.started_at is not None
            and time.monotonic() - self.started_at > deadline_s
        )


def _wait_any(running: dict[int, subprocess.Popen[bytes]]) -> tuple[int | None, int]:
    """The next child to exit and its return code, or (None, 0) after a short wait.

    Polling rather than a blocking ``waitpid``: a stop must be able to give up
    on a child that does not end. Each child is asked by its own pid: waiting for
    any child of this process (``waitpid(-1)``) found nothing for ever once
    something else in the process had reaped one of them while another child
    of its own lived on (it hung the supervisor inside a test run).
    """
    for pid, child in running.items():
        if child.poll() is not None:
            return pid, child.returncode
    time.sleep(_POLL_S)
    return None, 0


def _signal_all(children: Iterable[subprocess.Popen[bytes]], signum: int) -> None:
    for child in list(children):
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)


def _exit_code(returncode: int) -> int:
    """A shell's exit status for Popen's ``returncode``: 128 + N for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _die_with_parent(parent: int) -> Any:
    """A ``preexec_fn``: the child's own process group; SIGTERM when the supervisor dies."""
    if not sys.platform.startswith("linux"):  # pragma: no cover
        return None

    def arm() -> None:
        # A process group of its own: a terminal's Ctrl-C reaches the supervisor
        # alone, which passes it on once (a second SIGINT would mean "stop now").
        os.setpgid(0, 0)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the supervisor died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return arm
