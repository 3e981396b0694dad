"""The relay's rows of ``eop bench`` (``--runs r``): the outbox relay beside what it feeds.

(r) the relay's throughput: ``--relay-messages`` outbox rows are committed
(100 per transaction) before a relay starts, then one ``eop relay`` publishes
them; the rate runs from the first COMMIT of its marks to the last. (rw) one
default ``eop worker`` consuming those same messages, and (rp) a raw
``publish_async`` loop publishing as many, no database: the relay should keep
up with the first and is bounded by the second. (rl) and (rn): a writer
commits one row per transaction at ``--relay-rate`` for ``--relay-latency-s``
while a relay runs with its defaults, woken by NOTIFY (rl) or, on an engine
that cannot LISTEN, polling every ``outbox_poll_s`` (rn); per row, the time
from the writer's COMMIT returning to the stream storing the message (its
timestamp, taken when nats-server sends the PubAck; one host, one clock).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import async_sessionmaker

import eop
from eop import errors, outbox
from eop.message import MSG_ID_HEADER
from eop.tools.bench import harness, measurement, runs

_FILL_PER_TRANSACTION = 100
_SCHEMA = runs.app.settings.schema
_PENDING = sa.text(
    f'SELECT count(*) FROM "{_SCHEMA}".outbox WHERE subject = :s'
    " AND published_at IS NULL AND parked_at IS NULL"
)
_MARKED = sa.text(
    "SELECT extract(epoch FROM pg_xact_commit_timestamp(xmin))::float8, parked_at IS NOT NULL"
    f' FROM "{_SCHEMA}".outbox WHERE subject = :s AND (published_at IS NOT NULL'
    " OR parked_at IS NOT NULL)"
)


@dataclasses.dataclass
class Row:
    """A throughput row of the relay's section (rates in messages/s, CPU in µs/message)."""

    key: str
    label: str
    command: str
    messages: int
    rate: float
    cpu_us: float | None
    nats_us: float | None
    pg_us: float | None
    delivered: int
    """(r), (rp): messages the stream holds; (rw): effect rows. Exactly once: ``messages``."""


@dataclasses.dataclass
class Latency:
    """A commit-to-PubAck row: one outbox row per transaction at a steady rate."""

    key: str
    label: str
    command: str
    rows: int
    rate: float
    """Rows/s the writer committed."""
    p50_ms: float
    p99_ms: float
    max_ms: float
    cpu_us: float | None
    nats_us: float | None
    pg_us: float | None
    """CPU per row meanwhile: the relay's, nats-server's, PostgreSQL's (the writer's too)."""
    delivered: int
    """Rows found in the stream, exactly once each; ``rows`` if none was lost."""


@dataclasses.dataclass
class Section:
    """The relay's section of the report."""

    rows: list[Row]
    latency: list[Latency]
    poll_s: float
    fill_s: float
    """How long committing the backlog took (before the clock)."""


async def measure(bench: harness.Bench) -> Section:
    """(r), (rw), (rp), then (rl) and (rn), one after another."""
    options = bench.options
    payload = b"x" * options.relay_payload_bytes
    started = time.monotonic()
    await _fill(bench, runs.RELAY, options.relay_messages, payload)
    fill_s = time.monotonic() - started
    relayed = await _relay(bench, options.relay_messages)
    consumed = await _worker(bench, options.relay_messages)
    raw = await _raw(bench, options.relay_messages, options.relay_payload_bytes)
    relay_argv = [sys.executable, "-m", "eop", "relay", *_urls(bench)]
    polling_argv = [sys.executable, "-m", "eop.tools.bench", "relay-polling"]
    polling_argv += [bench.nats_url, bench.database_url]
    latency = [
        await _latency(bench, runs.RELAY_LATENCY[0], relay_argv, payload),
        await _latency(bench, runs.RELAY_LATENCY[1], polling_argv, payload),
    ]
    return Section(
        rows=[relayed, consumed, raw],
        latency=latency,
        poll_s=runs.app.settings.outbox_poll_s,
        fill_s=fill_s,
    )


def _urls(bench: harness.Bench) -> list[str]:
    return ["--database-url", bench.database_url, "--nats-url", bench.nats_url]


async def _fill(bench: harness.Bench, run: runs.Run, count: int, payload: bytes) -> None:
    """Commit ``count`` outbox rows, 100 per transaction, with ``eop.outbox.add``.

    Queued on an ``eop.Writes``, as a handler would, so that each transaction
    sends its rows as one ``executemany``: the filling is not measured.
    """
    sessions = async_sessionmaker(bench.engine)
    for done in range(0, count, _FILL_PER_TRANSACTION):
        chunk = min(_FILL_PER_TRANSACTION, count - done)
        async with sessions() as session, session.begin():
            queue = eop.Writes(session)
            for _ in range(chunk):
                outbox.add(queue, run.subject, payload, schema=_SCHEMA)
            await session.run_sync(queue.send)
        bench.progress.show(f"({run.key}) filling the outbox", done + chunk, count)
    bench.progress.end()


async def _relay(bench: harness.Bench, count: int) -> Row:
    run = runs.RELAY
    argv = [sys.executable, "-m", "eop", "relay", *_urls(bench)]
    child = harness.Child(argv, bench.tmp / "r.log")

    async def all_marked() -> bool:
        async with bench.engine.connect() as conn:
            pending = (await conn.execute(_PENDING, {"s": run.subject})).scalar_one()
        return int(pending) == 0

    try:
        cpu = await _watch(bench, run, child, count, f"(r) {run.label}", all_marked)
    finally:
        await child.stop()
    marks = await _marks(bench, run)
    if any(parked for _, parked in marks):
        raise errors.EopError(f"(r): the relay parked {sum(p for _, p in marks)} rows")
    return Row(
        key=run.key,
        label=f"{run.label} (LISTEN, default settings)",
        command=bench.shown(argv),
        messages=count,
        rate=measurement.throughput(sorted(at for at, _ in marks)),
        cpu_us=cpu.child,
        nats_us=cpu.nats,
        pg_us=cpu.pg,
        delivered=await bench.stream_messages(run),
    )


async def _marks(bench: harness.Bench, run: runs.Run) -> list[tuple[float, bool]]:
    """The commit time of each row's mark (published or parked), and whether it was parked."""
    async with bench.engine.connect() as conn:
        rows = (await conn.execute(_MARKED, {"s": run.subject})).all()
    return [(float(at), bool(parked)) for at, parked in rows]


async def _worker(bench: harness.Bench, count: int) -> Row:
    """One default ``eop worker`` draining what the relay published (they carry msg-ids)."""
    run = runs.RELAY
    argv = bench.command(run)
    child = harness.Child(argv, bench.tmp / "rw.log")
    try:
        drained = await bench.drain(run, child, count, "(rw) eop worker, the relay's messages")
    finally:
        await child.stop()
    points = await bench.points(run, 1, count)
    return Row(
        key="rw",
        label="eop default worker, consuming them",
        command=bench.shown(argv),
        messages=count,
        rate=measurement.throughput(sorted(done for _, _, done in points)),
        cpu_us=drained.cpu_us.child,
        nats_us=drained.cpu_us.nats,
        pg_us=drained.cpu_us.pg,
        delivered=len(points),
    )


async def _raw(bench: harness.Bench, count: int, payload_bytes: int) -> Row:
    """nats-py's ``publish_async`` with as many PubAcks pending as a relay round has."""
    run, out = runs.RAW_PUBLISH, bench.tmp / "rp.json"
    window = runs.app.settings.outbox_batch
    argv = [sys.executable, "-m", "eop.tools.bench", "publish", bench.nats_url, run.subject]
    argv += [str(count), str(payload_bytes), str(window), str(out)]
    # The servers' CPU from its start to its exit: it publishes for well under a
    # second, too short to sample as the others are, and they are idle otherwise.
    before = bench.cpu()
    child = harness.Child(argv, bench.tmp / "rp.log")
    try:
        await _watch(bench, run, child, count, f"(rp) {run.label}")
        # It exits by itself once every PubAck is in and its figures are written.
        await asyncio.to_thread(child.proc.wait, 60)
        if child.proc.returncode != 0:
            raise errors.EopError(f"(rp) exited with {child.proc.returncode}: {child.tail()}")
    finally:
        await child.stop()
    servers = before.per_message_us(bench.cpu(), count)
    report: dict[str, Any] = json.loads(out.read_text())
    if report["failed"]:
        raise errors.EopError(f"(rp): {report['failed']} publishes failed")
    span = report["end"] - report["first_ack"]
    return Row(
        key=run.key,
        label=f"raw publish_async, {window:,} pending",
        command=bench.shown(argv),
        messages=count,
        rate=(count - 1) / span if span > 0 else 0.0,
        cpu_us=report["cpu_s"] / count * 1e6,
        nats_us=servers.nats,
        pg_us=servers.pg,
        delivered=await bench.stream_messages(run),
    )


async def _watch(
    bench: harness.Bench,
    run: runs.Run,
    child: harness.Child,
    target: int,
    label: str,
    finished: Callable[[], Awaitable[bool]] | None = None,
) -> harness.Cpu:
    """Wait until ``run``'s stream holds ``target`` messages (and ``finished``).

    Returns the CPU per message of the child and the servers from the first
    message stored to the end, as :meth:`~eop.tools.bench.harness.Bench.drain` does.
    """
    base = await bench.stream_messages(run)
    first: tuple[float, int, harness.Cpu] | None = None
    last_move, last_count = time.monotonic(), base
    while True:
        count = await bench.stream_messages(run)
        now = time.monotonic()
        if first is None and count > base:
            first = (now, count, bench.cpu(child))
        rate = (count - first[1]) / (now - first[0]) if first and now > first[0] else None
        bench.progress.show(label, count - base, target - base, rate)
        if count >= target and (finished is None or await finished()):
            bench.progress.end()
            if first is None:
                return harness.Cpu(None, None, None)
            return first[2].per_message_us(bench.cpu(child), target - first[1])
        if count != last_count:
            last_move, last_count = now, count
        elif now - last_move > 60:
            raise errors.EopError(f"{label}: stuck at {count:,} for 60 s ({child.tail()})")
        if child.proc.poll() not in (None, 0):
            child.check()
        await asyncio.sleep(0.1)


async def _latency(bench: harness.Bench, run: runs.Run, argv: list[str], payload: bytes) -> Latency:
    """A relay from ``argv``; one row per COMMIT at the steady rate; COMMIT to stored."""
    options = bench.options
    child = harness.Child(argv, bench.tmp / f"{run.key}.log")
    try:
        # One row first: once it is in the stream, the relay leads (and LISTENs).
        committed = await _write_paced(bench, run, payload, 1, 1.0, f"({run.key}) warming up")
        await _watch(bench, run, child, 1, f"({run.key}) relay starting")
        before = bench.cpu(child)
        label = f"({run.key}) {options.relay_rate:,.0f} commits/s"
        started = time.monotonic()
        paced = await _write_paced(
            bench, run, payload, options.relay_rate, options.relay_latency_s, label
        )
        seconds = time.monotonic() - started
        await _watch(bench, run, child, 1 + len(paced), f"({run.key}) relay catching up")
        cpu = before.per_message_us(bench.cpu(child), len(paced))
    finally:
        await child.stop()
    committed.update(paced)
    stored = await _stored(bench, run, len(committed))
    latencies = sorted(stored[m] - paced[m] for m in paced if m in stored)
    return Latency(
        key=run.key,
        label=run.label,
        command=bench.shown(argv),
        rows=len(paced),
        rate=len(paced) / seconds,
        p50_ms=measurement.percentile(latencies, 0.50) * 1000,
        p99_ms=measurement.percentile(latencies, 0.99) * 1000,
        max_ms=(latencies[-1] if latencies else 0.0) * 1000,
        cpu_us=cpu.child,
        nats_us=cpu.nats,
        pg_us=cpu.pg,
        delivered=len(latencies),
    )


async def _write_paced(
    bench: harness.Bench, run: runs.Run, payload: bytes, rate: float, seconds: float, label: str
) -> dict[str, float]:
    """One ``eop.outbox.add`` per transaction at ``rate``; each row's msg-id and the time
    its COMMIT returned."""
    sessions = async_sessionmaker(bench.engine)
    loop = asyncio.get_running_loop()
    total, start = max(1, int(rate * seconds)), loop.time()
    committed: dict[str, float] = {}
    for i in range(total):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        async with sessions() as session, session.begin():
            msg_id = outbox.add(session, run.subject, payload, schema=_SCHEMA)
        committed[msg_id] = time.time()
        if i % 50 == 0 or i == total - 1:
            bench.progress.show(label, i + 1, total)
    bench.progress.end()
    return committed


async def _stored(bench: harness.Bench, run: runs.Run, count: int) -> dict[str, float]:
    """Each message's msg-id and stream timestamp, read back (raises on a duplicate)."""
    from nats.js import api

    js = bench.stream
    config = api.ConsumerConfig(durable_name=run.durable, ack_policy=api.AckPolicy.NONE)
    await js.add_consumer(run.stream, config)
    sub = await js.pull_subscribe_bind(durable=run.durable, stream=run.stream)
    stored: dict[str, float] = {}
    try:
        while len(stored) < count:
            for msg in await sub.fetch(min(1000, count - len(stored)), timeout=10):
                msg_id = (msg.headers or {})[MSG_ID_HEADER]
                if msg_id in stored:
                    raise errors.EopError(f"({run.key}): a message is in the stream twice")
                stored[msg_id] = msg.metadata.timestamp.timestamp()
    finally:
        await sub.unsubscribe()
    return stored
