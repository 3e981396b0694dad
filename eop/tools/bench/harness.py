"""The bench's clients of the servers, its child processes and its progress line."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import sqlalchemy as sa
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from eop import errors
from eop.tools.bench import cpulimit, pgparts, procstat, runs

_DDL = (
    "CREATE TABLE bench_effects (variant text NOT NULL, seq bigint NOT NULL,"
    " stored_at timestamptz NOT NULL)",
    "CREATE TABLE bench_naive_inbox (stream text, seq bigint, PRIMARY KEY (stream, seq))",
    "CREATE TABLE bench_hand_inbox (stream text, seq bigint, PRIMARY KEY (stream, seq))",
    # The hand-written poison flood's dead letters: what eop's keep that a replay needs.
    "CREATE TABLE bench_hand_dead (stream text, seq bigint, subject text NOT NULL,"
    " payload bytea NOT NULL, error text NOT NULL, traceback text NOT NULL,"
    " delivered integer NOT NULL, PRIMARY KEY (stream, seq))",
)
_POINTS = sa.text(
    "SELECT seq, extract(epoch FROM stored_at)::float8,"
    " extract(epoch FROM pg_xact_commit_timestamp(xmin))::float8"
    " FROM bench_effects WHERE variant = :v AND seq BETWEEN :lo AND :hi"
)


class Servers(NamedTuple):
    """The servers a bench measures on, and its scratch directory."""

    tmp: Path
    nats_url: str
    pg_url: str
    pids: tuple[int | None, int | None]
    pg_data: Path | None = None
    """PostgreSQL's data directory (its WAL and log: :mod:`eop.tools.bench.pgcount`)."""


@contextlib.contextmanager
def servers(
    *,
    fsync: bool,
    prefix: str,
    pg_settings: Mapping[str, str] | None = None,
    pg_cpus: float = 0.0,
) -> Iterator[Servers]:
    """A nats-server and a migrated PostgreSQL of the bench's own, on free ports; the
    PostgreSQL with ``pg_settings`` too, and with ``pg_cpus`` held to that many cores
    (:func:`eop.tools.bench.cpulimit.limited`)."""
    from eop.pg import migrate
    from eop.tools import embedded

    # Commit times of the effect rows give publish-to-commit latency.
    settings = {"track_commit_timestamp": "on", **(pg_settings or {})}
    with (
        tempfile.TemporaryDirectory(prefix=prefix) as tmp,
        embedded.NatsServer() as nats_server,
        embedded.PostgresServer(fsync=fsync, settings=settings) as pg,
        contextlib.ExitStack() as stack,
    ):
        migrate.upgrade(pg.url)
        if pg_cpus and pg.pid is not None:
            stack.enter_context(cpulimit.limited(pg.pid, pg_cpus))
        pids = (nats_server.pid, pg.pid)
        yield Servers(Path(tmp), nats_server.url, pg.url, pids, pg.data_dir)


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


class Cpu(NamedTuple):
    """CPU seconds so far: of a run's process (and its children), nats-server, PostgreSQL,
    and PostgreSQL's by :data:`pgparts.PARTS` (empty if unknown)."""

    child: float | None
    nats: float | None
    pg: float | None
    pg_parts: Mapping[str, float] = {}

    def per_message_us(self, later: Cpu, messages: int) -> Cpu:
        """Microseconds per message of each, from this sample to ``later`` (None if unknown)."""

        def us(before: float | None, after: float | None) -> float | None:
            if before is None or after is None or messages <= 0:
                return None
            return (after - before) / messages * 1e6

        parts = {
            name: us(self.pg_parts.get(name), later.pg_parts.get(name)) for name in pgparts.PARTS
        }
        return Cpu(
            us(self.child, later.child),
            us(self.nats, later.nats),
            us(self.pg, later.pg),
            {name: value for name, value in parts.items() if value is not None},
        )


class Drained(NamedTuple):
    """A drain: the rate since the first ack, and CPU µs per message meanwhile."""

    rate: float
    cpu_us: Cpu


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
        """The CPU time (user + system) the child and its own children used so far.

        An ``eop worker`` with more than one process is a supervisor and its
        worker processes: all of them count. None if unknown (not Linux).
        """
        stats = procstat.snapshot()
        if self.proc.pid not in stats:
            return None
        return sum(s.own_s for pid, s in stats.items() if self.proc.pid in (pid, s.ppid))

    def rss_bytes(self) -> int | None:
        """Resident memory of the child and its own children (a supervised worker's
        processes), from /proc; None if unknown (not Linux, or not running)."""
        pids = [pid for pid, s in procstat.snapshot().items() if self.proc.pid in (pid, s.ppid)]
        if self.proc.pid not in pids:
            return None
        pages = 0
        for pid in pids:
            try:
                pages += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
        return pages * os.sysconf("SC_PAGE_SIZE")

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

    def __init__(
        self,
        options: runs.Options,
        nats_url: str,
        database_url: str,
        tmp: Path,
        server_pids: tuple[int | None, int | None] = (None, None),
    ) -> None:
        self.options, self.tmp = options, tmp
        self.nats_url, self.database_url = nats_url, database_url
        self.server_pids = server_pids
        """nats-server's and the postmaster's process ids, for their CPU time."""
        self.progress = Progress()
        self.payload = b"x" * options.payload_bytes
        self.engine: AsyncEngine = create_async_engine(database_url)
        self.js: JetStreamContext | None = None
        self.nc: NATS | None = None

    @property
    def stream(self) -> JetStreamContext:
        """The JetStream context, once :meth:`start` made it."""
        if self.js is None:
            raise RuntimeError("Bench.start() first")
        return self.js

    async def start(self, nc: NATS) -> None:
        """Create the bench's tables, its streams, and the consumers of (a) and (b)."""
        from nats.js import api

        from eop.broker import jetstream

        self.nc, self.js = nc, nc.jetstream()
        async with self.engine.begin() as conn:
            for ddl in _DDL:
                await conn.execute(sa.text(ddl))
        for run in runs.STREAMS:
            await jetstream.ensure_stream(self.js, runs.app.stream_spec(run.stream), create=True)
        for run in (*runs.RUNS, runs.FLOOD_HAND):
            if not run.handler:  # as eop makes them: explicit acks, the default limits
                config = api.ConsumerConfig(
                    durable_name=run.durable,
                    ack_policy=api.AckPolicy.EXPLICIT,
                    max_ack_pending=runs.app.settings.max_ack_pending,
                )
                await self.js.add_consumer(run.stream, config)

    async def warm(self, run: runs.Run, child: Child, waiting: int) -> None:
        """Wait until the run's consumer has ``waiting`` pull requests waiting: its
        processes have started, connected and asked for messages."""
        import nats.js.errors

        deadline = time.monotonic() + 120
        while True:
            try:
                info = await self.stream.consumer_info(run.stream, run.durable)
                if int(info.num_waiting or 0) >= waiting:
                    return
            except nats.js.errors.NotFoundError:  # an eop worker creates it as it starts
                pass
            child.check()
            if time.monotonic() > deadline:
                raise errors.EopError(f"({run.key}) not ready after 120 s: {child.tail()}")
            await asyncio.sleep(0.1)

    async def pause(self, run: runs.Run, paused: bool) -> None:
        """Pause the run's consumer (the server delivers nothing) or resume it."""
        if self.nc is None:
            raise RuntimeError("Bench.start() first")
        body = {"pause_until": "2999-01-01T00:00:00Z"} if paused else {}
        subject = f"$JS.API.CONSUMER.PAUSE.{run.stream}.{run.durable}"
        reply = json.loads((await self.nc.request(subject, json.dumps(body).encode(), 5.0)).data)
        if "error" in reply:
            raise errors.EopError(f"({run.key}) pause {paused}: {reply['error']}")

    def cpu(self, child: Child | None = None) -> Cpu:
        """CPU seconds so far of ``child`` (and its children) and of the two servers."""
        stats = procstat.snapshot()
        nats_pid, pg_pid = self.server_pids
        return Cpu(
            child.cpu_s() if child is not None else None,
            procstat.tree_cpu_s(nats_pid, stats),
            procstat.tree_cpu_s(pg_pid, stats),
            pgparts.cpu_s(pg_pid, stats),
        )

    def command(self, run: runs.Run, extra: Sequence[str] = ()) -> list[str]:
        """The argv of a run's consumer process."""
        if not run.handler:
            child = [run.loop, self.nats_url]
            if run.loop == "a":
                child += [run.stream, run.durable, str(self.tmp / f"{run.key}.records")]
            else:
                child += [self.database_url, run.stream, run.durable]
            if run.loop == "hf":  # eop's attempts and backoff, the flood's cap
                settings = runs.app.settings
                child += [str(settings.max_attempts), str(settings.backoff_base_s)]
                child.append(str(runs.FLOOD_BACKOFF_MAX_S))
            fan = ["fan", str(run.processes)] if run.processes > 1 else []
            return [sys.executable, "-m", "eop.tools.bench", *fan, *child]
        urls = ["--database-url", self.database_url, "--nats-url", self.nats_url]
        worker = ["worker", "eop.tools.bench:app", "--handler", run.handler, *urls, *extra]
        return [sys.executable, "-m", "eop", *worker]

    async def publish(self, run: runs.Run, count: int, payload: bytes | None = None) -> None:
        """Publish a backlog of ``count`` messages (of ``payload``, else the bench's),
        confirmed, 1,000 at a time.

        ``publish_async``: a request inbox per message (``publish``) made the
        long run's 1,010,000 take minutes on a loaded machine.
        """
        payload = self.payload if payload is None else payload
        for sent in range(0, count, 1000):
            chunk = min(1000, count - sent)
            acks = [await self.stream.publish_async(run.subject, payload) for _ in range(chunk)]
            await asyncio.gather(*acks)  # raises if any was refused or timed out
            self.progress.show(f"({run.key}) publishing", sent + chunk, count)
        self.progress.end()

    async def publish_paced(self, run: runs.Run, rate: float, seconds: float) -> tuple[int, float]:
        """Publish at ``rate`` messages/s for ``seconds``; (messages, the rate achieved).

        The collector is off meanwhile: this process holds eop's and
        SQLAlchemy's modules, and its full collections (35-100 ms here) made
        the pace a burst after each pause, which every consumer then met as a
        queue.
        """
        loop = asyncio.get_running_loop()
        total, sent, start = max(1, int(rate * seconds)), 0, loop.time()
        gc.collect()
        gc.disable()
        try:
            while sent < total:
                due = min(total, int((loop.time() - start) * rate) + 1)
                await asyncio.gather(
                    *(self.stream.publish(run.subject, self.payload) for _ in range(due - sent))
                )
                sent = due
                self.progress.show(f"({run.key}) latency at {rate:,.0f} msg/s", sent, total)
                await asyncio.sleep(0.005)
        finally:
            gc.enable()
        self.progress.end()
        return total, total / max(loop.time() - start, 1e-9)

    async def stream_messages(self, run: runs.Run) -> int:
        """The messages ``run``'s stream holds now."""
        info = await self.stream.stream_info(run.stream)
        return int(info.state.messages)

    def shown(self, argv: Sequence[str]) -> str:
        """A child's command line for the report, the servers' URLs left out."""
        shown = shlex.join([Path(argv[0]).name, *argv[1:]])
        return shown.replace(self.database_url, "DB").replace(self.nats_url, "NATS")

    async def acked(self, run: runs.Run) -> tuple[int, int]:
        """The consumer's ack floor and its deliveries awaiting an ack ((0, 0) if absent)."""
        import nats.js.errors

        try:
            info = await self.stream.consumer_info(run.stream, run.durable)
        except nats.js.errors.NotFoundError:  # an eop worker creates its consumer as it starts
            return 0, 0
        return int(info.ack_floor.stream_seq), int(info.num_ack_pending)

    async def drain(
        self, run: runs.Run, child: Child, target: int, label: str, cpu_since: Cpu | None = None
    ) -> Drained:
        """Wait until every sequence up to ``target`` is acked.

        Returns the rate seen since the first ack, and the CPU time per message
        of the child and of the servers: since ``cpu_since`` (read just before a
        paused consumer was resumed) over every message of the drain, else since
        the first ack was seen. A drain shorter than a few polls (the lean
        loops', a sixth of a second) left most of its work before the first
        poll that saw an ack, and its CPU a message read a fifth of the truth.
        """
        base, _ = await self.acked(run)
        first: tuple[float, int, Cpu] | None = None
        rate, last_move, last_floor = 0.0, time.monotonic(), base
        while True:
            floor, pending = await self.acked(run)
            now = time.monotonic()
            if first is None and floor > base:
                first = (now, floor, self.cpu(child))
            elif first is not None and now > first[0]:
                rate = (floor - first[1]) / (now - first[0])
            self.progress.show(label, floor - base, target - base, rate)
            if floor >= target and pending == 0:
                self.progress.end()
                if cpu_since is not None:
                    return Drained(rate, cpu_since.per_message_us(self.cpu(child), floor - base))
                if first is None:
                    return Drained(rate, Cpu(None, None, None))
                return Drained(rate, first[2].per_message_us(self.cpu(child), floor - first[1]))
            if floor != last_floor:
                last_move, last_floor = now, floor
            elif now - last_move > 60:
                raise errors.EopError(f"{label}: stuck at {floor:,} for 60 s ({child.tail()})")
            child.check()
            await asyncio.sleep(0.1)

    async def points(self, run: runs.Run, first: int, last: int) -> list[tuple[int, float, float]]:
        """(sequence, stored at, done at) of the run's messages ``first`` to ``last``."""
        if run.loop == "a":  # one file per process
            files = sorted(self.tmp.glob(f"{run.key}.records*"))
            rows: Any = (line.split() for f in files for line in f.read_text().splitlines())
        else:
            async with self.engine.connect() as conn:
                params = {"v": run.handler or run.durable, "lo": first, "hi": last}
                rows = (await conn.execute(_POINTS, params)).all()
        points = [(int(s), float(stored), float(done)) for s, stored, done in rows]
        return [p for p in points if first <= p[0] <= last]

    async def inbox_rows(self, run: runs.Run) -> int:
        """The inbox rows of an eop run, now (a count that reads the whole table)."""
        return (await self.inbox_rows_split(run, 0))[0]

    async def inbox_rows_split(self, run: runs.Run, above: int) -> tuple[int, int]:
        """(the inbox rows of an eop run, those above sequence ``above``), in one snapshot
        (a count that reads the whole table)."""
        schema = runs.app.settings.schema
        query = sa.text(
            "SELECT count(*), count(*) FILTER (WHERE stream_seq > :above)"
            f' FROM "{schema}".inbox WHERE subscription = :s'
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(query, {"s": run.handler, "above": above})).one()
        return int(row[0]), int(row[1])

    async def recent_inbox_rows(self, run: runs.Run, above: int) -> tuple[int, int]:
        """(the inbox rows of an eop run above sequence ``above``, its watermark now).

        A range of the primary key from ``above`` up, in the epoch of the
        watermark's row: cheap however many deleted rows' entries lie below.
        """
        schema = runs.app.settings.schema
        query = sa.text(
            f'SELECT w.watermark, (SELECT count(*) FROM "{schema}".inbox AS i'
            " WHERE i.lane = w.lane AND i.stream_seq > :above)"
            f' FROM "{schema}".watermarks AS w WHERE w.subscription = :s'
        )
        async with self.engine.connect() as conn:
            found = (await conn.execute(query, {"s": run.handler, "above": above})).all()
        if len(found) != 1:  # no watermark row yet, or several epochs: count them all
            return await self.inbox_rows(run), 0
        return int(found[0][1]), int(found[0][0])

    async def inbox_table(self) -> InboxTable:
        """The inbox table's size (its indexes and TOAST included), its dead rows and its
        autovacuums so far (PostgreSQL's statistics, flushed about once a second)."""
        query = sa.text(
            "SELECT pg_total_relation_size(relid), n_dead_tup, autovacuum_count"
            " FROM pg_stat_user_tables WHERE schemaname = :schema AND relname = 'inbox'"
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(query, {"schema": runs.app.settings.schema})).one()
        return InboxTable(int(row[0]), int(row[1]), int(row[2]))


class InboxTable(NamedTuple):
    """The inbox table as PostgreSQL sees it: bytes on disk, dead rows, autovacuums."""

    size_bytes: int
    dead_rows: int
    autovacuums: int
