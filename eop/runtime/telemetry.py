"""What a worker reports about itself: metrics, health endpoints and traces, per settings.

:class:`Telemetry` builds the worker's :class:`eop.observe.observer.Observer` from its
settings (``metrics_port``, ``tracing``) and runs the HTTP endpoint of
:mod:`eop.observe.health` while the worker runs. A process of a supervised
``eop worker --processes N`` serves nothing: given ``report_to`` (the supervisor's
directory), it writes its metrics there (prometheus_client's multiprocess mode)
and its readiness (:mod:`eop.observe.reports`), and the supervisor serves them all
on one port. A worker hosted by another application may be given the host's
prometheus_client ``registry`` instead: its metrics go there, and the host's
``/metrics`` serves them. With the port at 0, no ``report_to``, no registry, and tracing off or
OpenTelemetry absent, the observer is :data:`eop.observe.observer.NOOP` and no
server is started.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from nats.aio.client import Client as NATS

from eop import errors
from eop.app import App
from eop.broker import client
from eop.handler import HandlerSpec
from eop.observe import health, metrics, reports, tracing
from eop.observe import observer as observe
from eop.pg.sql import base as base_sql
from eop.settings import Settings

if TYPE_CHECKING:
    import prometheus_client


class Observed(Protocol):
    """What telemetry reads of the worker it reports on (:class:`eop.runtime.worker.Worker`)."""

    @property
    def app(self) -> App:
        """The app whose engine the readiness check pings."""

    @property
    def settings(self) -> Settings:
        """The worker's settings (``metrics_port``, ``tracing``)."""

    @property
    def specs(self) -> Sequence[HandlerSpec]:
        """The handlers the worker runs."""

    @property
    def ready(self) -> asyncio.Event:
        """Set once the worker is bound to its consumers."""

    @property
    def nats(self) -> Any:
        """The worker's NATS connection, None before it connects."""

    @property
    def draining(self) -> bool:
        """Whether the worker is stopping."""


class Telemetry:
    """The observers and the HTTP endpoint of one worker."""

    def __init__(
        self,
        worker: Observed,
        *,
        report_to: str | None = None,
        registry: prometheus_client.CollectorRegistry | None = None,
    ) -> None:
        self._worker = worker
        s = worker.settings
        observers: list[observe.Observer] = []
        self.metrics: metrics.WorkerMetrics | None = None
        self.endpoints: health.Endpoints | None = None
        self.reporter: reports.Reporter | None = None
        if registry is not None or s.metrics_port or report_to:
            try:
                worker_metrics = metrics.WorkerMetrics(worker.specs, registry)
            except ValueError as exc:  # prometheus_client: "Duplicated timeseries"
                raise errors.ConfigurationError(
                    "this metrics registry holds another eop worker's metrics already: "
                    "give each worker its own registry"
                ) from exc
            self.metrics = worker_metrics
            observers.append(worker_metrics)
        readiness = self.readiness = health.Readiness(
            bound=lambda: worker.ready.is_set(),
            draining=lambda: worker.draining,
            nats_connected=self._nats_connected,
            ping=self._ping,
        )
        """What ``/readyz`` checks (:meth:`eop.Worker.readiness` for an embedded worker).
        Told of outcomes only when an endpoint serves it; else it pings PostgreSQL when
        asked, which costs the messages nothing."""
        if self.metrics is not None and (s.metrics_port or report_to):
            if report_to:
                self.reporter = reports.Reporter(report_to, readiness)
            else:
                served = self.metrics.registry
                self.endpoints = health.Endpoints(
                    host=s.metrics_host,
                    port=s.metrics_port,
                    metrics=lambda: metrics.render(served),
                    readiness=readiness,
                )
            observers.append(readiness)
        if s.tracing and tracing.AVAILABLE:
            observers.append(tracing.Tracing())
        self.observer = observe.combine(observers)

    async def start(self) -> None:
        """Start serving ``/metrics``, ``/healthz`` and ``/readyz`` (or reporting them)."""
        if self.endpoints is not None:
            await self.endpoints.start()
        if self.reporter is not None:
            await self.reporter.start()

    async def close(self) -> None:
        """Stop serving (or reporting)."""
        if self.endpoints is not None:
            await self.endpoints.close()
        if self.reporter is not None:
            await self.reporter.close()

    @property
    def port(self) -> int | None:
        """The port the endpoint listens on, once started."""
        return self.endpoints.port if self.endpoints is not None else None

    def _nats_connected(self) -> bool:
        nc: NATS = self._worker.nats
        # A connection whose read loop has ended says it is connected, and reads nothing.
        return bool(nc is not None and nc.is_connected and client.reading(nc))

    async def _ping(self) -> None:
        async with self._worker.app.engine.connect() as conn:
            await conn.execute(base_sql.ping())
