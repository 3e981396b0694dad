"""What a worker reports about itself: metrics, health endpoints and traces, per settings.

:class:`Telemetry` builds the worker's :class:`eop.observe.Observer` from its
settings (``metrics_port``, ``tracing``) and runs the HTTP endpoint of
:mod:`eop.health` while the worker runs. With the port at 0 and tracing off
or OpenTelemetry absent, the observer is :data:`eop.observe.NOOP` and no
server is started.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eop import health, metrics, observe, sql, tracing, wire

if TYPE_CHECKING:
    from eop.worker import Worker


class Telemetry:
    """The observers and the HTTP endpoint of one worker."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        s = worker.settings
        observers: list[observe.Observer] = []
        self.metrics: metrics.WorkerMetrics | None = None
        self.endpoints: health.Endpoints | None = None
        if s.metrics_port:
            self.metrics = metrics.WorkerMetrics(worker.specs)
            readiness = health.Readiness(
                bound=lambda: worker.ready.is_set(),
                draining=lambda: worker.draining,
                nats_connected=self._nats_connected,
                ping=self._ping,
            )
            self.endpoints = health.Endpoints(
                host=s.metrics_host,
                port=s.metrics_port,
                registry=self.metrics.registry,
                readiness=readiness,
            )
            observers += [self.metrics, readiness]
        if s.tracing and tracing.AVAILABLE:
            observers.append(tracing.Tracing())
        self.observer = observe.combine(observers)

    async def start(self) -> None:
        """Start serving ``/metrics``, ``/healthz`` and ``/readyz`` (when a port is set)."""
        if self.endpoints is not None:
            await self.endpoints.start()

    async def close(self) -> None:
        """Stop serving."""
        if self.endpoints is not None:
            await self.endpoints.close()

    @property
    def port(self) -> int | None:
        """The port the endpoint listens on, once started."""
        return self.endpoints.port if self.endpoints is not None else None

    def _nats_connected(self) -> bool:
        nc: Any = self._worker.nats
        # A connection whose read loop has ended says it is connected, and reads nothing.
        return bool(nc is not None and nc.is_connected and wire.reading(nc))

    async def _ping(self) -> None:
        async with self._worker.app.engine.connect() as conn:
            await conn.execute(sql.ping())
