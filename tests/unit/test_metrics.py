"""The Prometheus text format, histograms, and the worker metrics fed by the protocol."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from eop.handler import HandlerSpec
from eop.observe import metrics
from eop.observe import observer as observe
from eop.observe.observer import Settled
from eop.pg import models
from eop.types import Outcome

from .support import FAST, STREAM, MakeHarness, delivery

ROOT = Path(__file__).resolve().parents[2]


def spec(name: str = "billing", stream: str = STREAM) -> HandlerSpec:
    async def handler(msg: object, session: object) -> None:
        pass

    return HandlerSpec(func=handler, name=name, stream=stream, subject="orders.>", durable="d")


def value(m: metrics.WorkerMetrics, name: str, **labels: str) -> float | None:
    """A sample of the worker's registry, as a scrape would read it."""
    return m.registry.get_sample_value(name, labels)


def of(key: tuple[str, str]) -> dict[str, str]:
    """The labels of a (handler, stream) key."""
    return {"handler": key[0], "stream": key[1]}


def test_histogram_observations_from_threads_are_all_counted() -> None:
    """Sync handlers report from worker threads: no observation is lost."""
    m = metrics.WorkerMetrics([spec()])
    h = m.handler_s.labels("billing", STREAM)

    def work() -> None:
        for _ in range(10_000):
            h.observe(0.5)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    count = "eop_handler_duration_seconds_count"
    assert value(m, count, handler="billing", stream=STREAM) == 40_000


def test_worker_metrics_expose_every_handler_at_zero_from_the_start() -> None:
    """Several handlers: each has its series (labels handler and stream) before any message."""
    m = metrics.WorkerMetrics([spec("billing"), spec("audit", "AUDIT")])
    text = metrics.render(m.registry).decode()
    assert value(m, "eop_messages_processed_total", handler="audit", stream="AUDIT") == 0
    assert value(m, "eop_messages_processed_total", handler="billing", stream="ORDERS") == 0
    dead = "eop_messages_dead_lettered_total"
    # Every reason metrics.md lists, crash_loop included, exists before any dead letter.
    for reason in (
        "undecodable",
        "rejected",
        "attempts_exhausted",
        "crash_loop",
        "sequence_reused",
    ):
        assert value(m, dead, handler="billing", stream="ORDERS", reason=reason) == 0
    assert value(m, "eop_messages_in_flight", handler="audit", stream="AUDIT") == 0
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
    assert value(m, "eop_messages_processed_total", **of(key)) == 2
    assert value(m, "eop_acks_failed_total", **of(key)) == 1
    assert value(m, "eop_messages_duplicate_total", **of(key)) == 1
    assert value(m, "eop_messages_retried_total", **of(key)) == 1
    assert value(m, "eop_messages_left_total", **of(key)) == 1
    assert value(m, "eop_processing_errors_total", **of(key)) == 1
    assert value(m, "eop_messages_in_flight", **of(key)) == 2
    dead = "eop_messages_dead_lettered_total"
    assert value(m, dead, **of(key), reason="attempts_exhausted") == 1
    assert value(m, dead, **of(key), reason="sequence_reused") == 1
    assert value(m, "eop_commit_to_ack_seconds_count", **of(key)) == 2


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
    assert value(m, "eop_messages_processed_total", **of(key)) == 1
    assert value(m, "eop_messages_duplicate_total", **of(key)) == 1
    assert value(m, "eop_messages_retried_total", **of(key)) == 1
    assert value(m, "eop_messages_dead_lettered_total", **of(key), reason="attempts_exhausted") == 1
    assert value(m, "eop_handler_duration_seconds_count", **of(key)) == 3
    assert value(m, "eop_commit_to_ack_seconds_count", **of(key)) == 1


async def test_ack_given_up_after_commit_is_counted(make_harness: MakeHarness) -> None:
    """A confirmed ack that keeps timing out after COMMIT counts in eop_acks_failed_total."""
    harness = make_harness()
    m = metrics.WorkerMetrics([harness.spec])
    harness.processor.observer = m
    d = delivery()
    d.fail_acks(times=10_000)
    await harness.handle(d)
    assert value(m, "eop_acks_failed_total", handler="orders", stream=STREAM) == 1
    assert value(m, "eop_messages_processed_total", handler="orders", stream=STREAM) == 1


PROCESS = """
import sys
from eop.handler import HandlerSpec
from eop.observe import metrics
from eop.observe.observer import Settled
from eop.types import Outcome
from tests.unit.support import delivery

async def handler(msg, session): ...

s = HandlerSpec(func=handler, name="billing", stream="ORDERS", subject="o.>", durable="d")
m = metrics.WorkerMetrics([s])
for _ in range(int(sys.argv[1])):
    m.outcome(Settled(s, delivery(), Outcome.PROCESSED, ack_s=0.001))
m.received(s, [delivery()])
"""


def test_the_processes_of_one_worker_are_summed_from_their_shared_directory(
    tmp_path: Path,
) -> None:
    """prometheus_client's multiprocess mode: two processes' counters sum on one page, and a
    process marked gone leaves its counts but not its in-flight gauge."""
    env = {**os.environ, metrics.MULTIPROCESS_DIR_VAR: str(tmp_path)}
    pids = []
    for count in (3, 4):
        done = subprocess.run(
            [sys.executable, "-c", PROCESS + "print(__import__('os').getpid())", str(count)],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        pids.append(int(done.stdout))
    text = metrics.render_directory(str(tmp_path)).decode()
    labels = '{handler="billing",stream="ORDERS"}'
    assert f"eop_messages_processed_total{labels} 7.0" in text
    assert f"eop_commit_to_ack_seconds_count{labels} 7.0" in text
    assert f"eop_messages_in_flight{labels} 2.0" in text
    metrics.process_gone(str(tmp_path), pids[0])
    text = metrics.render_directory(str(tmp_path)).decode()
    assert f"eop_messages_processed_total{labels} 7.0" in text
    assert f"eop_messages_in_flight{labels} 1.0" in text


def test_a_killed_supervisors_metrics_directory_is_removed_by_the_next_one(tmp_path: Path) -> None:
    """Only directories whose owner is gone are removed: a live supervisor's, one of another
    pid namespace (a container sharing /tmp) and unowned ones stay."""
    from eop import scratch_owners
    from eop.runtime import gathered

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    namespace = os.readlink("/proc/self/ns/pid")
    owned_by = {
        "eop-metrics-dead": f"{dead.pid} {namespace}",
        "eop-metrics-live": f"{os.getpid()} {namespace}",
        "eop-metrics-elsewhere": f"{dead.pid} pid:[1]",
    }
    for name, owner in owned_by.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / scratch_owners.OWNER_FILE).write_text(owner)
    (tmp_path / "eop-metrics-unowned").mkdir()

    removed = gathered.remove_orphans(tmp_path)

    assert removed == [tmp_path / "eop-metrics-dead"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["eop-metrics-elsewhere", "eop-metrics-live", "eop-metrics-unowned"]
