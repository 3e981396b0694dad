"""The metrics and health of a worker's processes, gathered and served on its one port.

``eop worker --processes N --metrics-port P`` serves ``/metrics``, ``/healthz``
and ``/readyz`` on P from the supervisor, whatever N is, so that a Prometheus
scrape or a Kubernetes probe of P sees the whole worker:

- the supervisor makes a fresh directory and names it to every process in
  ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode, where
  each process writes its values) and in ``--metrics-dir`` (where each writes
  its readiness, :mod:`eop.observe.reports`);
- ``/metrics`` sums the counters and histograms of every process that ran
  (a restarted worker starts from zero, as one process does), and the
  in-flight gauge over the live ones;
- ``/healthz`` and ``/readyz`` hold only when they hold for every process;
- a process that exits is marked dead (its gauges dropped); the directory is
  removed when the supervisor ends, and, should the supervisor itself be
  killed, by the next supervisor started on the machine (each directory
  names its owner, as the embedded servers' scratch directories do).

The server runs on a thread of the supervisor with its own event loop: the
supervisor's main thread waits on its children.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from pathlib import Path
from types import TracebackType

from eop import scratch_owners
from eop.observe import health, metrics, reports

_STOP_TIMEOUT_S = 5.0
_PREFIX = "eop-metrics-"


class Gathered:
    """The directory the processes write to and the server that reads it.

    Binding the port comes first, before any process starts: a port in use is
    a :class:`eop.ConfigurationError` with nothing to stop.
    """

    def __init__(self, host: str, port: int) -> None:
        metrics.require()
        self._sock = health.bind(host, port)
        remove_orphans(Path(tempfile.gettempdir()))
        self.directory = tempfile.mkdtemp(prefix=_PREFIX)
        scratch_owners.mark_owner(Path(self.directory))
        self.combined = reports.Combined(self.directory)
        self.host = host
        self.port = int(self._sock.getsockname()[1])
        """The bound port."""
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._serving = threading.Event()

    def env(self) -> dict[str, str]:
        """What a process's environment adds: prometheus_client's multiprocess directory."""
        return {metrics.MULTIPROCESS_DIR_VAR: self.directory}

    def started(self, pid: int) -> None:
        """A process was started."""
        self.combined.started(pid)

    def gone(self, pid: int) -> None:
        """A process exited: not live, not ready; its gauges are dropped."""
        self.combined.gone(pid)
        metrics.process_gone(self.directory, pid)

    def serve(self) -> None:
        """Serve on a thread of its own (after the processes were started: no fork with it)."""
        self._thread = threading.Thread(target=self._run, name="eop-metrics", daemon=True)
        self._thread.start()
        self._serving.wait(_STOP_TIMEOUT_S)

    def close(self) -> None:
        """Stop serving and remove the directory."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(_STOP_TIMEOUT_S)
        self._sock.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Gathered:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        endpoints = health.Endpoints(
            host=self.host,
            port=self.port,
            metrics=lambda: metrics.render_directory(self.directory),
            readiness=self.combined,
            live=self.combined.live,
        )
        await endpoints.start(sock=self._sock)
        self._serving.set()
        try:
            await self._stop.wait()
        finally:
            await endpoints.close()


def remove_orphans(parent: Path) -> list[Path]:
    """Remove the directories in ``parent`` of supervisors that died; returns them.

    A supervisor killed with SIGKILL cannot remove its directory. Only a
    directory whose owner is known to be gone is removed
    (:func:`eop.scratch_owners.owner_gone`): not a live one, nor one of another pid
    namespace (a container sharing ``/tmp``).
    """
    removed = []
    for directory in parent.glob(f"{_PREFIX}*"):
        if scratch_owners.owner_gone(directory):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed
