"""``eop bench``: eop's throughput and latency beside the loops it replaces.

One run starts its own nats-server and PostgreSQL (eop.embedded, free ports)
and measures on them, one after another and each in its own process: (a) a
raw at-least-once loop (fetch + plain ack, no database); (b) the naive
exactly-once loop (per message a transaction with an inbox claim and one
INSERT, then one sequential ack_sync); (c) an `eop worker` with the default
settings; (d) an `eop worker` with the --tuned flags and a batch handler.
(b), (c) and (d) do the same handler work: one INSERT per message.

Throughput: a backlog is published, then drained; the rate runs from the
first completion to the last, so start-up is excluded. Latency: then messages
are published at a steady share (--latency-load) of that rate for
--latency-s; publish-to-commit is the commit time of the effect row
(track_commit_timestamp) minus the stream timestamp ((a): publish-to-ack).
--big measures eop default at 10,000 and at 1,000,000 processed messages,
with the inbox row count at both points.

This module is also the app of the bench's workers (``eop.bench:app``) and
the program of the (a) and (b) child processes (``python -m eop.bench``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

import eop
from eop import errors
from eop import settings as settings_mod

_INSERT = sa.text("INSERT INTO bench_effects (variant, seq, stored_at) VALUES (:v, :s, :t)")
_NAIVE_CLAIM = sa.text(
    "INSERT INTO bench_naive_inbox (stream, seq) VALUES (:st, :s) "
    "ON CONFLICT DO NOTHING RETURNING seq"
)
_DDL = (
    "CREATE TABLE bench_effects (variant text NOT NULL, seq bigint NOT NULL,"
    " stored_at timestamptz NOT NULL)",
    "CREATE TABLE bench_naive_inbox (stream text, seq bigint, PRIMARY KEY (stream, seq))",
)
_POINTS = sa.text(
    "SELECT seq, extract(epoch FROM stored_at)::float8,"
    " extract(epoch FROM pg_xact_commit_timestamp(xmin))::float8"
    " FROM bench_effects WHERE variant = :v AND seq BETWEEN :lo AND :hi"
)
_FETCH_BATCH = 64  # (a) and (b) fetch as many as eop's default --batch
_WINDOW = 10_000  # the --big run's windows: messages 10,001-20,000 and the last 10,000

# Default settings, never the environment's: the bench passes the servers' URLs as
# `eop worker` flags, and a caller's EOP_* variables must not tune the default run.
app = eop.App(settings=settings_mod.Settings())


def _row(msg: eop.Message) -> dict[str, Any]:
    return {"v": msg.subscription, "s": msg.seq, "t": msg.timestamp}


async def record(msg: eop.Message, session: AsyncSession) -> None:
    """The handler work of every database run: one INSERT per message."""
    await session.execute(_INSERT, _row(msg))


async def record_batch(msgs: list[eop.Message], session: AsyncSession) -> None:
    """The same INSERT per message, for a whole batch in one (pipelined) executemany."""
    await session.execute(_INSERT, [_row(m) for m in msgs])


@dataclasses.dataclass(frozen=True)
class Run:
    """One measured consumer: its stream, its durable consumer, its eop handler if any."""

    key: str
    label: str
    stream: str
    durable: str
    handler: str = ""

    @property
    def subject(self) -> str:
        """The one subject of the run's stream."""
        return self.stream.lower().replace("_", ".")


RUNS = (
    Run("a", "raw at-least-once (fetch + ack)", "BENCH_A", "bench-raw"),
    Run("b", "naive exactly-once", "BENCH_B", "bench-naive"),
    Run("c", "eop default", "BENCH_C", "eop-bench-default", "bench-default"),
    Run("d", "eop tuned (batch handler)", "BENCH_D", "eop-bench-tuned", "bench-tuned"),
)
BIG = Run("big", "eop default, long run", "BENCH_BIG", "eop-bench-big", "bench-big")
for _run in (*RUNS, BIG):
    app.stream(_run.stream, subjects=[_run.subject])
for _run, _func in ((RUNS[2], record), (RUNS[3], record_batch), (BIG, record)):
    app.handler(
        stream=_run.stream, subject=_run.subject, name=_run.handler, batch=_func is record_batch
    )(_func)


@dataclasses.dataclass(frozen=True)
class Options:
    """The choices of one ``eop bench``."""

    messages: int = 20_000
    naive_messages: int = 3_000
    payload_bytes: int = 100
    latency_s: float = 3.0
    latency_load: float = 0.5
    tuned: str = "--batch 128 --concurrency 256 --log-level warning"
    big: bool = False
    big_messages: int = 1_010_000
    fsync: bool = True

    def __post_init__(self) -> None:
        if min(self.messages, self.naive_messages, self.payload_bytes) < 1:
            raise errors.ConfigurationError("message counts and payload-bytes must be at least 1")
        if not (0 < self.latency_load <= 1 and self.latency_s > 0):
            raise errors.ConfigurationError("latency-load must be in (0, 1], latency-s above 0")
        if self.big and self.big_messages < 3 * _WINDOW:
            raise errors.ConfigurationError(f"big-messages must be at least {3 * _WINDOW:,}")


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
    latency_messages: int
    latency_rate: float
    p50_ms: float
    p99_ms: float
    effects: int | None
    """Effect rows of the run ((a): None); exactly-once means one per message."""


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


class _Sample(NamedTuple):
    floor: int
    rows: int
    cpu: float | None


class Progress:
    """One status line: redrawn in place on a terminal, printed every few seconds otherwise."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._printed = 0.0
        self._width = 0

    def show(self, label: str, done: int, total: int, rate: float | None = None) -> None:
        """Report ``done`` of ``total`` (and the current rate) for ``label``."""
        bar = "#" * int(24 * min(1.0, done / total)) if total > 0 else ""
        text = f"{label:<34} [{bar:<24}] {done:>9,}/{total:,}"
        text += f"  {rate:,.0f} msg/s" if rate else ""
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
        elif now - self._printed >= 5.0 or done >= total:
            self.stream.write(text + "\n")
            self._printed = now
        self.stream.flush()

    def end(self) -> None:
        """Close the current line."""
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
        self._width, self._printed = 0, 0.0


class Child:
    """A run's consumer process, its output kept in a log file."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log_path = log_path
        # No EOP_* variable of the caller's: the default run must run on defaults.
        env = {k: v for k, v in os.environ.items() if not k.startswith("EOP_")}
        with log_path.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)

    def tail(self) -> str:
        """The last lines of the child's output."""
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-5:]) or "no output"

    def cpu_s(self) -> float | None:
        """The CPU time (user + system) the child used so far; None if unknown (not Linux)."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")

    def check(self) -> None:
        """Raise if the child has exited."""
        if self.proc.poll() is not None:
            raise errors.EopError(f"child exited with {self.proc.returncode}: {self.tail()}")

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; wait for the exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.proc.wait, 30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)


class Bench:
    """The servers' clients and the steps that the runs share."""

    def __init__(self, options: Options, nats_url: str, database_url: str, tmp: Path) -> None:
        self.options, self.tmp = options, tmp
        self.nats_url, self.database_url = nats_url, database_url
        self.progress = Progress()
        self.payload = b"x" * options.payload_bytes
        self.engine: AsyncEngine = create_async_engine(database_url)
        self.js: Any = None

    async def start(self, nc: Any) -> None:
        """Create the bench's tables, its streams, and the consumers of (a) and (b)."""
        from nats.js import api

        from eop import jetstream

        self.js = nc.jetstream()
        async with self.engine.begin() as conn:
            for ddl in _DDL:
                await conn.execute(sa.text(ddl))
        for run in (*RUNS, BIG):
            await jetstream.ensure_stream(self.js, app.stream_spec(run.stream), create=True)
            if not run.handler:  # as eop makes them: explicit acks, the default limits
                config = api.ConsumerConfig(
                    durable_name=run.durable,
                    ack_policy=api.AckPolicy.EXPLICIT,
                    max_ack_pending=app.settings.max_ack_pending,
                )
                await self.js.add_consumer(run.stream, config)

    def command(self, run: Run, extra: Sequence[str] = ()) -> list[str]:
        """The argv of a run's consumer process."""
        if not run.handler:
            out = str(self.tmp / f"{run.key}.records")
            child = [run.key, self.nats_url, self.database_url, run.stream, run.durable, out]
            return [sys.executable, "-m", "eop.bench", *child]
        urls = ["--database-url", self.database_url, "--nats-url", self.nats_url]
        worker = ["worker", "eop.bench:app", "--handler", run.handler, *urls, *extra]
        return [sys.executable, "-m", "eop", *worker]

    async def publish(self, run: Run, count: int) -> None:
        """Publish a backlog of ``count`` messages, confirmed, 1,000 at a time."""
        for sent in range(0, count, 1000):
            chunk = min(1000, count - sent)
            await asyncio.gather(
                *(self.js.publish(run.subject, self.payload) for _ in range(chunk))
            )
            self.progress.show(f"({run.key}) publishing", sent + chunk, count)
        self.progress.end()

    async def publish_paced(self, run: Run, rate: float, seconds: float) -> tuple[int, float]:
        """Publish at ``rate`` messages/s for ``seconds``; (messages, the rate achieved)."""
        loop = asyncio.get_running_loop()
        total, sent, start = max(1, int(rate * seconds)), 0, loop.time()
        while sent < total:
            due = min(total, int((loop.time() - start) * rate) + 1)
            await asyncio.gather(
                *(self.js.publish(run.subject, self.payload) for _ in range(due - sent))
            )
            sent = due
            self.progress.show(f"({run.key}) latency at {rate:,.0f} msg/s", sent, total)
            await asyncio.sleep(0.005)
        self.progress.end()
        return total, total / max(loop.time() - start, 1e-9)

    async def acked(self, run: Run) -> tuple[int, int]:
        """The consumer's ack floor and its deliveries awaiting an ack ((0, 0) if absent)."""
        import nats.js.errors

        try:
            info = await self.js.consumer_info(run.stream, run.durable)
        except nats.js.errors.NotFoundError:  # an eop worker creates its consumer as it starts
            return 0, 0
        return int(info.ack_floor.stream_seq), int(info.num_ack_pending)

    async def drain(
        self, run: Run, child: Child, target: int, label: str
    ) -> tuple[float, float | None]:
        """Wait until every sequence up to ``target`` is acked.

        Returns the rate seen since the first ack, and the child's CPU time per
        message meanwhile in microseconds (None if unknown).
        """
        base, _ = await self.acked(run)
        first: tuple[float, int, float | None] | None = None
        rate, last_move, last_floor = 0.0, time.monotonic(), base
        while True:
            floor, pending = await self.acked(run)
            now = time.monotonic()
            if first is None and floor > base:
                first = (now, floor, child.cpu_s())
            elif first is not None and now > first[0]:
                rate = (floor - first[1]) / (now - first[0])
            self.progress.show(label, floor - base, target - base, rate)
            if floor >= target and pending == 0:
                self.progress.end()
                cpu = child.cpu_s()
                if first is None or first[2] is None or cpu is None or floor <= first[1]:
                    return rate, None
                return rate, (cpu - first[2]) / (floor - first[1]) * 1e6
            if floor != last_floor:
                last_move, last_floor = now, floor
            elif now - last_move > 60:
                raise errors.EopError(f"{label}: stuck at {floor:,} for 60 s ({child.tail()})")
            child.check()
            await asyncio.sleep(0.1)

    async def points(self, run: Run, first: int, last: int) -> list[tuple[int, float, float]]:
        """(sequence, stored at, done at) of the run's messages ``first`` to ``last``."""
        if run.key == "a":
            lines = (self.tmp / "a.records").read_text().splitlines()
            rows: Any = (line.split() for line in lines)
        else:
            async with self.engine.connect() as conn:
                params = {"v": run.handler or run.durable, "lo": first, "hi": last}
                rows = (await conn.execute(_POINTS, params)).all()
        points = [(int(s), float(stored), float(done)) for s, stored, done in rows]
        return [p for p in points if first <= p[0] <= last]

    async def inbox_rows(self, run: Run) -> int:
        """The inbox rows of an eop run, now."""
        schema = app.settings.schema
        query = sa.text(f'SELECT count(*) FROM "{schema}".inbox WHERE subscription = :s')
        async with self.engine.connect() as conn:
            return int((await conn.execute(query, {"s": run.handler})).scalar_one())


async def measure(bench: Bench, run: Run, messages: int, extra: Sequence[str] = ()) -> Result:
    """Throughput while draining a backlog of ``messages``, then latency at a steady load."""
    await bench.publish(run, messages)
    argv = bench.command(run, extra)
    child = Child(argv, bench.tmp / f"{run.key}.log")
    try:
        estimate, cpu_us = await bench.drain(run, child, messages, f"({run.key}) {run.label}")
        load = max(1.0, bench.options.latency_load * estimate)
        sent, paced = await bench.publish_paced(run, load, bench.options.latency_s)
        await bench.drain(run, child, messages + sent, f"({run.key}) latency drain")
    finally:
        await child.stop()
    points = await bench.points(run, 1, messages + sent)
    bulk = sorted(done for seq, _, done in points if seq <= messages)
    latencies = sorted(done - stored for seq, stored, done in points if seq > messages)
    shown = shlex.join([Path(argv[0]).name, *argv[1:]])
    return Result(
        key=run.key,
        label=run.label,
        command=shown.replace(bench.database_url, "DB").replace(bench.nats_url, "NATS"),
        messages=messages,
        rate=throughput(bulk),
        cpu_us=cpu_us,
        latency_messages=sent,
        latency_rate=paced,
        p50_ms=percentile(latencies, 0.50) * 1000,
        p99_ms=percentile(latencies, 0.99) * 1000,
        effects=None if run.key == "a" else len(points),
    )


async def measure_big(bench: Bench, total: int) -> BigResult:
    """eop default over ``total`` messages: the rate and the inbox rows early and late."""
    await bench.publish(BIG, total)
    child = Child(bench.command(BIG), bench.tmp / "big.log")
    samples: list[_Sample] = []
    started = time.monotonic()

    async def sample() -> None:
        floor, _ = await bench.acked(BIG)
        samples.append(_Sample(floor, await bench.inbox_rows(BIG), child.cpu_s()))

    async def sample_forever() -> None:
        while True:
            await sample()
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample_forever())
    try:
        await bench.drain(BIG, child, total, f"(big) {BIG.label}")
        await sample()  # the end of the last window
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        await child.stop()
    seconds = time.monotonic() - started
    early, late = (_WINDOW + 1, 2 * _WINDOW), (total - _WINDOW + 1, total)
    rates = [sorted(p[2] for p in await bench.points(BIG, *w)) for w in (early, late)]
    async with bench.engine.connect() as conn:
        query = sa.text("SELECT count(*) FROM bench_effects WHERE variant = :v")
        effects = int((await conn.execute(query, {"v": BIG.handler})).scalar_one())
    (early_inbox, early_cpu), (late_inbox, late_cpu) = (_window(samples, w) for w in (early, late))
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


def _window(samples: list[_Sample], window: tuple[int, int]) -> tuple[int, float | None]:
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


# --- the child processes of (a) and (b) ----------------------------------------------


async def _child(
    kind: str, nats_url: str, db_url: str, stream: str, durable: str, out: str
) -> None:
    """Consume until SIGTERM: (a) with plain acks, (b) in the naive exactly-once loop."""
    import nats
    import nats.errors

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    nc = await nats.connect(nats_url)
    sub = await nc.jetstream().pull_subscribe_bind(durable=durable, stream=stream)
    engine = create_async_engine(db_url, pool_size=1)
    done: list[tuple[Any, float]] = []
    while not stop.is_set():
        try:
            msgs = await sub.fetch(_FETCH_BATCH, timeout=1.0)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            continue
        if kind == "a":
            for msg in msgs:
                await msg.ack()
                done.append((msg, time.time()))
        else:
            await _naive(engine, stream, msgs)
    await nc.flush()
    with open(out, "w") as file:  # noqa: ASYNC230  # once, after the measurement
        for msg, at in done:
            meta = msg.metadata  # parsed only now, to keep (a) as lean as it can be
            file.write(f"{meta.sequence.stream} {meta.timestamp.timestamp()} {at}\n")
    await nc.close()
    await engine.dispose()


async def _naive(engine: AsyncEngine, stream: str, msgs: list[Any]) -> None:
    """Exactly-once written plainly: per message one transaction, then one ``ack_sync``."""
    for msg in msgs:
        meta = msg.metadata
        seq = meta.sequence.stream
        # A session, as eop hands its handlers: the same INSERT through the same API.
        async with AsyncSession(engine) as session, session.begin():
            claimed = await session.execute(_NAIVE_CLAIM, {"st": stream, "s": seq})
            if claimed.first() is not None:
                await session.execute(_INSERT, {"v": "bench-naive", "s": seq, "t": meta.timestamp})
        await msg.ack_sync(timeout=5.0)


# --- the command ---------------------------------------------------------------------

_FLAGS: tuple[tuple[str, Any, str], ...] = (
    ("messages", int, "backlog of each of the runs (a), (c), (d)"),
    ("naive-messages", int, "backlog of the naive run (b), which is slow"),
    ("payload-bytes", int, "size of every message's payload"),
    ("latency-s", float, "length of each run's steady-load latency phase"),
    ("latency-load", float, "publish rate of the latency phase, as a share of the run's rate"),
    ("tuned", str, "`eop worker` flags of the tuned run (d), which has a batch handler"),
    ("big", bool, "also the long run: --big-messages through eop default (minutes)"),
    ("big-messages", int, "messages of the long run (rates at 10k-20k and the last 10k)"),
    ("fsync", bool, "PostgreSQL with fsync on, as in production"),
)


def add_command(sub: Any) -> None:
    """Add ``bench`` to the subparsers of ``eop``."""
    parser = sub.add_parser(
        "bench",
        help="measure eop beside a raw and a naive loop, on embedded servers",
        description=(__doc__ or "").split("\n\n")[1],
    )
    defaults = Options()
    for flag, kind, help_text in _FLAGS:
        var = "EOP_BENCH_" + flag.upper().replace("-", "_")
        default = getattr(defaults, flag.replace("-", "_"))
        raw = os.environ.get(var)
        parser.add_argument(
            f"--{flag}",
            default=default if raw is None else _parse_env(var, kind, raw),
            help=f"{help_text} [env: {var}; default: {default}]",
            **({"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}),
        )
    parser.add_argument(
        "--json",
        metavar="FILE",
        default=os.environ.get("EOP_BENCH_JSON"),
        help="also write the results as JSON to FILE ('-': stdout, instead of the table) "
        "[env: EOP_BENCH_JSON]",
    )
    parser.set_defaults(command=run_command)


_BOOLS = {**dict.fromkeys(("1", "true", "yes", "on"), True)}
_BOOLS.update(dict.fromkeys(("0", "false", "no", "off"), False))


def _parse_env(var: str, kind: Any, raw: str) -> Any:
    try:
        if kind is not bool:
            return kind(raw)
        return _BOOLS[raw.strip().lower()]
    except (KeyError, ValueError):
        # Like the other commands: a sentence, not a traceback (the parser is built early).
        raise SystemExit(f"eop: error: {var}={raw!r} is not a valid {kind.__name__}") from None


def run_command(args: argparse.Namespace) -> int:
    """Run ``eop bench``: print the table (and write the JSON)."""
    report = run(Options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Options)}))
    if args.json == "-":
        print(json.dumps(report, indent=2))
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    return 0


def run(options: Options) -> dict[str, Any]:
    """Start the servers, run every measurement, return the report."""
    from eop import embedded, migrate

    started, machine = time.monotonic(), _machine()
    with (
        tempfile.TemporaryDirectory(prefix="eop-bench-") as tmp,
        embedded.NatsServer() as nats_server,
        # Commit times of the effect rows give publish-to-commit latency.
        embedded.PostgresServer(
            fsync=options.fsync, settings={"track_commit_timestamp": "on"}
        ) as pg,
    ):
        migrate.upgrade(pg.url)
        results, big = asyncio.run(_run_all(options, nats_server.url, pg.url, Path(tmp)))
    rate = {r.key: r.rate for r in results}
    machine["load_average_end"] = round(os.getloadavg()[0], 2)
    return {
        "options": dataclasses.asdict(options),
        "machine": machine,
        "runs": [dataclasses.asdict(r) for r in results],
        "ratios": {
            name: rate[x] / rate[y] if rate[y] else 0.0
            for name, x, y in (("c/a", "c", "a"), ("c/b", "c", "b"), ("d/a", "d", "a"))
        },
        "big": dataclasses.asdict(big) if big else None,
        "seconds": round(time.monotonic() - started, 1),
    }


async def _run_all(
    options: Options, nats_url: str, database_url: str, tmp: Path
) -> tuple[list[Result], BigResult | None]:
    import nats

    bench = Bench(options, nats_url, database_url, tmp)
    nc = await nats.connect(nats_url)
    try:
        await bench.start(nc)
        results = []
        for run_ in RUNS:
            count = options.naive_messages if run_.key == "b" else options.messages
            extra = shlex.split(options.tuned) if run_.key == "d" else ()
            results.append(await measure(bench, run_, count, extra))
        big = await measure_big(bench, options.big_messages) if options.big else None
        return results, big
    finally:
        await nc.close()
        await bench.engine.dispose()


def _machine() -> dict[str, Any]:
    from eop import embedded

    cpu = platform.machine()
    with contextlib.suppress(OSError):
        names = [line for line in Path("/proc/cpuinfo").read_text().splitlines()]
        cpu = next((n.split(":", 1)[1].strip() for n in names if n.startswith("model name")), cpu)
    nats_server = [str(embedded.nats_server_binary()), "--version"]
    postgres = [str(embedded.postgres_bin_dir() / "postgres"), "--version"]
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "system": platform.platform(),
        "python": platform.python_version(),
        "servers": [
            subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()
            for argv in (nats_server, postgres)
        ],
        "load_average_start": round(os.getloadavg()[0], 2),
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as a table for people."""
    o, m, ratios = report["options"], report["machine"], report["ratios"]
    lines = [
        f"eop bench: {o['payload_bytes']}-byte messages; latency at {o['latency_load']:.0%} of "
        f"each run's rate for {o['latency_s']} s; fsync {'on' if o['fsync'] else 'off'}",
        f"machine: {m['cores']} cores ({m['cpu']}), {m['system']}, Python {m['python']}; "
        f"{'; '.join(m['servers'])}; load average {m['load_average_start']} -> "
        f"{m['load_average_end']}",
        "",
        f"{'run':<34}{'messages':>9}{'msg/s':>9}{'CPU us/msg':>11}{'p50 ms':>8}{'p99 ms':>8}"
        "  latency load",
    ]
    for r in report["runs"]:
        cpu = _us(r["cpu_us"])
        lines.append(
            f"({r['key']}) {r['label']:<30}{r['messages']:>9,}{r['rate']:>9,.0f}{cpu:>11}"
            f"{r['p50_ms']:>8.1f}{r['p99_ms']:>8.1f}  {r['latency_rate']:,.0f} msg/s"
        )
        expected = r["messages"] + r["latency_messages"]
        if r["effects"] is not None and r["effects"] != expected:
            lines.append(f"    WARNING: {r['effects']} effect rows for {expected} messages")
    lines += [
        "",
        f"c/a = {ratios['c/a']:.2f} (target >= 0.6)   c/b = {ratios['c/b']:.1f} (target >= 15)"
        f"   d/a = {ratios['d/a']:.2f}",
    ]
    big = report["big"]
    if big:
        lines += [
            f"long run: {big['messages']:,} messages in {big['seconds']:.0f} s "
            f"({big['effects']:,} effect rows): {big['early_rate']:,.0f} msg/s at 10k-20k, "
            f"{big['late_rate']:,.0f} msg/s at the last 10k "
            f"(ratio {big['late_rate'] / max(big['early_rate'], 1e-9):.2f}, target >= 0.9)",
            f"worker CPU: {_us(big['early_cpu_us'])} us/msg at 10k-20k, "
            f"{_us(big['late_cpu_us'])} us/msg at the last 10k",
            f"inbox rows: at most {big['early_inbox']:,} at 10k-20k, {big['late_inbox']:,} at "
            f"the last 10k, {big['max_inbox']:,} over the whole run",
        ]
    lines += ["", "consumers:"] + [f"  ({r['key']}) {r['command']}" for r in report["runs"]]
    return "\n".join([*lines, f"took {report['seconds']:.0f} s"])


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


if __name__ == "__main__":
    asyncio.run(_child(*sys.argv[1:7]))
