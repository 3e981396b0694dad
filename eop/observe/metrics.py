"""Prometheus metrics of a worker, by prometheus_client (the ``eop[metrics]`` extra).

:class:`WorkerMetrics` is the :class:`eop.observe.observer.Observer` that feeds
a worker's counters, gauges and histograms. One process serves its own
(:func:`render`). The processes of one ``eop worker --processes N`` write theirs
to the directory the supervisor names in ``PROMETHEUS_MULTIPROC_DIR``
(prometheus_client's multiprocess mode), and the supervisor serves them all,
summed, on its one port (:func:`render_directory`).

Labels are the handler's name and its stream: both come from the app's
registration, so their number is bounded. Subjects, message ids and payloads
never become label values.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from eop import errors
from eop.handler import HandlerSpec
from eop.observe import observer as observe
from eop.pg import models

if TYPE_CHECKING:
    # Imported when metrics are on (the eop[metrics] extra): a worker without them
    # does not pay for the import.
    import prometheus_client

    from eop.types import Delivery

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Content-Type of the text exposition format."""

HANDLER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ACK_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

MULTIPROCESS_DIR_VAR = "PROMETHEUS_MULTIPROC_DIR"
"""Where prometheus_client's multiprocess mode keeps each process's values."""


def require() -> None:
    """:class:`eop.ConfigurationError` saying how to install prometheus_client if it is absent."""
    try:
        importlib.import_module("prometheus_client")
    except ImportError:
        raise errors.ConfigurationError(
            "metrics_port needs prometheus_client: pip install 'eop[metrics]'"
        ) from None


def render(registry: prometheus_client.CollectorRegistry) -> bytes:
    """``registry`` in the text exposition format."""
    import prometheus_client

    return prometheus_client.generate_latest(registry)


def render_directory(path: str) -> bytes:
    """The metrics the processes wrote to ``path``: counters and histograms summed over
    every process that ran, in-flight messages over the live ones."""
    require()
    import prometheus_client
    from prometheus_client import multiprocess

    registry = prometheus_client.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]  # unannotated upstream
    return prometheus_client.generate_latest(registry)


def process_gone(path: str, pid: int) -> None:
    """Drop a process's gauges (in flight, outbox backlog) from ``path``; its counters stay."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]  # unannotated upstream


class _HandlerSeries:
    """The children of one handler, looked up once rather than per message."""

    def __init__(self, m: WorkerMetrics, spec: HandlerSpec) -> None:
        key = (spec.name, spec.stream)
        self.key = key
        self.processed = m.processed.labels(*key)
        self.duplicate = m.duplicate.labels(*key)
        self.retried = m.retried.labels(*key)
        self.left = m.left.labels(*key)
        self.acks_failed = m.acks_failed.labels(*key)
        self.errors = m.errors.labels(*key)
        self.in_flight = m.in_flight.labels(*key)
        self.handler_s = m.handler_s.labels(*key)
        self.commit_to_ack_s = m.commit_to_ack_s.labels(*key)
        self.oldest_unacked_s = m.oldest_unacked_s.labels(*key)
        self.stuck = m.stuck.labels(*key)
        self.dead: dict[str, prometheus_client.Counter] = {
            reason: m.dead_lettered.labels(*key, reason) for reason in _REASONS
        }


_REASONS = (
    models.REASON_UNDECODABLE,
    models.REASON_REJECTED,
    models.REASON_ATTEMPTS_EXHAUSTED,
    models.REASON_SEQUENCE_REUSED,
    models.REASON_CRASH_LOOP,
)

_LABELS = ("handler", "stream")


class WorkerMetrics(observe.Observer):
    """The worker's metrics, fed by the protocol's events.

    Every handler's series exist from the start (at zero), so a rate over a
    quiet handler is 0 rather than absent.
    """

    def __init__(
        self,
        specs: Iterable[HandlerSpec],
        registry: prometheus_client.CollectorRegistry | None = None,
    ) -> None:
        require()
        import prometheus_client

        # A registry per worker: two workers of one process (tests, a host) do not
        # collide, and the host's own default registry stays its own.
        r = self.registry = registry or prometheus_client.CollectorRegistry(auto_describe=True)
        Counter, Gauge, Histogram = (
            prometheus_client.Counter,
            prometheus_client.Gauge,
            prometheus_client.Histogram,
        )
        self.processed = Counter(
            "eop_messages_processed_total",
            "Messages whose handler's writes were committed with their inbox row.",
            _LABELS,
            registry=r,
        )
        self.duplicate = Counter(
            "eop_messages_duplicate_total",
            "Deliveries skipped because the inbox already held their outcome "
            "(redeliveries, republishes caught by the msg-id guard).",
            _LABELS,
            registry=r,
        )
        self.retried = Counter(
            "eop_messages_retried_total",
            "Deliveries to be run again later: parked after a handler failure (or nak'ed, "
            "with order_by), or nak'ed after a claim timeout or spent transaction retries.",
            _LABELS,
            registry=r,
        )
        self.dead_lettered = Counter(
            "eop_messages_dead_lettered_total",
            "Messages settled as a dead letter, by reason (sequence_reused: quarantined).",
            (*_LABELS, "reason"),
            registry=r,
        )
        self.left = Counter(
            "eop_messages_left_total",
            "Deliveries left for redelivery without a nak (lease spent, stream gone, "
            "commit outcome unknown).",
            _LABELS,
            registry=r,
        )
        self.acks_failed = Counter(
            "eop_acks_failed_total",
            "Confirmed acks given up after the COMMIT (the redelivery is skipped by the inbox).",
            _LABELS,
            registry=r,
        )
        self.errors = Counter(
            "eop_processing_errors_total",
            "Messages or batches whose processing failed in eop's own I/O beyond its "
            "retries (their messages were nak'ed).",
            _LABELS,
            registry=r,
        )
        # Summed over the processes that are alive: a dead one's messages are not in flight.
        self.in_flight = Gauge(
            "eop_messages_in_flight",
            "Messages being processed right now.",
            _LABELS,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.handler_s = Histogram(
            "eop_handler_duration_seconds",
            "Time spent in the handler function, per call (a batch handler: per batch).",
            _LABELS,
            registry=r,
            buckets=HANDLER_BUCKETS_S,
        )
        self.commit_to_ack_s = Histogram(
            "eop_commit_to_ack_seconds",
            "Time from a processed message's COMMIT to its confirmed ack.",
            _LABELS,
            registry=r,
            buckets=ACK_BUCKETS_S,
        )
        self.outbox_published_total = Counter(
            "eop_outbox_published_total",
            "Outbox rows this worker's relay published (PubAck received, row marked).",
            registry=r,
        )
        self.outbox_parked_by_reason = Counter(
            "eop_outbox_parked_total",
            "Outbox rows this worker's relay parked, by reason (see `eop outbox list`).",
            ("reason",),
            registry=r,
        )
        # The backlog as the publishing relay last counted it, whichever process holds
        # the relay's lease: the most recent value of the live processes.
        self.outbox_pending = Gauge(
            "eop_outbox_pending",
            "Unpublished outbox rows, as the publishing relay last counted them.",
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.outbox_lag_s = Gauge(
            "eop_outbox_lag_seconds",
            "Age of the oldest unpublished outbox row, as the publishing relay last saw it.",
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        # Not eop_outbox_parked: prometheus_client reserves it for eop_outbox_parked_total.
        self.outbox_parked_rows = Gauge(
            "eop_outbox_parked_rows",
            "Parked outbox rows, as the publishing relay last counted.",
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.partitions_owned = Gauge(
            "eop_partitions_owned",
            "Partitions of an ordered handler this process owns (summed: every partition "
            "should be owned once).",
            ("handler",),
            registry=r,
            multiprocess_mode="livesum",
        )
        self.rebalances = Counter(
            "eop_partition_changes_total",
            "Partitions of an ordered handler this process acquired, released (handed "
            "over) or lost (its lease ran out: another process took it).",
            ("handler", "action"),
            registry=r,
        )
        # Every process running a handler reads the same consumers: the largest value
        # of the live ones (a frozen process's stays out once it is marked gone).
        self.oldest_unacked_s = Gauge(
            "eop_oldest_unacked_seconds",
            "How long the handler's oldest unacknowledged delivery has waited, at least "
            "(0: none waits), as this process last read its consumers.",
            _LABELS,
            registry=r,
            multiprocess_mode="livemax",
        )
        self.stuck = Gauge(
            "eop_stuck_deliveries",
            "The handler's consumers whose oldest delivery has waited unacknowledged longer "
            "than stuck_after_ack_waits AckWaits (alert on > 0).",
            _LABELS,
            registry=r,
            multiprocess_mode="livemax",
        )
        self._series = {spec.name: _HandlerSeries(self, spec) for spec in specs}

    def _of(self, spec: HandlerSpec) -> _HandlerSeries:
        series = self._series.get(spec.name)
        if series is None:
            series = self._series[spec.name] = _HandlerSeries(self, spec)
        return series

    def received(self, spec: HandlerSpec, deliveries: Sequence[Delivery]) -> None:
        """Count the deliveries in flight."""
        self._of(spec).in_flight.inc(len(deliveries))

    def done(self, spec: HandlerSpec, deliveries: Sequence[Delivery]) -> None:
        """The deliveries are no longer in flight."""
        self._of(spec).in_flight.dec(len(deliveries))

    def outcome(self, event: observe.Settled) -> None:
        """Count the outcome; time the ack of a processed message."""
        s = self._of(event.spec)
        kind = event.outcome.value
        if kind == "processed":
            s.processed.inc()
            if event.ack_s is not None:
                s.commit_to_ack_s.observe(event.ack_s)
            if not event.acked:
                s.acks_failed.inc()
        elif kind == "duplicate":
            s.duplicate.inc()
        elif kind == "retry":
            s.retried.inc()
        elif kind in ("dead_lettered", "quarantined"):
            label = event.reason or models.REASON_REJECTED
            counter = s.dead.get(label)
            if counter is None:
                counter = s.dead[label] = self.dead_lettered.labels(*s.key, label)
            counter.inc()
        else:
            s.left.inc()

    def errored(
        self, spec: HandlerSpec, deliveries: Sequence[Delivery], error: BaseException
    ) -> None:
        """Count a processing error of eop's own."""
        self._of(spec).errors.inc()

    def handler_finished(self, spec: HandlerSpec, token: object, seconds: float) -> None:
        """Time the handler call."""
        self._of(spec).handler_s.observe(seconds)

    def outbox_published(self, rows: int) -> None:
        """Count published outbox rows."""
        self.outbox_published_total.inc(rows)

    def outbox_parked(self, rows: int, reason: str) -> None:
        """Count parked outbox rows by reason."""
        self.outbox_parked_by_reason.labels(reason).inc(rows)

    def outbox_backlog(self, pending: int, oldest_s: float, parked: int) -> None:
        """Set the outbox's backlog gauges."""
        self.outbox_pending.set(pending)
        self.outbox_lag_s.set(oldest_s)
        self.outbox_parked_rows.set(parked)

    def partitions_changed(self, spec: HandlerSpec, action: str, owned: int) -> None:
        """Count the change of ownership; set the partitions owned."""
        self.rebalances.labels(spec.name, action).inc()
        self.partitions_owned.labels(spec.name).set(owned)

    def unacked(self, spec: HandlerSpec, oldest_s: float, stuck: int) -> None:
        """Set the oldest unacknowledged delivery's wait and the stuck consumers."""
        s = self._of(spec)
        s.oldest_unacked_s.set(oldest_s)
        s.stuck.set(stuck)
