"""Every run of ``eop bench``, one after another, on servers of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shlex
import time
from pathlib import Path
from typing import Any

from eop.tools.bench import flood, harness, measurement, relay, report, runs


def run(options: runs.Options) -> dict[str, Any]:
    """Start the servers, run every measurement, return the report."""
    started, machine = time.monotonic(), report.machine()
    with harness.servers(fsync=options.fsync, prefix="eop-bench-", pg_cpus=options.pg_cpus) as srv:
        results, section, flooded, big = asyncio.run(
            _run_all(options, srv.nats_url, srv.pg_url, srv.tmp, srv.pids)
        )
    rates = {r.key: r.rate for r in section.rows} if section else {}
    machine["load_average_end"] = round(os.getloadavg()[0], 2)
    return {
        "options": dataclasses.asdict(options),
        "machine": machine,
        "runs": [dataclasses.asdict(r) for r in results],
        "ratios": {**ratios(results), **_relay_ratios(rates), **flood.ratios(flooded or [])},
        "ceiling": ceiling(results, options.pg_cpus) if options.pg_cpus else None,
        "relay": dataclasses.asdict(section) if section else None,
        "flood": [dataclasses.asdict(row) for row in flooded] if flooded else None,
        "big": dataclasses.asdict(big) if big else None,
        "seconds": round(time.monotonic() - started, 1),
    }


BASELINES = ("a", "an", "b", "h", "hn", "hb", "m", "mn")
"""The runs that are not eop's."""
FLOORS = ("m", "mn")
"""The leanest exactly-once loop's runs, one process and eop's default count."""
STYLES = (("o", "c"), ("s", "c"), ("k", "c"), ("o1", "c1"), ("s1", "c1"), ("k1", "c1"))
"""Handler styles beside eop.Writes, at the same process count."""


def ratios(results: list[measurement.Result]) -> dict[str, float]:
    """Each eop run beside the baselines of its own process count, and the styles beside
    eop.Writes.

    ``X/lean`` and ``X/hand``: X's rate over the lean raw loop's and the
    hand-written consumer's with as many processes as X had; ``X cpu/lean``:
    X's CPU per message over the lean loop's; ``X pg/hand`` and ``X p99/hand``:
    its PostgreSQL CPU per message and its p99 latency over that hand-written
    consumer's; ``X pg/bounded``: the same over the hand-written consumer that
    keeps its inbox bounded (hb), as eop does; ``X/floor``, ``X cpu/floor`` and ``X
    pg/floor``: the same over the leanest exactly-once loop (m, mn), and ``floor ...``
    that loop's own ratios to the lean loop and the hand-written consumer, which bound
    what any exactly-once design on these clients can reach. Also ``c/h`` (eop's default
    process count against one hand-written process, as users compare; shown, no
    target rests on it) and ``c/b`` (the naive loop).
    """
    by_key = {r.key: r for r in results}
    out: dict[str, float] = {}

    def put(name: str, x: float | None, y: float | None) -> None:
        if x is not None and y:
            out[name] = x / y

    for r in results:
        if r.key in BASELINES:
            continue
        if lean := _beside(results, ("a", "an"), r.processes):
            put(f"{r.key}/lean", r.rate, lean.rate)
            put(f"{r.key} cpu/lean", r.cpu_us, lean.cpu_us)
        if hand := _beside(results, ("h", "hn"), r.processes):
            put(f"{r.key}/hand", r.rate, hand.rate)
            put(f"{r.key} pg/hand", r.pg_us, hand.pg_us)
            put(f"{r.key} p99/hand", r.p99_ms, hand.p99_ms)
        if bounded := _beside(results, ("hb",), r.processes):
            put(f"{r.key} pg/bounded", r.pg_us, bounded.pg_us)
        if least := _beside(results, FLOORS, r.processes):
            put(f"{r.key}/floor", r.rate, least.rate)
            put(f"{r.key} cpu/floor", r.cpu_us, least.cpu_us)
            put(f"{r.key} pg/floor", r.pg_us, least.pg_us)
    pairs = [*STYLES, ("c", "h"), ("c", "b")]
    for x, y in pairs:
        if x in by_key and y in by_key:
            put(f"{x}/{y}", by_key[x].rate, by_key[y].rate)
    return {**out, **_floor_ratios(results)}


def _floor_ratios(results: list[measurement.Result]) -> dict[str, float]:
    """The leanest exactly-once loop's own ratios to the lean loop and the hand-written
    consumer, in eop's process count: what the targets against those two allow any
    exactly-once design on these clients."""
    least = _beside(results, FLOORS, runs.PROCESSES)
    lean = _beside(results, ("a", "an"), runs.PROCESSES)
    hand = _beside(results, ("h", "hn"), runs.PROCESSES)
    pairs = {}
    if least and lean:
        pairs["floor cpu/lean"] = (least.cpu_us, lean.cpu_us)
    if least and hand:
        pairs["floor/hand"] = (least.rate, hand.rate)
        pairs["floor p99/hand"] = (least.p99_ms, hand.p99_ms)
        pairs["floor pg/hand"] = (least.pg_us, hand.pg_us)
    return {name: x / y for name, (x, y) in pairs.items() if x is not None and y}


def _beside(
    results: list[measurement.Result], keys: tuple[str, ...], processes: int
) -> measurement.Result | None:
    """The baseline among ``keys`` measured with ``processes`` processes, if it ran."""
    return next((b for b in results if b.key in keys and b.processes == processes), None)


SATURATED = 0.85
"""PostgreSQL busy for this share of its quota or more: the run saturated it."""


def ceiling(results: list[measurement.Result], pg_cpus: float) -> dict[str, dict[str, Any]]:
    """Per run, with PostgreSQL held to ``pg_cpus`` cores: how many of them it kept busy,
    whether that saturated it, and so the messages a second one PostgreSQL core serves
    for that consumer (the rate over ``pg_cpus``; a lower bound when not saturated)."""
    out = {}
    for r in results:
        if r.pg_us is None:
            continue
        busy = r.rate * r.pg_us / 1e6
        out[r.key] = {
            "rate": r.rate,
            "pg_cores_busy": round(busy, 3),
            "saturated": busy >= SATURATED * pg_cpus,
            "per_pg_core": r.rate / pg_cpus,
        }
    return out


def _relay_ratios(rate: dict[str, float]) -> dict[str, float]:
    return {
        name: rate[x] / rate[y]
        for name, x, y in (("r/rw", "r", "rw"), ("r/rp", "r", "rp"))
        if x in rate and y in rate and rate[y]
    }


async def _run_all(
    options: runs.Options,
    nats_url: str,
    database_url: str,
    tmp: Path,
    server_pids: tuple[int | None, int | None],
) -> tuple[
    list[measurement.Result],
    relay.Section | None,
    list[flood.Flood] | None,
    measurement.BigResult | None,
]:
    import nats

    bench = harness.Bench(options, nats_url, database_url, tmp, server_pids)
    nc = await nats.connect(nats_url)
    try:
        await bench.start(nc)
        results = []
        chosen = runs.chosen(options.runs)
        for run_ in runs.RUNS:
            if run_.key not in chosen:
                continue
            count = options.naive_messages if run_.key == "b" else options.messages
            extra = shlex.split(run_.args)
            if run_.key == "d":
                extra += shlex.split(options.tuned)
            results.append(await measurement.measure(bench, run_, count, extra))
        section = await relay.measure(bench) if "r" in chosen else None
        flooded = await flood.measure(bench) if "f" in chosen else None
        big = await measurement.measure_big(bench, options.big_messages) if options.big else None
        return results, section, flooded, big
    finally:
        await nc.close()
        await bench.engine.dispose()
