"""CPU time of processes and their children, from /proc, for ``eop bench``'s figures
a message."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


class ProcStat(NamedTuple):
    """A process's parent and CPU seconds so far: its own, and its reaped children's."""

    ppid: int
    own_s: float
    reaped_s: float


def snapshot() -> dict[int, ProcStat]:
    """Every process's parent and CPU time (user + system), from /proc.

    A process's own time is its threads' scheduler run time in nanoseconds
    (``/proc/PID/task/TID/schedstat``). ``/proc/PID/stat`` gives it in clock
    ticks, 10 ms at 100 Hz: a drain of 20,000 messages at 10 µs each costs
    PostgreSQL 200 ms spread over a dozen backends, and each backend's
    difference read in ticks moved the figure by several percent. The reaped
    children's time (a connection closed, an autovacuum worker done) exists
    only in ticks. A thread that exits takes its run time with it; the
    processes measured keep theirs (PostgreSQL's are single-threaded).
    """
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[int, ProcStat] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
            own = (int(fields[11]) + int(fields[12])) / tick
            reaped = (int(fields[13]) + int(fields[14])) / tick
            found[int(entry.parent.name)] = ProcStat(
                int(fields[1]), _or(_run_time_s(entry.parent), own), reaped
            )
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not readable
    return found


def _run_time_s(proc: Path) -> float | None:
    """The process's threads' run time in seconds, from the scheduler; None if unknown
    (a kernel without schedstat, or the process gone)."""
    try:
        tasks = list((proc / "task").iterdir())
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except FileNotFoundError:
            continue  # a thread that exited meanwhile
        except (OSError, IndexError, ValueError):
            return None
    return total / 1e9


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def tree_cpu_s(pid: int | None, stats: dict[int, ProcStat] | None = None) -> float | None:
    """CPU seconds of process ``pid`` and its children, the exited ones included.

    PostgreSQL's backends are the postmaster's children; one that exits (a
    connection closed) is counted in the postmaster's reaped time from then
    on. None if unknown (not Linux, or not running).
    """
    stats = snapshot() if stats is None else stats
    if pid is None or pid not in stats:
        return None
    seconds = stats[pid].own_s + stats[pid].reaped_s
    return seconds + sum(s.own_s for s in stats.values() if s.ppid == pid)
