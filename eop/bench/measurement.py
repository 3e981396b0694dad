"""One run measured: throughput draining a backlog, then latency at a steady load."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import NamedTuple

import sqlalchemy as sa

from eop.bench import harness, runs


@dataclasses.dataclass
class Result:
    """What one run measured (rates in messages/s, latencies in ms)."""

    key: str
    label: str
    command: str
    messages: int
    rate: float
    cpu_us: float | None
    """CPU time of the consumer process per message while it drained the backlog."""
    nats_us: float | None
    """nats-server's CPU time per message meanwhile."""
    pg_us: float | None
    """PostgreSQL's CPU time per message meanwhile (the postmaster and its backends)."""
    latency_messages: int
    latency_rate: float
    p50_ms: float
    p99_ms: float
    effects: int | None
    """Effect rows of the run ((a): None); exactly-once means one per message."""
    processes: int
    """Consumer processes: a baseline's own count, or the eop worker's."""


@dataclasses.dataclass
class BigResult:
    """Throughput early and late in a long run, and the inbox's size meanwhile."""

    messages: int
    early_rate: float
    late_rate: float
    early_cpu_us: float | None
    late_cpu_us: float | None
    early_inbox: int
    late_inbox: int
    max_inbox: int
    effects: int
    seconds: float


class Sample(NamedTuple):
    """One look at the long run: the ack floor, the inbox rows, the worker's CPU seconds."""

    floor: int
    rows: int
    cpu: float | None


async def measure(
    bench: harness.Bench, run: runs.Run, messages: int, extra: Sequence[str] = ()
) -> Result:
    """Throughput while draining a backlog of ``messages``, then latency at a steady load.

    Start-up is excluded: the consumer's processes start first, and once each
    has a pull request waiting, its consumer is paused, the backlog published
    and the consumer resumed: every process drains it warm, from the start.
    """
    argv = bench.command(run, extra)
    processes = _processes(run, extra)
    child = harness.Child(argv, bench.tmp / f"{run.key}.log")
    try:
        # (a) keeps two pull requests waiting per process, (h) one per batch in flight.
        await bench.warm(run, child, processes * (2 if run.loop in ("a", "h") else 1))
        await bench.pause(run, True)
        await bench.publish(run, messages)
        await bench.pause(run, False)
        drained = await bench.drain(run, child, messages, f"({run.key}) {run.label}")
        load = max(1.0, bench.options.latency_load * drained.rate)
        sent, paced = await bench.publish_paced(run, load, bench.options.latency_s)
        await bench.drain(run, child, messages + sent, f"({run.key}) latency drain")
    finally:
        await child.stop()
    points = await bench.points(run, 1, messages + sent)
    bulk = sorted(done for seq, _, done in points if seq <= messages)
    latencies = sorted(done - stored for seq, stored, done in points if seq > messages)
    return Result(
        key=run.key,
        label=run.label,
        command=bench.shown(argv),
        messages=messages,
        rate=throughput(bulk),
        cpu_us=drained.cpu_us.child,
        nats_us=drained.cpu_us.nats,
        pg_us=drained.cpu_us.pg,
        latency_messages=sent,
        latency_rate=paced,
        p50_ms=percentile(latencies, 0.50) * 1000,
        p99_ms=percentile(latencies, 0.99) * 1000,
        effects=None if run.loop == "a" else len(points),
        processes=processes,
    )


def _processes(run: runs.Run, extra: Sequence[str]) -> int:
    """How many consumer processes the run had: ``--processes N`` of an eop worker wins."""
    flags = [*run.args.split(), *extra]
    if run.handler and "--processes" in flags:
        return int(flags[flags.index("--processes") + 1])
    return run.processes if not run.handler else runs.PROCESSES


async def measure_big(bench: harness.Bench, total: int) -> BigResult:
    """eop default over ``total`` messages: the rate and the inbox rows early and late."""
    await bench.publish(runs.BIG, total)
    child = harness.Child(bench.command(runs.BIG), bench.tmp / "big.log")
    samples: list[Sample] = []
    started = time.monotonic()

    async def sample() -> None:
        floor, _ = await bench.acked(runs.BIG)
        samples.append(Sample(floor, await bench.inbox_rows(runs.BIG), child.cpu_s()))

    async def sample_forever() -> None:
        while True:
            await sample()
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample_forever())
    try:
        await bench.drain(runs.BIG, child, total, f"(big) {runs.BIG.label}")
        await sample()  # the end of the last window
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        await child.stop()
    seconds = time.monotonic() - started
    early, late = (runs.WINDOW + 1, 2 * runs.WINDOW), (total - runs.WINDOW + 1, total)
    rates = [sorted(p[2] for p in await bench.points(runs.BIG, *w)) for w in (early, late)]
    async with bench.engine.connect() as conn:
        query = sa.text("SELECT count(*) FROM bench_effects WHERE variant = :v")
        effects = int((await conn.execute(query, {"v": runs.BIG.handler})).scalar_one())
    (early_inbox, early_cpu), (late_inbox, late_cpu) = (
        window_stats(samples, w) for w in (early, late)
    )
    return BigResult(
        messages=total,
        early_rate=throughput(rates[0]),
        late_rate=throughput(rates[1]),
        early_cpu_us=early_cpu,
        late_cpu_us=late_cpu,
        early_inbox=early_inbox,
        late_inbox=late_inbox,
        max_inbox=max((s.rows for s in samples), default=0),
        effects=effects,
        seconds=seconds,
    )


def window_stats(samples: list[Sample], window: tuple[int, int]) -> tuple[int, float | None]:
    """Inbox rows (the most sampled from just before to just after ``window``) and the
    worker's CPU microseconds per message across it (None if unknown)."""
    before = [s for s in samples if s.floor < window[0]][-1:]
    after = [s for s in samples if s.floor >= window[1]][:1]
    around = before + [s for s in samples if window[0] <= s.floor < window[1]] + after
    cpu = None
    if before and after and before[0].cpu is not None and after[0].cpu is not None:
        cpu = (after[0].cpu - before[0].cpu) / max(1, after[0].floor - before[0].floor) * 1e6
    return max((s.rows for s in around), default=0), cpu


def throughput(done: Sequence[float]) -> float:
    """Messages/s from the first completion to the last (``done`` sorted).

    The messages done with the first one (a batch committed at once) are not
    counted: the span starts when they were done.
    """
    if len(done) < 2 or done[-1] <= done[0]:
        return 0.0
    with_first = sum(1 for t in done if t <= done[0])
    return (len(done) - with_first) / (done[-1] - done[0])


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (nearest rank); 0 when empty."""
    if not values:
        return 0.0
    return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))]
