"""Every run of ``eop bench``, one after another, on servers of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

from eop.bench import harness, measurement, relay, report, runs


def run(options: runs.Options) -> dict[str, Any]:
    """Start the servers, run every measurement, return the report."""
    from eop import embedded
    from eop.pg import migrate

    started, machine = time.monotonic(), report.machine()
    with (
        tempfile.TemporaryDirectory(prefix="eop-bench-") as tmp,
        embedded.NatsServer() as nats_server,
        # Commit times of the effect rows give publish-to-commit latency.
        embedded.PostgresServer(
            fsync=options.fsync, settings={"track_commit_timestamp": "on"}
        ) as pg,
    ):
        migrate.upgrade(pg.url)
        pids = (nats_server.pid, pg.pid)
        results, section, big = asyncio.run(
            _run_all(options, nats_server.url, pg.url, Path(tmp), pids)
        )
    rate = {r.key: r.rate for r in results}
    rate.update({r.key: r.rate for r in section.rows} if section else {})
    machine["load_average_end"] = round(os.getloadavg()[0], 2)
    return {
        "options": dataclasses.asdict(options),
        "machine": machine,
        "runs": [dataclasses.asdict(r) for r in results],
        "ratios": {
            name: rate[x] / rate[y] if rate[y] else 0.0
            for name, x, y in _RATIOS
            if x in rate and y in rate
        },
        "relay": dataclasses.asdict(section) if section else None,
        "big": dataclasses.asdict(big) if big else None,
        "seconds": round(time.monotonic() - started, 1),
    }


_RATIOS = (
    ("c/a", "c", "a"),
    ("c/b", "c", "b"),
    ("d/a", "d", "a"),
    ("e/a", "e", "a"),
    ("e/b", "e", "b"),
    ("f/a", "f", "a"),
    ("f/b", "f", "b"),
    ("r/rw", "r", "rw"),
    ("r/rp", "r", "rp"),
)


async def _run_all(
    options: runs.Options,
    nats_url: str,
    database_url: str,
    tmp: Path,
    server_pids: tuple[int | None, int | None],
) -> tuple[list[measurement.Result], relay.Section | None, measurement.BigResult | None]:
    import nats

    bench = harness.Bench(options, nats_url, database_url, tmp, server_pids)
    nc = await nats.connect(nats_url)
    try:
        await bench.start(nc)
        results = []
        for run_ in runs.RUNS:
            if run_.key not in options.runs:
                continue
            count = options.naive_messages if run_.key == "b" else options.messages
            extra = shlex.split(run_.args)
            if run_.key == "d":
                extra += shlex.split(options.tuned)
            results.append(await measurement.measure(bench, run_, count, extra))
        section = await relay.measure(bench) if "r" in options.runs else None
        big = await measurement.measure_big(bench, options.big_messages) if options.big else None
        return results, section, big
    finally:
        await nc.close()
        await bench.engine.dispose()
