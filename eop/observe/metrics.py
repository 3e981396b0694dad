"""Prometheus metrics of a worker, in the text exposition format, without dependencies.

A small registry of counters, gauges and histograms (:class:`Registry`) renders
the format Prometheus scrapes (version 0.0.4: ``# HELP``/``# TYPE`` lines,
escaped label values, ``_bucket{le=...}``/``_sum``/``_count``).
:class:`WorkerMetrics` is the :class:`eop.observe.observer.Observer` that feeds it.

Labels are the handler's name and its stream: both come from the app's
registration, so their number is bounded. Subjects, message ids and payloads
never become label values.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from eop.handler import HandlerSpec
from eop.observe import observer as observe
from eop.pg import models

if TYPE_CHECKING:
    from eop.types import Delivery

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Content-Type of the text exposition format."""

HANDLER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ACK_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


_FamilyT = TypeVar("_FamilyT", bound="_Family")


def format_value(value: float) -> str:
    """A sample value as Prometheus writes it: integers without a fraction, +Inf, NaN."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def escape_label_value(value: str) -> str:
    """Escape a label value: backslash, double quote and line feed."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """Escape HELP text: backslash and line feed."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{escape_label_value(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Family:
    """A metric family: a name, its help, its label names and one child per label values."""

    kind = "untyped"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _Child] = {}
        self._lock = threading.Lock()

    def _new(self) -> _Child:
        raise NotImplementedError

    def labels(self, *values: str) -> _Child:
        """The child of these label values (created at zero the first time)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            with self._lock:
                child = self._children.setdefault(values, self._new())
        return child

    def render(self) -> list[str]:
        """The family's lines of the exposition format."""
        lines = [f"# HELP {self.name} {escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]
        for values, child in sorted(self._children.items()):
            lines.extend(child.samples(self.name, self.labelnames, values))
        return lines


class _Child:
    def samples(self, name: str, names: Sequence[str], values: Sequence[str]) -> list[str]:
        raise NotImplementedError


class _Value(_Child):
    # Counters and gauges change only on the event loop's thread: no lock.
    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount``."""
        self.value += amount

    def samples(self, name: str, names: Sequence[str], values: Sequence[str]) -> list[str]:
        return [f"{name}{_labels(names, values)} {format_value(self.value)}"]


class _GaugeValue(_Value):
    def dec(self, amount: float = 1.0) -> None:
        """Subtract ``amount``."""
        self.value -= amount

    def set(self, value: float) -> None:
        """Set the value."""
        self.value = value


class _HistogramValue(_Child):
    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        """Count one observation in the first bucket whose bound is >= ``value``."""
        index = bisect.bisect_left(self.bounds, value)
        # Sync handlers report from worker threads.
        with self._lock:
            self.counts[index] += 1
            self.sum += value

    @property
    def count(self) -> int:
        """Observations so far."""
        return sum(self.counts)

    def samples(self, name: str, names: Sequence[str], values: Sequence[str]) -> list[str]:
        with self._lock:
            counts, total = list(self.counts), self.sum
        lines = []
        cumulative = 0
        for bound, n in zip((*self.bounds, math.inf), counts, strict=True):
            cumulative += n
            le = 'le="' + format_value(float(bound)) + '"'
            lines.append(f"{name}_bucket{_labels(names, values, le)} {cumulative}")
        lines.append(f"{name}_sum{_labels(names, values)} {format_value(total)}")
        lines.append(f"{name}_count{_labels(names, values)} {cumulative}")
        return lines


class Counter(_Family):
    """A value that only goes up; its name should end in ``_total``."""

    kind = "counter"

    def _new(self) -> _Value:
        return _Value()

    def labels(self, *values: str) -> _Value:
        """The counter of these label values."""
        child = super().labels(*values)
        assert isinstance(child, _Value)
        return child


class Gauge(_Family):
    """A value that goes up and down."""

    kind = "gauge"

    def _new(self) -> _GaugeValue:
        return _GaugeValue()

    def labels(self, *values: str) -> _GaugeValue:
        """The gauge of these label values."""
        child = super().labels(*values)
        assert isinstance(child, _GaugeValue)
        return child


class Histogram(_Family):
    """Observations counted in cumulative buckets, with their sum and count."""

    kind = "histogram"

    def __init__(
        self, name: str, help_text: str, labelnames: Sequence[str] = (), *, buckets: Iterable[float]
    ) -> None:
        super().__init__(name, help_text, labelnames)
        bounds = sorted(float(b) for b in buckets if not math.isinf(b))
        if not bounds or len(set(bounds)) != len(bounds):
            raise ValueError(f"{name}: buckets must be distinct, finite and at least one")
        if "le" in self.labelnames:
            raise ValueError(f"{name}: 'le' is reserved for the buckets")
        self.buckets = tuple(bounds)

    def _new(self) -> _HistogramValue:
        return _HistogramValue(self.buckets)

    def labels(self, *values: str) -> _HistogramValue:
        """The histogram of these label values."""
        child = super().labels(*values)
        assert isinstance(child, _HistogramValue)
        return child


class Registry:
    """The metric families of one worker, rendered together."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}

    def add(self, family: _FamilyT) -> _FamilyT:
        """Register ``family``; names are unique."""
        if family.name in self._families:
            raise ValueError(f"metric {family.name!r} is already registered")
        self._families[family.name] = family
        return family

    def render(self) -> str:
        """The whole registry in the text exposition format."""
        lines: list[str] = []
        for family in self._families.values():
            lines.extend(family.render())
        return "\n".join(lines) + "\n"


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
        self.dead: dict[str, _Value] = {
            reason: m.dead_lettered.labels(*key, reason) for reason in _REASONS
        }


_REASONS = (
    models.REASON_UNDECODABLE,
    models.REASON_REJECTED,
    models.REASON_ATTEMPTS_EXHAUSTED,
    models.REASON_SEQUENCE_REUSED,
)

_LABELS = ("handler", "stream")


class WorkerMetrics(observe.Observer):
    """The worker's metrics, fed by the protocol's events.

    Every handler's series exist from the start (at zero), so a rate over a
    quiet handler is 0 rather than absent.
    """

    def __init__(self, specs: Iterable[HandlerSpec], registry: Registry | None = None) -> None:
        r = self.registry = registry if registry is not None else Registry()
        self.processed = r.add(
            Counter(
                "eop_messages_processed_total",
                "Messages whose handler's writes were committed with their inbox row.",
                _LABELS,
            )
        )
        self.duplicate = r.add(
            Counter(
                "eop_messages_duplicate_total",
                "Deliveries skipped because the inbox already held their outcome "
                "(redeliveries, republishes caught by the msg-id guard).",
                _LABELS,
            )
        )
        self.retried = r.add(
            Counter(
                "eop_messages_retried_total",
                "Deliveries nak'ed for a later redelivery (handler failure, claim timeout, "
                "transaction retries spent).",
                _LABELS,
            )
        )
        self.dead_lettered = r.add(
            Counter(
                "eop_messages_dead_lettered_total",
                "Messages settled as a dead letter, by reason (sequence_reused: quarantined).",
                (*_LABELS, "reason"),
            )
        )
        self.left = r.add(
            Counter(
                "eop_messages_left_total",
                "Deliveries left for redelivery without a nak (lease spent, stream gone, "
                "commit outcome unknown).",
                _LABELS,
            )
        )
        self.acks_failed = r.add(
            Counter(
                "eop_acks_failed_total",
                "Confirmed acks given up after the COMMIT "
                "(the redelivery is skipped by the inbox).",
                _LABELS,
            )
        )
        self.errors = r.add(
            Counter(
                "eop_processing_errors_total",
                "Messages or batches whose processing failed in eop's own I/O beyond its "
                "retries (their messages were nak'ed).",
                _LABELS,
            )
        )
        self.in_flight = r.add(
            Gauge("eop_messages_in_flight", "Messages being processed right now.", _LABELS)
        )
        self.handler_s = r.add(
            Histogram(
                "eop_handler_duration_seconds",
                "Time spent in the handler function, per call (a batch handler: per batch).",
                _LABELS,
                buckets=HANDLER_BUCKETS_S,
            )
        )
        self.commit_to_ack_s = r.add(
            Histogram(
                "eop_commit_to_ack_seconds",
                "Time from a processed message's COMMIT to its confirmed ack.",
                _LABELS,
                buckets=ACK_BUCKETS_S,
            )
        )
        self.outbox_published_total = r.add(
            Counter(
                "eop_outbox_published_total",
                "Outbox rows this process's relay published (PubAck received, row marked).",
            )
        ).labels()
        self.outbox_parked_by_reason = r.add(
            Counter(
                "eop_outbox_parked_total",
                "Outbox rows this process's relay parked, by reason (see `eop outbox list`).",
                ("reason",),
            )
        )
        self.outbox_pending = r.add(
            Gauge(
                "eop_outbox_pending",
                "Unpublished outbox rows, as the publishing relay last counted them.",
            )
        ).labels()
        self.outbox_lag_s = r.add(
            Gauge(
                "eop_outbox_lag_seconds",
                "Age of the oldest unpublished outbox row, as the publishing relay last saw it.",
            )
        ).labels()
        self.outbox_parked_rows = r.add(
            Gauge("eop_outbox_parked", "Parked outbox rows, as the publishing relay last counted.")
        ).labels()
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
