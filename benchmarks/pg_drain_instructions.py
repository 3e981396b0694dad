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
import pwd
import re
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import asyncpg

from eop.pg import migrate
from eop.tools import embedded
from eop.tools.bench import harness, runner, runs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
        port = _free_port()
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.%p"]
        command += [str(embedded.postgres_bin_dir() / "postgres"), "-D", str(data)]
        command += ["-p", str(port), "-k", str(tmp), "-c", "listen_addresses=127.0.0.1"]
        command += ["-c", f"fsync={'on' if fsync else 'off'}", "-c", "track_commit_timestamp=on"]
        for name, value in (pg_settings or {}).items():
            command += ["-c", f"{name}={value}"]
        owner = pwd.getpwuid(data.stat().st_uid).pw_name
        if os.geteuid() == 0 and owner != "root":  # PostgreSQL refuses to run as root
            command = ["runuser", "-u", owner, "--", *command]
        with (tmp / "postgres.log").open("w") as log:
            server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            asyncio.run(_until_up(port, server))
            postmaster = int((data / "postmaster.pid").read_text().split()[0])
            with embedded.NatsServer() as nats_server:
                url = f"postgresql+asyncpg://postgres@127.0.0.1:{port}/postgres"
                yield harness.Servers(tmp, nats_server.url, url, (nats_server.pid, postmaster))
        finally:
            # A fast shutdown, sent to the postmaster itself (runuser does not pass it on):
            # every process writes its profile as it exits.
            with contextlib.suppress(OSError, ValueError):
                pid = int((data / "postmaster.pid").read_text().split()[0])
                os.kill(pid, signal.SIGINT)
            server.wait(timeout=600)
        self.total = _totals(tmp)


async def _until_up(port: int, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while True:
        try:
            conn = await asyncpg.connect(
                host="127.0.0.1", port=port, user="postgres", database="postgres"
            )
        except (OSError, asyncpg.PostgresError):
            if time.monotonic() > deadline or server.poll() is not None:
                raise
            await asyncio.sleep(0.5)
        else:
            await conn.close()
            return


def _totals(folder: Path) -> int:
    """The instructions of every process's profile in ``folder``."""
    total = 0
    for path in folder.glob("cg.*"):
        found = re.search(r"^(?:totals|summary): (\d+)", path.read_text(), re.MULTILINE)
        if found is None:
            raise SystemExit(f"no count in {path}")
        total += int(found.group(1))
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
