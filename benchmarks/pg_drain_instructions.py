"""PostgreSQL's instructions a message in a real drain, counted by callgrind.

    python benchmarks/pg_drain_instructions.py [--runs hn,c] [--short 3000] [--long 13000]

``benchmarks/pg_instructions.py --wire`` counts the shape of a batch, sent on
one connection; ``eop bench`` times the real drains, on a clock this machine's
host moves by a fifth from one run to the next. This counts the real drains:
each chosen run of ``eop bench`` (its consumer, its warm-up backlog, its
drain, as ``eop.tools.bench.measurement.measure`` runs them) against a
PostgreSQL whose postmaster runs under ``valgrind --tool=callgrind``, every
process it starts followed, once with a backlog of ``--short`` messages and
once of ``--long``. The difference of the two totals, over the difference of
the backlogs, is a message's instructions in every PostgreSQL process
(backends, WAL writer, checkpointer...), start-up, warm-up and the drains'
ends left out. The bench's own reading of the effect rows after a run is left
out too (it reads each row back). Under callgrind PostgreSQL runs some fifty
times slower, so the consumers wait on it more; what it is asked per message
does not change, but how the messages fall into batches can, and the figure
moves by a few percent from one count to the next: compare the runs of one
count. Each count of a run takes a minute or two.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pg_instructions  # this folder's: the callgrind postmaster of both counts

from eop.pg import migrate
from eop.tools import embedded
from eop.tools.bench import harness, runner, runs


class _Counted:
    """The PostgreSQL under callgrind of one count, and its total once it has stopped."""

    def __init__(self) -> None:
        self.total = 0

    @contextlib.contextmanager
    def servers(
        self,
        *,
        fsync: bool,
        prefix: str,
        pg_settings: Mapping[str, str] | None = None,
        pg_cpus: float = 0.0,
    ) -> Iterator[harness.Servers]:
        """:func:`harness.servers` with its PostgreSQL under callgrind (``pg_cpus`` unused)."""
        tmp = Path(tempfile.mkdtemp(prefix=prefix))
        os.chmod(tmp, 0o777)  # the server's account writes its callgrind files there
        data = tmp / "data"
        template = embedded.PostgresServer(data_dir=data)
        template.start()
        try:
            migrate.upgrade(template.url)
        finally:
            template.close()
        port = embedded.free_port()
        settings = {"listen_addresses": "127.0.0.1", "fsync": "on" if fsync else "off"}
        settings |= {"track_commit_timestamp": "on", **(pg_settings or {})}
        log = tmp / "postgres.log"
        with pg_instructions.callgrind_postmaster(
            data, f"{tmp}/cg.%p", port, tmp, settings, log
        ) as server:
            asyncio.run(_until_up(port, server))
            postmaster = int((data / "postmaster.pid").read_text().split()[0])
            with embedded.NatsServer() as nats_server:
                url = f"postgresql+asyncpg://postgres@127.0.0.1:{port}/postgres"
                yield harness.Servers(tmp, nats_server.url, url, (nats_server.pid, postmaster))
        self.total = _totals(tmp)


async def _until_up(port: int, server: subprocess.Popen[bytes]) -> None:
    conn = await pg_instructions.connect_when_up(server, "127.0.0.1", port)
    await conn.close()


def _totals(folder: Path) -> int:
    """The instructions of every process's profile in ``folder``."""
    total = 0
    for path in folder.glob("cg.*"):
        count = pg_instructions.profile_total(path)
        if count is None:
            raise SystemExit(f"no count in {path}")
        total += count
    return total


async def _no_points(*_: Any) -> list[tuple[int, float, float]]:
    """In place of the bench's reading of the effect rows: not what a consumer costs."""
    return []


def count(key: str, messages: int) -> int:
    """PostgreSQL's instructions over run ``key`` with a backlog of ``messages``."""
    counted = _Counted()
    options = runs.Options(runs=key, messages=messages, latency_s=0.1)
    with (
        _patched(harness, "servers", counted.servers),
        _patched(harness.Bench, "points", _no_points),
    ):
        runner.run(options)
    return counted.total


@contextlib.contextmanager
def _patched(owner: object, name: str, value: object) -> Iterator[None]:
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def main() -> None:
    """Count each run twice; print PostgreSQL's instructions a message."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", default="hn,c", help="eop bench run keys, comma-separated")
    parser.add_argument("--short", type=int, default=3_000)
    parser.add_argument("--long", type=int, default=13_000)
    args = parser.parse_args()
    for key in args.runs.split(","):
        started = time.monotonic()
        short, long = count(key, args.short), count(key, args.long)
        per = (long - short) / (args.long - args.short)
        took = time.monotonic() - started
        print(f"({key}) {per:>9,.0f} instructions a message  ({took:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
