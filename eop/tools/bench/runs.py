"""What ``eop bench`` measures: the runs, the app of their eop workers, the options."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import eop
from eop import errors, handler
from eop import settings as settings_mod
from eop.runtime import supervisor

INSERT = sa.text("INSERT INTO bench_effects (variant, seq, stored_at) VALUES (:v, :s, :t)")
"""The handler work of every database run (the naive loop's too)."""
POISON = b"p"
"""How a poison flood's failing messages begin (the others are all ``x``)."""
FLOOD_BACKOFF_MAX_S = 1.0
"""The poison flood's cap on the retry delay, for eop and the hand-written consumer alike:
short, so that the run measures the work of failing rather than the waits between."""
WINDOW = 10_000  # the --big run's windows: messages 10,001-20,000 and the last 10,000
PROCESSES = supervisor.process_count(0)
"""An ``eop worker``'s default process count here: the baselines' many-process rows use it."""

# Default settings, never the environment's: the bench passes the servers' URLs as
# `eop worker` flags, and a caller's EOP_* variables must not tune the default run.
app = eop.App(settings=settings_mod.Settings())


class _Base(DeclarativeBase):
    pass


class Effect(_Base):
    """A row of ``bench_effects`` as a user's ORM model (the table itself has no key)."""

    __tablename__ = "bench_effects"
    variant: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    seq: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    stored_at: Mapped[datetime.datetime] = mapped_column(sa.DateTime(timezone=True))


def _row(msg: eop.Message) -> dict[str, Any]:
    return {"v": msg.subscription, "s": msg.seq, "t": msg.timestamp}


def _effect(msg: eop.Message) -> Effect:
    return Effect(variant=msg.subscription, seq=msg.seq, stored_at=msg.timestamp)


async def record(msg: eop.Message, writes: eop.Writes) -> None:
    """The handler work of every database run: one INSERT per message, queued (eop.Writes)."""
    writes.add(INSERT, _row(msg))


async def record_direct(msg: eop.Message, session: AsyncSession) -> None:
    """The same INSERT, executed through the session at once: a round trip per message."""
    await session.execute(INSERT, _row(msg))


async def record_batch(msgs: list[eop.Message], session: AsyncSession) -> None:
    """The same INSERT per message, for a whole batch in one (pipelined) executemany."""
    await session.execute(INSERT, [_row(m) for m in msgs])


async def record_orm(msg: eop.Message, session: AsyncSession) -> None:
    """The same row through the ORM, as the README's quickstart writes: ``session.add``."""
    session.add(_effect(msg))


def record_sync(msg: eop.Message, session: Session) -> None:
    """The same row through the ORM in a sync handler (eop runs it in a thread)."""
    session.add(_effect(msg))


async def record_or_fail(msg: eop.Message, writes: eop.Writes) -> None:
    """The poison flood's handler: a poison message raises, every other one is recorded
    as :func:`record` does."""
    if msg.data.startswith(POISON):
        raise RuntimeError("poison message")
    writes.add(INSERT, _row(msg))


@dataclasses.dataclass(frozen=True)
class Run:
    """One measured consumer: its stream, its durable consumer, its eop handler if any."""

    key: str
    label: str
    stream: str
    durable: str
    handler: str = ""
    args: str = ""
    """Flags of its ``eop worker`` beyond the servers' URLs (the tuned run adds --tuned's)."""
    loop: str = ""
    """For a baseline (no handler): ``a``, ``h``, ``hb`` or ``b`` of
    :mod:`eop.tools.bench.baselines`, ``m`` of :mod:`eop.tools.bench.floor`."""
    processes: int = 1
    """A baseline's processes; an eop run's come from its flags (``processes``)."""

    @property
    def subject(self) -> str:
        """The one subject of the run's stream."""
        return self.stream.lower().replace("_", ".")

    @property
    def pulls_waiting(self) -> int:
        """Pull requests each of the run's processes keeps waiting at the server once
        started: (a) and (m) two, (h) and (hb) one per batch in flight (two), an eop worker
        one."""
        return 2 if self.loop in ("a", "h", "hb", "m") else 1


_N = PROCESSES
_ONE = "--processes 1"
RUNS = (
    Run("a", "lean raw at-least-once", "BENCH_A", "bench-raw", loop="a"),
    Run("an", f"lean raw, {_N} processes", "BENCH_AN", "bench-raw-n", loop="a", processes=_N),
    Run("b", "naive exactly-once", "BENCH_B", "bench-naive", loop="b"),
    Run("h", "hand-written exactly-once", "BENCH_H", "bench-hand", loop="h"),
    Run("hn", f"hand-written, {_N} processes", "BENCH_HN", "bench-hand-n", loop="h", processes=_N),
    Run(
        "hb",
        f"hand-written bounded, {_N} procs",
        "BENCH_HB",
        "bench-hand-b",
        loop="hb",
        processes=_N,
    ),
    Run("m", "leanest exactly-once (floor)", "BENCH_M", "bench-floor", loop="m"),
    Run(
        "mn",
        f"leanest exactly-once, {_N} procs",
        "BENCH_MN",
        "bench-floor-n",
        loop="m",
        processes=_N,
    ),
    Run("c", "eop default, eop.Writes", "BENCH_C", "eop-bench-default", "bench-default"),
    Run("c1", "eop.Writes, one process", "BENCH_C1", "eop-bench-one", "bench-one", _ONE),
    Run("o", "eop default, async ORM", "BENCH_O", "eop-bench-orm", "bench-orm"),
    Run("o1", "async ORM, one process", "BENCH_O1", "eop-bench-orm-one", "bench-orm-one", _ONE),
    Run("s", "eop default, sync ORM", "BENCH_S", "eop-bench-sync", "bench-sync"),
    Run("s1", "sync ORM, one process", "BENCH_S1", "eop-bench-sync-one", "bench-sync-one", _ONE),
    Run("k", "eop default, batch handler", "BENCH_K", "eop-bench-batch", "bench-batch"),
    Run("k1", "batch handler, one process", "BENCH_K1", "eop-bench-batch-1", "bench-batch-1", _ONE),
    Run("d", "eop tuned (batch handler)", "BENCH_D", "eop-bench-tuned", "bench-tuned"),
    Run("e", "eop default, session.execute", "BENCH_E", "eop-bench-direct", "bench-direct"),
)
"""Every run but the relay's and the poison flood's, in the order measured."""
FLOOD = Run(
    "f",
    "eop worker, poison flood",
    "BENCH_F",
    "eop-bench-flood",
    "bench-flood",
    f"--backoff-max-s {FLOOD_BACKOFF_MAX_S:g}",
)
FLOOD_HAND = Run(
    "fh", f"hand-written, {_N} processes", "BENCH_FH", "bench-hand-flood", loop="hf", processes=_N
)
"""The poison flood's rows (``--runs f``): eop, and the hand-written consumer extended to
handle failures (:func:`eop.tools.bench.baselines.handwritten_flood`), in as many processes."""
SELECTABLE = (*(run.key for run in RUNS), "r", "f")
"""What ``--runs`` chooses from: the runs above, r (the relay's rows) and f (the flood's)."""
_HANDLERS: dict[str, handler.HandlerFunc] = {
    "c": record,
    "c1": record,
    "o": record_orm,
    "o1": record_orm,
    "s": record_sync,
    "s1": record_sync,
    "k": record_batch,
    "k1": record_batch,
    "d": record_batch,
    "e": record_direct,
}
BIG = Run("big", "eop default, long run", "BENCH_BIG", "eop-bench-big", "bench-big")
RELAY = Run("r", "eop relay", "BENCH_R", "eop-bench-relayed", "bench-relayed")
"""The relay's stream, and the eop worker (rw) that consumes what the relay published."""
RAW_PUBLISH = Run("rp", "raw publisher", "BENCH_RP", "")
RELAY_LATENCY = (
    Run("rl", "relay, LISTEN/NOTIFY", "BENCH_RL", "bench-latency-listen"),
    Run("rn", "relay without LISTEN (polls)", "BENCH_RN", "bench-latency-poll"),
)
"""The streams of the commit-to-PubAck runs (their durables only read the stream back)."""
STREAMS = (*RUNS, BIG, RELAY, RAW_PUBLISH, *RELAY_LATENCY, FLOOD, FLOOD_HAND)
"""Every run with a stream of its own."""
for _run in STREAMS:
    app.stream(_run.stream, subjects=[_run.subject])
_BY_KEY = {run.key: run for run in RUNS}
for _run, _func in (
    *((_BY_KEY[key], func) for key, func in _HANDLERS.items()),
    (BIG, record),
    (RELAY, record),
    (FLOOD, record_or_fail),
):
    app.handler(
        stream=_run.stream, subject=_run.subject, name=_run.handler, batch=_func is record_batch
    )(_func)


def flood_counts(messages: int) -> tuple[int, int]:
    """The poison flood's (failing, good) messages out of a ``--flood-messages`` backlog:
    half each, the failing ones published first."""
    return messages // 2, messages - messages // 2


def chosen(runs: str) -> list[str]:
    """The keys of a ``--runs`` value: comma-separated keys, ``all``, or ``none`` (with
    ``--big``: the long run alone)."""
    keys = [key.strip() for key in runs.split(",") if key.strip()]
    if keys == ["none"]:
        return []
    return list(SELECTABLE) if keys == ["all"] else keys


@dataclasses.dataclass(frozen=True)
class Options:
    """The choices of one ``eop bench``."""

    messages: int = 20_000
    naive_messages: int = 3_000
    flood_messages: int = 4_000
    """The poison flood's backlog (half failing): each failing message runs max_attempts
    times, so it stays below the other runs' backlog."""
    payload_bytes: int = 100
    warm_messages: int = 5_000
    """Messages each timed run drains before its measured backlog, unmeasured
    (:func:`eop.tools.bench.measurement.measure`)."""
    latency_s: float = 3.0
    latency_load: float = 0.5
    tuned: str = "--batch 128 --concurrency 256 --log-level warning"
    big: bool = False
    big_messages: int = 1_010_000
    fsync: bool = True
    runs: str = "all"
    """The runs to measure: their keys, comma-separated (r: the relay's rows, f: the poison
    flood's), ``all``, or ``none`` (with ``big``: the long run alone)."""
    relay_messages: int = 20_000
    relay_payload_bytes: int = 256
    relay_rate: float = 200.0
    """Rows/s the commit-to-PubAck runs commit, one per transaction."""
    relay_latency_s: float = 10.0
    pg_cpus: float = 0.0
    """Hold the bench's PostgreSQL to this many cores (a cgroup quota, e.g. 0.5; 0: no
    limit) and report the rate at which each run saturates it (:mod:`eop.tools.bench.cpulimit`)."""
    pg_profile: bool = False
    """Instead of the timed runs, count PostgreSQL's work per message of the chosen ones
    (:mod:`eop.tools.bench.pgprofile`)."""

    def __post_init__(self) -> None:
        counts = (self.messages, self.naive_messages, self.payload_bytes)
        if min(*counts, self.relay_messages, self.relay_payload_bytes) < 1:
            raise errors.ConfigurationError("message counts and payload-bytes must be at least 1")
        if self.warm_messages < 0:
            raise errors.ConfigurationError("warm-messages must be 0 (no warm-up) or more")
        if self.pg_cpus < 0:
            raise errors.ConfigurationError(
                f"pg-cpus must be 0 (no limit) or more, not {self.pg_cpus:g}"
            )
        keys = chosen(self.runs)
        if (not keys and not (self.big and self.runs.strip() == "none")) or set(keys) - set(
            SELECTABLE
        ):
            raise errors.ConfigurationError(
                f"runs must be 'all' or keys of {','.join(SELECTABLE)} separated by commas "
                f"(r: the relay's rows, f: the poison flood's), or 'none' with big, "
                f"not {self.runs!r}"
            )
        if "f" in keys and self.flood_messages < 2:
            raise errors.ConfigurationError("flood-messages must be at least 2")
        if not (self.relay_rate > 0 and self.relay_latency_s > 0):
            raise errors.ConfigurationError("relay-rate and relay-latency-s must be above 0")
        if not (0 < self.latency_load <= 1 and self.latency_s > 0):
            raise errors.ConfigurationError("latency-load must be in (0, 1], latency-s above 0")
        if self.big and self.big_messages < 3 * WINDOW:
            raise errors.ConfigurationError(f"big-messages must be at least {3 * WINDOW:,}")
