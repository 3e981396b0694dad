"""PostgreSQL held to a share of the CPU, for ``eop bench --pg-cpus``: the fleet's ceiling.

Workers scale out; the PostgreSQL primary does not. To find the rate at
which it saturates, the bench's own PostgreSQL (its postmaster and every
process it forks) is put in a cgroup with a CPU quota (``cpus`` cores: 0.5
is half of one), and the runs push it past that. The rate it then sustains,
divided by ``cpus``, is what one PostgreSQL core serves for that consumer.
A quota below one core lets a 2-core machine saturate PostgreSQL with the
workers' share left over; where the workers cannot saturate it, the figure
says so instead of a ceiling.

Linux cgroups, v2 (``cpu.max``) or v1 (``cpu.cfs_quota_us``), written as
root (or by a user the cgroup was delegated to); anything else is one clear
error.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from eop import errors

_ROOT = Path("/sys/fs/cgroup")
_PERIOD_US = 100_000


class CpuLimitUnavailable(errors.EopError):
    """The CPU quota cannot be set on this machine."""


def _group_dir(name: str) -> tuple[Path, bool]:
    """Where a new cgroup named ``name`` goes, and whether it is cgroup v2."""
    if (_ROOT / "cgroup.controllers").exists():
        return _ROOT / name, True
    if (_ROOT / "cpu" / "cpu.cfs_period_us").exists():
        return _ROOT / "cpu" / name, False
    raise CpuLimitUnavailable(
        f"no cgroup CPU controller under {_ROOT}: --pg-cpus needs Linux cgroups "
        "(run the bench as root, or without --pg-cpus)"
    )


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


@contextlib.contextmanager
def limited(pid: int, cpus: float) -> Iterator[Path]:
    """Hold ``pid`` and its descendants (present and future) to ``cpus`` cores."""
    if cpus <= 0:
        raise CpuLimitUnavailable(f"--pg-cpus must be above 0, not {cpus:g}")
    group, v2 = _group_dir(f"eop-bench-pg-{os.getpid()}")
    quota_us = max(1_000, int(cpus * _PERIOD_US))
    try:
        group.mkdir()
        if v2:
            (group / "cpu.max").write_text(f"{quota_us} {_PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota_us))
        for member in _descendants(pid):
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):
                (group / "cgroup.procs").write_text(str(member))
    except PermissionError as exc:
        raise CpuLimitUnavailable(
            f"cannot set a CPU quota in {group.parent} ({exc.strerror}): --pg-cpus needs root "
            "or a delegated cgroup"
        ) from exc
    except OSError as exc:
        raise CpuLimitUnavailable(f"cannot set a CPU quota in {group}: {exc}") from exc
    try:
        yield group
    finally:
        parent = group.parent / "cgroup.procs"
        with contextlib.suppress(OSError):
            for pid_text in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    parent.write_text(pid_text)
        with contextlib.suppress(OSError):
            group.rmdir()
