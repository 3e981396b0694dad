"""One run measured: throughput draining a backlog, then latency at a steady load."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence
from typing import NamedTuple

import sqlalchemy as sa

from eop.tools.bench import harness, runs


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
    pg_parts_us: dict[str, float] = dataclasses.field(default_factory=dict)
    """``pg_us`` by PostgreSQL's processes (:data:`eop.tools.bench.pgparts.PARTS`); empty if
    unknown."""


@dataclasses.dataclass
class BigResult:
    """A long run: its rate, worker CPU and RSS, and the inbox, early and late.

    "Early" is messages 10,001-20,000 (after 10,000, start-up long past),
    "late" the last 10,000 (after 1,000,000 with the default 1,010,000);
    "first" is messages 1-10,000, shown but not the target's base.
    """

    messages: int
    seconds: float
    effects: int
    first_rate: float
    early_rate: float
    late_rate: float
    early_cpu_us: float | None
    late_cpu_us: float | None
    early_rss_mb: float | None
    """The worker's processes' resident memory, together, at the end of the window."""
    late_rss_mb: float | None
    max_rss_mb: float | None
    early_inbox: int
    """The most inbox rows sampled from just before the window to just after it."""
    late_inbox: int
    max_inbox: int
    end_inbox: int
    """Inbox rows when the last message was acked."""
    settled_inbox: int
    """Inbox rows a compaction interval (and a second) after that."""
    inbox_bound: int
    """The target: the in-flight window (max_ack_pending) plus one compaction batch
    (compaction_after_messages)."""
    early_inbox_mb: float
    """The inbox table with its indexes, on disk, at the end of the window."""
    late_inbox_mb: float
    max_inbox_mb: float
    autovacuums: int
    """Autovacuums of the inbox table during the run."""
    samples: int
    sample_interval_s: float
    max_full_count_gap_s: float
    """The longest wait between two full counts of the inbox (see :data:`FULL_COUNT_SHARE`)."""
    unseen_rows: int
    """The most rows a full count found that the count above the lagged watermark did not."""
    count_lag_s: float
    """How old the watermark is above which the samples count (:data:`LAG_S`)."""
    load_start: float
    load_end: float


class Sample(NamedTuple):
    """One look at the long run: the ack floor, the inbox rows, the worker's CPU seconds
    and resident bytes, the inbox table's bytes and autovacuums."""

    floor: int
    rows: int
    cpu: float | None
    rss: int | None = None
    table: harness.InboxTable | None = None


class Window(NamedTuple):
    """What the samples say about one window of messages."""

    rows: int
    """The most inbox rows sampled from just before the window to just after it."""
    cpu_us: float | None
    """The worker's CPU per message from the sample before the window to the one after."""
    rss_mb: float | None
    """The worker's resident memory at the first sample after the window."""
    inbox_mb: float | None
    """The inbox table's size at the first sample after the window."""


SAMPLE_INTERVAL_S = 0.1
"""How often the long run looks at most: each window lasts about a second here."""

FULL_COUNT_SHARE = 0.05
"""The most of its time the sampler spends counting the whole inbox. Such a count
reads the whole table, dead rows included, and the table only grows until a
VACUUM: every 0.1 s, by the end of a 1,000,000-message run it took 15 % of a core
from the PostgreSQL the worker shares the machine with, and the run slowed as it
went for the measurement's sake. So the next full count waits at least 1 / share
times as long as the last one took; in between, each sample counts the rows above
the watermark of :data:`LAG_S` before (a short range of the primary key), which
misses only rows a compaction round left behind for that long: the full counts
tell how many (``unseen_rows``)."""

LAG_S = 1.0
"""How old the watermark is above which a sample counts the inbox's rows."""


async def measure(
    bench: harness.Bench, run: runs.Run, messages: int, extra: Sequence[str] = ()
) -> Result:
    """Throughput while draining a backlog of ``messages``, then latency at a steady load.

    Start-up is excluded: the consumer's processes start first and, once each
    has a pull request waiting, drain a first backlog of
    :attr:`runs.Options.warm_messages` (at most ``messages``) that is not
    measured. A consumer opens its database connections as it needs them, and
    PostgreSQL plans a prepared statement anew for its first five executions
    on each connection: an eop worker's pool of 8 to 16 connections took
    thousands of messages to get there, the hand-written consumer's 2 a few
    batches, and a drain that started cold charged that difference to eop's
    CPU a message. Then the consumer is paused, the backlog published and the
    consumer resumed: every process drains it warm, from the start, and the
    CPU a message counts from the resume to the last ack.
    """
    argv = bench.command(run, extra)
    processes = run_processes(run, extra)
    child = harness.Child(argv, bench.tmp / f"{run.key}.log")
    warm = min(bench.options.warm_messages, messages)
    try:
        await bench.warm(run, child, processes * run.pulls_waiting)
        if warm:
            await bench.publish(run, warm)
            await bench.drain(run, child, warm, f"({run.key}) warming up")
        await bench.pause(run, True)
        await bench.publish(run, messages)
        since = bench.cpu(child)
        await bench.pause(run, False)
        label = f"({run.key}) {run.label}"
        drained = await bench.drain(run, child, warm + messages, label, cpu_since=since)
        load = max(1.0, bench.options.latency_load * drained.rate)
        sent, paced = await bench.publish_paced(run, load, bench.options.latency_s)
        await bench.drain(run, child, warm + messages + sent, f"({run.key}) latency drain")
    finally:
        await child.stop()
    points = await bench.points(run, warm + 1, warm + messages + sent)
    bulk = sorted(done for seq, _, done in points if seq <= warm + messages)
    latencies = sorted(done - stored for seq, stored, done in points if seq > warm + messages)
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
        pg_parts_us=dict(drained.cpu_us.pg_parts),
    )


def run_processes(run: runs.Run, extra: Sequence[str] = ()) -> int:
    """How many consumer processes the run had: ``--processes N`` of an eop worker wins."""
    flags = [*run.args.split(), *extra]
    if run.handler and "--processes" in flags:
        return int(flags[flags.index("--processes") + 1])
    return run.processes if not run.handler else runs.PROCESSES


async def measure_big(bench: harness.Bench, total: int) -> BigResult:
    """eop default over ``total`` messages: the rate, the worker's CPU and memory, and the
    inbox early and late."""
    settings = runs.app.settings
    load_start = os.getloadavg()[0]
    await bench.publish(runs.BIG, total)
    child = harness.Child(bench.command(runs.BIG), bench.tmp / "big.log")
    samples: list[Sample] = []
    started = time.monotonic()
    vacuums_before = (await bench.inbox_table()).autovacuums

    marks: list[tuple[float, int]] = []  # (when, the watermark then)
    full = _FullCounts()

    async def sample() -> None:
        floor, _ = await bench.acked(runs.BIG)
        now = time.monotonic()
        lagged = max((w for t, w in marks if t <= now - LAG_S), default=0)
        rows, watermark = await bench.recent_inbox_rows(runs.BIG, lagged)
        marks.append((now, watermark))
        if now >= full.due:
            rows = max(rows, await full.count(bench, lagged))
        table = await bench.inbox_table()
        samples.append(Sample(floor, rows, child.cpu_s(), child.rss_bytes(), table))

    async def sample_forever() -> None:
        while True:
            await sample()
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    sampler = asyncio.create_task(sample_forever())
    try:
        await bench.drain(runs.BIG, child, total, f"(big) {runs.BIG.label}")
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        await sample()  # the end of the last window
        end_inbox = samples[-1].rows
        seconds = time.monotonic() - started
        # Nothing more arrives: the next interval's round must leave no row behind.
        await asyncio.sleep(settings.compaction_interval_s + 1.0)
        settled_inbox = await bench.inbox_rows(runs.BIG)
        await sample()
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        await child.stop()
    w = runs.WINDOW
    first, early, late = (1, w), (w + 1, 2 * w), (total - w + 1, total)
    spans = (first, early, late)
    windows = [sorted(p[2] for p in await bench.points(runs.BIG, *span)) for span in spans]
    async with bench.engine.connect() as conn:
        query = sa.text("SELECT count(*) FROM bench_effects WHERE variant = :v")
        effects = int((await conn.execute(query, {"v": runs.BIG.handler})).scalar_one())
    e, lt = window_stats(samples, early), window_stats(samples, late)
    rss = [s.rss for s in samples if s.rss is not None]
    sizes = [s.table.size_bytes for s in samples if s.table is not None]
    vacuums = max((s.table.autovacuums for s in samples if s.table is not None), default=0)
    return BigResult(
        messages=total,
        seconds=seconds,
        effects=effects,
        first_rate=throughput(windows[0]),
        early_rate=throughput(windows[1]),
        late_rate=throughput(windows[2]),
        early_cpu_us=e.cpu_us,
        late_cpu_us=lt.cpu_us,
        early_rss_mb=e.rss_mb,
        late_rss_mb=lt.rss_mb,
        max_rss_mb=max(rss) / _MB if rss else None,
        early_inbox=e.rows,
        late_inbox=lt.rows,
        max_inbox=max((s.rows for s in samples), default=0),
        end_inbox=end_inbox,
        settled_inbox=settled_inbox,
        inbox_bound=settings.max_ack_pending + settings.compaction_after_messages,
        early_inbox_mb=e.inbox_mb or 0.0,
        late_inbox_mb=lt.inbox_mb or 0.0,
        max_inbox_mb=max(sizes, default=0) / _MB,
        autovacuums=vacuums - vacuums_before,
        samples=len(samples),
        sample_interval_s=SAMPLE_INTERVAL_S,
        max_full_count_gap_s=round(full.max_gap_s, 2),
        unseen_rows=full.unseen,
        count_lag_s=LAG_S,
        load_start=round(load_start, 2),
        load_end=round(os.getloadavg()[0], 2),
    )


_MB = 1024 * 1024


class _FullCounts:
    """The long run's full counts of the inbox, spaced by their cost (:data:`FULL_COUNT_SHARE`)."""

    def __init__(self) -> None:
        self.due = 0.0
        self.max_gap_s = 0.0
        self.unseen = 0
        self._last: float | None = None

    async def count(self, bench: harness.Bench, lagged: int) -> int:
        """Count every row now, and note how many lie at or below ``lagged`` (the
        watermark the samples count above)."""
        start = time.monotonic()
        rows, above = await bench.inbox_rows_split(runs.BIG, lagged)
        took = time.monotonic() - start
        if self._last is not None:
            self.max_gap_s = max(self.max_gap_s, start - self._last)
        self._last = start
        self.unseen = max(self.unseen, rows - above)
        self.due = start + max(SAMPLE_INTERVAL_S, took / FULL_COUNT_SHARE)
        return rows


def window_stats(samples: list[Sample], window: tuple[int, int]) -> Window:
    """What the samples around ``window`` (first and last sequence) say: the most inbox
    rows from just before it to just after it, the worker's CPU microseconds per message
    across it (None if unknown), its memory and the inbox table's size just after it."""
    before = [s for s in samples if s.floor < window[0]][-1:]
    after = [s for s in samples if s.floor >= window[1]][:1]
    around = before + [s for s in samples if window[0] <= s.floor < window[1]] + after
    cpu = None
    if before and after and before[0].cpu is not None and after[0].cpu is not None:
        cpu = (after[0].cpu - before[0].cpu) / max(1, after[0].floor - before[0].floor) * 1e6
    rss = after[0].rss if after else None
    table = after[0].table if after else None
    return Window(
        rows=max((s.rows for s in around), default=0),
        cpu_us=cpu,
        rss_mb=None if rss is None else rss / _MB,
        inbox_mb=None if table is None else table.size_bytes / _MB,
    )


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
