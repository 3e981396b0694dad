"""A chaos run's test bed: its shape (:class:`Config`, with its scenario's settings), its
servers and the secrets planted in them, and :func:`execute`, which sets them up, runs the
run on them and tears them down (:mod:`eop.tools.chaos.harness` on one nats-server,
:mod:`eop.tools.chaos.cluster` on three).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol, TypeVar

from eop.pg import migrate
from eop.tools import embedded
from eop.tools.chaos import bank, scenarios
from eop.tools.chaos.report import Report
from eop.tools.chaos.target import Target
from eop.tools.chaos.workers import BatchMode

DATABASE = "chaos"


@dataclasses.dataclass(frozen=True)
class Config:
    """The shape of a chaos run. The defaults are the CI size."""

    target: Target = dataclasses.field(default_factory=bank.target)
    messages: int = 3000
    workers: int = 3
    duration_s: float = 75.0
    """The chaos phase: publishing and fault injection."""
    seed: int | None = None
    mean_fault_gap_s: float = 0.3
    drain_deadline_s: float = 90.0
    ack_wait_s: float = 4.0
    concurrency: int = 4
    max_attempts: int = 15
    batch_mode: BatchMode = "mixed"
    """Per-message transactions on even worker slots, batch transactions on odd ones."""
    worker_args: tuple[str, ...] = ()
    """Extra ``eop worker`` flags (for example ``--batch 8``)."""
    log_dir: Path | None = None
    """Where worker logs go (default: a temporary folder, kept only if the run fails)."""
    require_evidence: bool = True
    """Fail unless the logs show every fault point killed and the hard races happened
    (demanded by the ``classic`` scenario only)."""
    scenario: str = "classic"
    """Which :mod:`eop.tools.chaos.scenarios` to run: its target (unless ``target`` is set to
    another than the bank), worker settings and fault mix."""
    flood: tuple[int, int] = (1200, 200)
    """A poison flood: always-failing messages, then good ones."""

    def command(self, seed: int) -> str:
        """The ``eop chaos`` command line that replays this run's fault schedule."""
        parts = [
            "eop chaos",
            f"--seed {seed}",
            f"--messages {self.messages}",
            f"--workers {self.workers}",
            f"--duration-s {self.duration_s:g}",
            f"--fault-gap-s {self.mean_fault_gap_s:g}",
            f"--batch-mode {self.batch_mode}",
        ]
        if self.scenario != "classic":
            parts.append(f"--scenario {self.scenario}")
        if self.target.app not in (bank.target().app, *_BUILT_IN_APPS):
            parts.append(f"--app {self.target.app} --handler {self.target.handler} ...")
        return " ".join(parts)


_BUILT_IN_APPS = (
    "eop.tools.chaos.hot:app",
    "eop.tools.chaos.pipeline:app",
    "eop.tools.chaos.ordered:app",
)


@dataclasses.dataclass
class Servers:
    """The run's nats-server (the one the harness talks to, of a cluster) and PostgreSQL,
    with the secrets planted in the run."""

    nats: embedded.NatsServer
    pg: embedded.PostgresServer
    canaries: dict[str, str]
    nats_user: str = "chaos"

    @property
    def nats_url(self) -> str:
        """Its nats-server's URL, with the chaos user's credentials."""
        return self.nats_url_at(self.nats.port)

    def nats_url_at(self, port: int) -> str:
        """The URL of the nats-server (or proxy) at ``port``, with the credentials."""
        return f"nats://{self.nats_user}:{self.canaries['nats password']}@127.0.0.1:{port}"

    def database_url(self, port: int) -> str:
        """The URL of the run's database through the PostgreSQL (or proxy) at ``port``."""
        # Trust authentication ignores the password: it is there to be leaked, or not.
        password = self.canaries["postgres password"]
        return f"postgresql+asyncpg://postgres:{password}@127.0.0.1:{port}/{DATABASE}"


def make_canaries(seed: int) -> dict[str, str]:
    """Secrets planted in the run; none may appear in a log line."""
    rng = random.Random(f"eop-chaos-canary:{seed}")

    def token(kind: str) -> str:
        return f"cnry{kind}{rng.getrandbits(64):016x}"

    return {
        "nats password": token("nats"),
        "postgres password": token("pg"),
        "authorization header": token("auth"),
        "api key header": token("key"),
        "payload": bank.CANARY_PAYLOAD,
    }


class _NatsProcesses(Protocol):
    def start(self) -> None: ...

    def close(self) -> None: ...


N = TypeVar("N", bound=_NatsProcesses)


def execute(
    config: Config,
    nats_with: Callable[[list[str]], N],
    first: Callable[[N], embedded.NatsServer],
    run_on: Callable[[int, Servers, Path, N], Coroutine[Any, Any, Report]],
) -> Report:
    """One chaos run of ``config`` (its scenario applied): the servers, the database, the run.

    ``nats_with(args)`` makes the NATS server(s) with the chaos user's flags,
    ``first`` names the one the checker talks to, ``run_on(seed, servers,
    log_dir, nats)`` is the run itself. The log directory is removed after a
    clean run unless the caller chose it.
    """
    seed = config.seed if config.seed is not None else random.randrange(1_000_000)
    canaries = make_canaries(seed)
    log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="eop-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    nats_processes = nats_with(["--user", "chaos", "--pass", canaries["nats password"]])
    pg = embedded.PostgresServer(settings={"deadlock_timeout": "100ms", "max_connections": "300"})
    try:
        nats_processes.start()
        pg.start()
        servers = Servers(first(nats_processes), pg, canaries)
        migrate.upgrade(pg.create_database(DATABASE))
        if config.target.setup is not None:
            config.target.setup(pg.url_for(DATABASE, driver="psycopg"))
        report = asyncio.run(run_on(seed, servers, log_dir, nats_processes))
    finally:
        pg.close()
        nats_processes.close()
    report.timings_s["total"] = time.monotonic() - started
    report.log_dir = str(log_dir)
    if report.ok and config.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
        report.log_dir = ""
    return report


def with_scenario(config: Config) -> Config:
    """``config`` with its scenario's target (unless a custom one was set) and overrides."""
    scenario = scenarios.get(config.scenario)
    changes: dict[str, Any] = dict(scenario.overrides)
    if config.target == bank.target():
        changes["target"] = scenario.target()
    changes["require_evidence"] = config.require_evidence and scenario.require_evidence
    return dataclasses.replace(config, **changes)
