"""What ``eop bench`` measures: the runs, the app of their eop workers, the options."""

from __future__ import annotations

import dataclasses
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

import eop
from eop import errors
from eop import settings as settings_mod

INSERT = sa.text("INSERT INTO bench_effects (variant, seq, stored_at) VALUES (:v, :s, :t)")
"""The handler work of every database run (the naive loop's too)."""
SELECTABLE = "abcdefr"
"""What ``--runs`` chooses from: the runs (a) to (f), and r, the relay's rows."""
WINDOW = 10_000  # the --big run's windows: messages 10,001-20,000 and the last 10,000

# Default settings, never the environment's: the bench passes the servers' URLs as
# `eop worker` flags, and a caller's EOP_* variables must not tune the default run.
app = eop.App(settings=settings_mod.Settings())


def _row(msg: eop.Message) -> dict[str, Any]:
    return {"v": msg.subscription, "s": msg.seq, "t": msg.timestamp}


async def record(msg: eop.Message, writes: eop.Writes) -> None:
    """The handler work of every database run: one INSERT per message, queued (eop.Writes)."""
    writes.add(INSERT, _row(msg))


async def record_direct(msg: eop.Message, session: AsyncSession) -> None:
    """The same INSERT, executed through the session at once: a round trip per message."""
    await session.execute(INSERT, _row(msg))


async def record_batch(msgs: list[eop.Message], session: AsyncSession) -> None:
    """The same INSERT per message, for a whole batch in one (pipelined) executemany."""
    await session.execute(INSERT, [_row(m) for m in msgs])


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

    @property
    def subject(self) -> str:
        """The one subject of the run's stream."""
        return self.stream.lower().replace("_", ".")


RUNS = (
    Run("a", "raw at-least-once (fetch + ack)", "BENCH_A", "bench-raw"),
    Run("b", "naive exactly-once", "BENCH_B", "bench-naive"),
    Run("c", "eop default", "BENCH_C", "eop-bench-default", "bench-default"),
    Run("d", "eop tuned (batch handler)", "BENCH_D", "eop-bench-tuned", "bench-tuned"),
    Run("e", "eop default, session.execute", "BENCH_E", "eop-bench-direct", "bench-direct"),
    Run(
        "f",
        "eop default, one process",
        "BENCH_F",
        "eop-bench-one",
        "bench-one",
        args="--processes 1",
    ),
)
BIG = Run("big", "eop default, long run", "BENCH_BIG", "eop-bench-big", "bench-big")
RELAY = Run("r", "eop relay", "BENCH_R", "eop-bench-relayed", "bench-relayed")
"""The relay's stream, and the eop worker (rw) that consumes what the relay published."""
RAW_PUBLISH = Run("rp", "raw publisher", "BENCH_RP", "")
RELAY_LATENCY = (
    Run("rl", "relay, LISTEN/NOTIFY", "BENCH_RL", "bench-latency-listen"),
    Run("rn", "relay without LISTEN (polls)", "BENCH_RN", "bench-latency-poll"),
)
"""The streams of the commit-to-PubAck runs (their durables only read the stream back)."""
for _run in (*RUNS, BIG, RELAY, RAW_PUBLISH, *RELAY_LATENCY):
    app.stream(_run.stream, subjects=[_run.subject])
for _run, _func in (
    (RUNS[2], record),
    (RUNS[3], record_batch),
    (RUNS[4], record_direct),
    (RUNS[5], record),
    (BIG, record),
    (RELAY, record),
):
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
    runs: str = "abcdefr"
    """The runs to measure: letters of (a) to (f), and r for the relay's rows."""
    relay_messages: int = 20_000
    relay_payload_bytes: int = 256
    relay_rate: float = 200.0
    """Rows/s the commit-to-PubAck runs commit, one per transaction."""
    relay_latency_s: float = 10.0

    def __post_init__(self) -> None:
        counts = (self.messages, self.naive_messages, self.payload_bytes)
        if min(*counts, self.relay_messages, self.relay_payload_bytes) < 1:
            raise errors.ConfigurationError("message counts and payload-bytes must be at least 1")
        if set(self.runs) - set(SELECTABLE) or not self.runs.strip():
            raise errors.ConfigurationError(
                f"runs must be letters of {SELECTABLE!r} (r: the relay's rows), not {self.runs!r}"
            )
        if not (self.relay_rate > 0 and self.relay_latency_s > 0):
            raise errors.ConfigurationError("relay-rate and relay-latency-s must be above 0")
        if not (0 < self.latency_load <= 1 and self.latency_s > 0):
            raise errors.ConfigurationError("latency-load must be in (0, 1], latency-s above 0")
        if self.big and self.big_messages < 3 * WINDOW:
            raise errors.ConfigurationError(f"big-messages must be at least {3 * WINDOW:,}")
