"""The poison flood's rows of ``eop bench`` (``--runs f``): what failing messages cost.

A backlog of P messages whose handler raises, then G good ones (the usual
one-INSERT handler work), half of ``--messages`` each, is drained by (f) an
``eop worker`` at default settings but for ``--backoff-max-s 1``, and by (fh)
the hand-written consumer extended to handle failures
(:func:`eop.tools.bench.baselines.handwritten_flood`), in as many processes, with
the same attempts (``max_attempts``, 5) and the same backoff (0.5 s doubling,
at most 1 s). Start-up is excluded as in the other runs (the consumer is
paused until each process has a pull request waiting). From resuming the
consumer: the time until the last good message's effect committed ("to
good"), and until the last failing one's dead letter committed ("to drain");
the CPU of the consumer's processes and of each server meanwhile, per handler
run (P x max_attempts failing runs, plus G).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import sqlalchemy as sa

from eop import errors
from eop.tools.bench import harness, runs

_SCHEMA = runs.app.settings.schema
_TABLES = {
    # Each run's dead letters: the table, its key of the run, its column of the sequence.
    True: (f'"{_SCHEMA}".dead_letters', "subscription", "stream_seq"),
    False: ("bench_hand_dead", "stream", "seq"),
}
_DEAD = {
    eop: sa.text(
        f"SELECT count(*), count(*) FILTER (WHERE {seq} > :p),"
        " max(extract(epoch FROM pg_xact_commit_timestamp(xmin))::float8)"
        f" FROM {table} WHERE {key} = :v"
    )
    for eop, (table, key, seq) in _TABLES.items()
}
_DEAD_COUNT = {
    eop: sa.text(f"SELECT count(*) FROM {table} WHERE {key} = :v")
    for eop, (table, key, _) in _TABLES.items()
}


@dataclasses.dataclass
class Flood:
    """One consumer through the poison flood (times in s from resuming the consumer, CPU in
    µs per handler run)."""

    key: str
    label: str
    command: str
    processes: int
    poison: int
    good: int
    max_attempts: int
    backoff_max_s: float
    handler_runs: int
    """``poison * max_attempts + good``: what the CPU is divided by."""
    good_s: float
    """Until the last good message's effect committed."""
    drain_s: float
    """Until the last failing message's dead letter committed."""
    cpu_us: float | None
    nats_us: float | None
    pg_us: float | None
    effects: int
    """Effect rows of the good messages: ``good`` if each took effect once."""
    dead: int
    """Dead letters: ``poison`` if each failing message got one."""
    dead_good: int
    """Dead letters of good messages: 0, or a good message was lost."""


async def measure(bench: harness.Bench) -> list[Flood]:
    """(f), then (fh)."""
    return [await _one(bench, runs.FLOOD), await _one(bench, runs.FLOOD_HAND)]


def handler_runs(poison: int, good: int, max_attempts: int) -> int:
    """Handler runs of a drained flood: every failing message runs ``max_attempts`` times
    before its dead letter, every good one once."""
    return poison * max_attempts + good


def ratios(rows: list[Flood]) -> dict[str, float]:
    """(f) over (fh): ``f good/hand`` and ``f drain/hand`` (time to good, to drain) and
    ``f cpu/hand`` (the consumer's CPU per handler run)."""
    by_key = {row.key: row for row in rows}
    eop, hand = by_key.get(runs.FLOOD.key), by_key.get(runs.FLOOD_HAND.key)
    if eop is None or hand is None:
        return {}
    pairs = {
        "f good/hand": (eop.good_s, hand.good_s),
        "f drain/hand": (eop.drain_s, hand.drain_s),
        "f cpu/hand": (eop.cpu_us, hand.cpu_us),
    }
    return {name: x / y for name, (x, y) in pairs.items() if x is not None and y}


async def _one(bench: harness.Bench, run: runs.Run) -> Flood:
    poison, good = runs.flood_counts(bench.options.flood_messages)
    settings = runs.app.settings
    runs_ = handler_runs(poison, good, settings.max_attempts)
    argv = bench.command(run, run.args.split())
    processes = run.processes if not run.handler else runs.PROCESSES
    child = harness.Child(argv, bench.tmp / f"{run.key}.log")
    try:
        # (fh) keeps a pull request waiting per batch in flight, eop one per process.
        await bench.warm(run, child, processes * (1 if run.handler else 2))
        await bench.pause(run, True)
        size = bench.options.payload_bytes
        await bench.publish(run, poison, runs.POISON + b"x" * (size - 1))
        await bench.publish(run, good)
        before, resumed = bench.cpu(child), time.time()
        await bench.pause(run, False)
        await _settled(bench, run, child, poison, good)
        cpu = before.per_message_us(bench.cpu(child), runs_)
    finally:
        await child.stop()
    points = await bench.points(run, poison + 1, poison + good)
    dead, dead_good, dead_at = await _dead(bench, run, poison)
    return Flood(
        key=run.key,
        label=run.label,
        command=bench.shown(argv),
        processes=processes,
        poison=poison,
        good=good,
        max_attempts=settings.max_attempts,
        backoff_max_s=runs.FLOOD_BACKOFF_MAX_S,
        handler_runs=runs_,
        good_s=max((done for _, _, done in points), default=resumed) - resumed,
        drain_s=(dead_at or resumed) - resumed,
        cpu_us=cpu.child,
        nats_us=cpu.nats,
        pg_us=cpu.pg,
        effects=len(points),
        dead=dead,
        dead_good=dead_good,
    )


async def _dead(bench: harness.Bench, run: runs.Run, poison: int) -> tuple[int, int, float | None]:
    """The run's dead letters, those of good messages, and when the last one committed."""
    params = {"v": run.handler or run.stream, "p": poison}
    async with bench.engine.connect() as conn:
        count, good, last = (await conn.execute(_DEAD[bool(run.handler)], params)).one()
    return int(count), int(good), None if last is None else float(last)


async def _dead_count(bench: harness.Bench, run: runs.Run) -> int:
    """The run's dead letters: cheap enough to count every 0.1 s (an index's range)."""
    async with bench.engine.connect() as conn:
        query = _DEAD_COUNT[bool(run.handler)]
        return int((await conn.execute(query, {"v": run.handler or run.stream})).scalar_one())


async def _settled(
    bench: harness.Bench, run: runs.Run, child: harness.Child, poison: int, good: int
) -> None:
    """Wait until every message is acked (eop acks a parked retry too) and every failing
    one dead-lettered."""
    total, label = poison + good, f"({run.key}) {run.label}"
    last_move, last_seen = time.monotonic(), (-1, -1)
    while True:
        floor, pending = await bench.acked(run)
        dead = await _dead_count(bench, run)
        now = time.monotonic()
        bench.progress.show(label, dead + max(0, min(floor, total) - poison), total)
        if floor >= total and pending == 0 and dead >= poison:
            bench.progress.end()
            return
        if (floor, dead) != last_seen:
            last_move, last_seen = now, (floor, dead)
        elif now - last_move > 60:
            raise errors.EopError(f"{label}: stuck at {floor:,} acked, {dead:,} dead for 60 s")
        child.check()
        await asyncio.sleep(0.1)
