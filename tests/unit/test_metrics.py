"""The Prometheus text format, histograms, and the worker metrics fed by the protocol."""

from __future__ import annotations

import math
import threading

import pytest

from eop.handler import HandlerSpec
from eop.observe import metrics
from eop.observe import observer as observe
from eop.observe.observer import Settled
from eop.pg import models
from eop.types import Outcome

from .support import FAST, STREAM, MakeHarness, delivery


def spec(name: str = "billing", stream: str = STREAM) -> HandlerSpec:
    async def handler(msg: object, session: object) -> None:
        pass

    return HandlerSpec(func=handler, name=name, stream=stream, subject="orders.>", durable="d")


def test_counter_renders_help_type_and_labelled_samples() -> None:
    """A counter family: HELP and TYPE lines, then one sample per label set, sorted."""
    r = metrics.Registry()
    c = r.add(metrics.Counter("x_total", "Things counted.", ("handler",)))
    c.labels("b").inc()
    c.labels("a").inc(2.5)
    assert r.render() == (
        "# HELP x_total Things counted.\n"
        "# TYPE x_total counter\n"
        'x_total{handler="a"} 2.5\n'
        'x_total{handler="b"} 1\n'
    )


def test_label_values_and_help_are_escaped() -> None:
    """Label values escape backslash, double quote and newline; HELP backslash and newline."""
    r = metrics.Registry()
    g = r.add(metrics.Gauge("g", 'Help with \\ and\nnewline and "quotes".', ("k",)))
    g.labels('a"b\\c\nd').set(3)
    lines = r.render().splitlines()
    assert lines[0] == '# HELP g Help with \\\\ and\\nnewline and "quotes".'
    assert lines[2] == 'g{k="a\\"b\\\\c\\nd"} 3'


def test_values_are_formatted_like_prometheus() -> None:
    """Integers without a fraction, floats in full, +Inf/-Inf/NaN spelled as Prometheus does."""
    assert metrics.format_value(3.0) == "3"
    assert metrics.format_value(0.25) == "0.25"
    assert metrics.format_value(1e-05) == "1e-05"
    assert metrics.format_value(math.inf) == "+Inf"
    assert metrics.format_value(-math.inf) == "-Inf"
    assert metrics.format_value(math.nan) == "NaN"
    assert metrics.format_value(2.0**60) == repr(2.0**60)


def test_histogram_buckets_are_cumulative_with_inf_sum_and_count() -> None:
    """Observations land in the first bucket whose bound is >= the value; le="+Inf" counts all."""
    r = metrics.Registry()
    h = r.add(metrics.Histogram("lat_seconds", "Latency.", ("handler",), buckets=(0.1, 1, 0.5)))
    child = h.labels("a")
    for value in (0.05, 0.1, 0.3, 0.7, 5.0):
        child.observe(value)
    assert r.render().splitlines()[2:] == [
        'lat_seconds_bucket{handler="a",le="0.1"} 2',
        'lat_seconds_bucket{handler="a",le="0.5"} 3',
        'lat_seconds_bucket{handler="a",le="1"} 4',
        'lat_seconds_bucket{handler="a",le="+Inf"} 5',
        'lat_seconds_sum{handler="a"} 6.15',
        'lat_seconds_count{handler="a"} 5',
    ]


def test_histogram_without_labels_renders_bare_le() -> None:
    """A histogram without labels has only the le label on its buckets and none on sum/count."""
    r = metrics.Registry()
    r.add(metrics.Histogram("h", "H.", buckets=(1,))).labels().observe(2)
    assert r.render().splitlines()[2:] == [
        'h_bucket{le="1"} 0',
        'h_bucket{le="+Inf"} 1',
        "h_sum 2",
        "h_count 1",
    ]


def test_histogram_rejects_bad_buckets_and_le_label() -> None:
    """Duplicate or no buckets, and a label called le, are refused."""
    with pytest.raises(ValueError, match="buckets"):
        metrics.Histogram("h", "H.", buckets=(1, 1))
    with pytest.raises(ValueError, match="buckets"):
        metrics.Histogram("h", "H.", buckets=())
    with pytest.raises(ValueError, match="reserved"):
        metrics.Histogram("h", "H.", ("le",), buckets=(1,))


def test_registry_refuses_duplicate_names_and_wrong_label_counts() -> None:
    """Metric names are unique; a child takes exactly the family's labels."""
    r = metrics.Registry()
    c = r.add(metrics.Counter("c_total", "C.", ("a", "b")))
    with pytest.raises(ValueError, match="already"):
        r.add(metrics.Counter("c_total", "C."))
    with pytest.raises(ValueError, match="takes labels"):
        c.labels("only-one")


def test_histogram_observations_from_threads_are_all_counted() -> None:
    """Sync handlers report from worker threads: no observation is lost."""
    h = metrics.Histogram("h", "H.", buckets=(1,)).labels()

    def work() -> None:
        for _ in range(10_000):
            h.observe(0.5)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.count == 40_000


def test_worker_metrics_expose_every_handler_at_zero_from_the_start() -> None:
    """Several handlers: each has its series (labels handler and stream) before any message."""
    m = metrics.WorkerMetrics([spec("billing"), spec("audit", "AUDIT")])
    text = m.registry.render()
    assert 'eop_messages_processed_total{handler="audit",stream="AUDIT"} 0' in text
    assert 'eop_messages_processed_total{handler="billing",stream="ORDERS"} 0' in text
    assert (
        'eop_messages_dead_lettered_total{handler="billing",stream="ORDERS",reason="undecodable"} 0'
        in text
    )
    assert 'eop_messages_in_flight{handler="audit",stream="AUDIT"} 0' in text
    assert "# TYPE eop_handler_duration_seconds histogram" in text
    assert "# TYPE eop_commit_to_ack_seconds histogram" in text


def test_worker_metrics_count_each_outcome_in_its_counter() -> None:
    """Outcomes map to their counters; an ack given up counts as a failed ack; ack time observed."""
    s = spec()
    m = metrics.WorkerMetrics([s])
    d = delivery()
    m.outcome(Settled(s, d, Outcome.PROCESSED, ack_s=0.002))
    m.outcome(Settled(s, d, Outcome.PROCESSED, ack_s=0.5, acked=False))
    m.outcome(Settled(s, d, Outcome.DUPLICATE))
    m.outcome(Settled(s, d, Outcome.RETRY))
    m.outcome(Settled(s, d, Outcome.DEAD_LETTERED, reason=models.REASON_ATTEMPTS_EXHAUSTED))
    m.outcome(Settled(s, d, Outcome.QUARANTINED, reason=models.REASON_SEQUENCE_REUSED))
    m.outcome(Settled(s, d, Outcome.LEFT))
    m.errored(s, [d], RuntimeError())
    m.received(s, [d, d, d])
    m.done(s, [d])
    key = ("billing", STREAM)
    assert m.processed.labels(*key).value == 2
    assert m.acks_failed.labels(*key).value == 1
    assert m.duplicate.labels(*key).value == 1
    assert m.retried.labels(*key).value == 1
    assert m.left.labels(*key).value == 1
    assert m.errors.labels(*key).value == 1
    assert m.in_flight.labels(*key).value == 2
    assert m.dead_lettered.labels(*key, "attempts_exhausted").value == 1
    assert m.dead_lettered.labels(*key, "sequence_reused").value == 1
    assert m.commit_to_ack_s.labels(*key).count == 2


async def test_processor_reports_outcomes_and_handler_time_to_its_observer(
    make_harness: MakeHarness,
) -> None:
    """The protocol's branches reach the observer: processed, duplicate, retry, dead letter."""
    harness = make_harness()
    m = metrics.WorkerMetrics([harness.spec])
    harness.processor.observer = m
    harness.processor.spec = observe.instrument(harness.spec, m)
    first = delivery(seq=1)
    await harness.handle(first)
    await harness.handle(first.redeliver())
    harness.then(RuntimeError("flaky"))
    await harness.handle(delivery(seq=2))
    harness.then(RuntimeError("still"))
    last = delivery(seq=3, num_delivered=FAST.max_attempts)
    harness.failed_before(last, FAST.max_attempts - 1)
    await harness.handle(last)
    key = ("orders", STREAM)
    assert m.processed.labels(*key).value == 1
    assert m.duplicate.labels(*key).value == 1
    assert m.retried.labels(*key).value == 1
    assert m.dead_lettered.labels(*key, "attempts_exhausted").value == 1
    assert m.handler_s.labels(*key).count == 3
    assert m.commit_to_ack_s.labels(*key).count == 1


async def test_ack_given_up_after_commit_is_counted(make_harness: MakeHarness) -> None:
    """A confirmed ack that keeps timing out after COMMIT counts in eop_acks_failed_total."""
    harness = make_harness()
    m = metrics.WorkerMetrics([harness.spec])
    harness.processor.observer = m
    d = delivery()
    d.fail_acks(times=10_000)
    await harness.handle(d)
    assert m.acks_failed.labels("orders", STREAM).value == 1
    assert m.processed.labels("orders", STREAM).value == 1
