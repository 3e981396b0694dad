"""The health of a worker of several processes, served by its supervisor on one port.

Each process of ``eop worker --processes N`` runs a :class:`Reporter`: every
:data:`REPORT_INTERVAL_S` it writes its readiness checks to
``health-<pid>.json`` in the directory the supervisor gave it (the same one
prometheus_client's multiprocess mode keeps its metrics in). The supervisor's
:class:`Combined` reads them for ``/healthz`` and ``/readyz``:

- live when every process is running and its loop answers: it reported within
  :data:`STALE_S` (or it started less than :data:`START_GRACE_S` ago);
- ready when, in addition, every process reports every check ``ok``.

A process that is gone (exited, killed) makes the worker neither: the
supervisor is about to stop the others anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from eop.observe.health import Checks

REPORT_INTERVAL_S = 1.0
"""How often a process writes its readiness."""
STALE_S = 10.0
"""A report older than this: the process's event loop no longer answers."""
START_GRACE_S = 30.0
"""How long a new process may take to write its first report (imports, a slow disk)."""


def report_path(directory: str | Path, pid: int) -> Path:
    """Where process ``pid`` writes its report."""
    return Path(directory) / f"health-{pid}.json"


class Reporter:
    """One process's side: its readiness checks, written to the shared directory."""

    def __init__(self, directory: str, readiness: Checks) -> None:
        self.path = report_path(directory, os.getpid())
        self.readiness = readiness
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Write a first report now, then every :data:`REPORT_INTERVAL_S`."""
        await self._report()
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        """Stop reporting and remove the report: a stopped process is not ready."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(OSError):
            self.path.unlink()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            await self._report()

    async def _report(self) -> None:
        checks = await self.readiness.check()
        text = json.dumps({"at": time.time(), "checks": checks})
        # Written aside, then renamed: the supervisor never reads half a report.
        partial = self.path.with_suffix(".partial")
        with contextlib.suppress(OSError):
            partial.write_text(text)
            partial.replace(self.path)


class Combined:
    """The supervisor's side: the health of every process, from their reports."""

    def __init__(self, directory: str, *, clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self._clock = clock
        self._started: dict[int, float] = {}
        self._gone: set[int] = set()

    def started(self, pid: int) -> None:
        """Process ``pid`` was started (it counts as live for :data:`START_GRACE_S`)."""
        self._started[pid] = self._clock()

    def gone(self, pid: int) -> None:
        """Process ``pid`` has exited."""
        self._gone.add(pid)

    def live(self) -> bool:
        """Every process runs and answers (or is still starting)."""
        now = self._clock()
        for pid, started_at in list(self._started.items()):
            report = self._read(pid)
            if pid in self._gone:
                return False
            if report is None:
                if now - started_at > START_GRACE_S:
                    return False
            elif now - report[0] > STALE_S:
                return False
        return bool(self._started)

    async def check(self) -> dict[str, bool]:
        """``processes_running``, ``processes_answering``, then each check over all processes."""
        now = self._clock()
        pids = list(self._started)
        reports = {pid: self._read(pid) for pid in pids}
        fresh = {pid: r[1] for pid, r in reports.items() if r is not None and now - r[0] <= STALE_S}
        combined = {
            "processes_running": bool(pids) and not self._gone.intersection(pids),
            "processes_answering": len(fresh) == len(pids),
        }
        for checks in fresh.values():
            for name, ok in checks.items():
                combined[name] = combined.get(name, True) and ok
        return combined

    def _read(self, pid: int) -> tuple[float, dict[str, bool]] | None:
        try:
            report = json.loads(report_path(self.directory, pid).read_text())
            return float(report["at"]), {str(k): bool(v) for k, v in report["checks"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
