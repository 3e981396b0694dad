"""The chaos run end to end: servers, proxies, workers, publisher, faults, heal, drain, check.

    from eop.tools import chaos
    report = chaos.run(chaos.Config(messages=3000, duration_s=75, seed=7))
    print(report.render())

Phases: start a nats-server (file storage, user and password) and a PostgreSQL of its
own, with a fault proxy in front of each; start K real ``eop worker`` processes, fault
points armed (:mod:`eop.tools.chaos.armed`), through the proxies; publish the logical
messages while the seeded schedule injects faults; heal everything and wait for the
consumer to drain (a liveness failure if it does not in time); stop the workers; check
every message, the aggregate invariant and every log line. A pipeline target (downstream
stages, a writer) is checked stage by stage, and its outbox against the streams the
relays published to (:mod:`eop.tools.chaos.relayed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol, TypeVar

import nats
import nats.errors
import sqlalchemy as sa
from nats.js import JetStreamContext

from eop import errors
from eop.app import App
from eop.broker import jetstream
from eop.handler import HandlerSpec
from eop.ordering import partitions
from eop.outbox import sql as outbox_sql
from eop.pg import migrate, models
from eop.pg.sql import retries as retries_sql
from eop.settings import Settings
from eop.tools import embedded
from eop.tools.chaos import (
    bank,
    checker,
    hunts,
    injector,
    proxy,
    publisher,
    relayed,
    scenarios,
    schedule,
    workers,
)
from eop.tools.chaos.report import Report
from eop.tools.chaos.target import Payload, Target, WriterResult
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
class _Servers:
    nats: embedded.NatsServer
    pg: embedded.PostgresServer
    canaries: dict[str, str]
    nats_user: str = "chaos"

    @property
    def nats_url(self) -> str:
        return self.nats_url_at(self.nats.port)

    def nats_url_at(self, port: int) -> str:
        return f"nats://{self.nats_user}:{self.canaries['nats password']}@127.0.0.1:{port}"

    def database_url(self, port: int) -> str:
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


def run(config: Config) -> Report:
    """Run a chaos test; the report says whether exactly-once held."""
    config = with_scenario(config)
    if scenarios.get(config.scenario).nats_nodes > 1:
        raise errors.ConfigurationError(
            f"scenario {config.scenario!r} runs a NATS cluster: eop.tools.chaos.run or "
            "eop.tools.chaos.cluster.run, not eop.tools.chaos.harness.run"
        )
    return execute(
        config,
        lambda args: embedded.NatsServer(args=args),
        lambda server: server,
        lambda seed, servers, log_dir, _: _Run(config, seed, servers, log_dir).run(),
    )


class _NatsProcesses(Protocol):
    def start(self) -> None: ...

    def close(self) -> None: ...


N = TypeVar("N", bound=_NatsProcesses)


def execute(
    config: Config,
    nats_with: Callable[[list[str]], N],
    first: Callable[[N], embedded.NatsServer],
    run_on: Callable[[int, _Servers, Path, N], Coroutine[Any, Any, Report]],
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
        servers = _Servers(first(nats_processes), pg, canaries)
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


class _Run:
    """One run's moving parts, inside the event loop."""

    def __init__(self, config: Config, seed: int, servers: _Servers, log_dir: Path) -> None:

        self.config, self.seed, self.servers, self.log_dir = config, seed, servers, log_dir
        app = App.from_path(config.target.app)
        if config.target.handler not in app.handlers:
            raise errors.ConfigurationError(
                f"{config.target.app} has no handler {config.target.handler!r}"
            )
        self.spec = app.handlers[config.target.handler]
        self.stream_spec = app.stream_spec(self.spec.stream)
        missing = [h for h in config.target.handlers if h not in app.handlers]
        if missing:
            raise errors.ConfigurationError(f"{config.target.app} has no handler {missing[0]!r}")
        self.specs: list[HandlerSpec] = [app.handlers[h] for h in config.target.handlers]
        """The target's handler first, then its downstream stages'."""
        streams = dict.fromkeys(spec.stream for spec in self.specs)
        self.stream_specs = [app.stream_spec(name) for name in streams]
        self.settings = Settings(
            ack_wait_s=config.ack_wait_s, max_attempts=config.max_attempts, lease_margin_s=1.0
        )
        self.scenario = scenarios.get(config.scenario)
        self.report = Report(
            seed=seed,
            command=config.command(seed),
            messages=config.messages,
            scenario=config.scenario,
        )
        self.late_keys: set[str] = set()
        self.written = WriterResult(payloads=[])
        self.effects_by_handler: dict[str, dict[str, int]] = {}
        """Effects per key of each of the target's handlers (for the outbox check)."""
        self.pool_pg_port = 0
        """The PostgreSQL proxy's port (the writer goes through it, as the workers do)."""

    def worker_env(self, nats_port: int, pg_port: int) -> dict[str, str]:
        c = self.config
        env = dict(os.environ)
        env.update(
            EOP_DATABASE_URL=self.servers.database_url(pg_port),
            EOP_NATS_URL=self.servers.nats_url_at(nats_port),
            EOP_LOG_FORMAT="json",
            EOP_LOG_LEVEL="debug",  # ack.retry is logged at debug level
            EOP_ACK_WAIT_S=str(c.ack_wait_s),
            EOP_LEASE_MARGIN_S="1",
            EOP_CONCURRENCY=str(c.concurrency),
            EOP_BATCH=str(c.concurrency),
            EOP_FETCH_TIMEOUT_S="0.3",
            EOP_MAX_ATTEMPTS=str(c.max_attempts),
            EOP_BACKOFF_BASE_S="0.1",
            EOP_BACKOFF_MAX_S="1",
            EOP_ACK_TIMEOUT_S="0.5",
            EOP_ACK_GIVE_UP_S="3",
            EOP_LOCK_TIMEOUT_S="1",
            EOP_STATEMENT_TIMEOUT_S="10",
            EOP_SHUTDOWN_GRACE_S="8",
        )
        for name, value in self.scenario.env.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        # The worker imports the app by name: make this interpreter's path its path.
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *sys.path[1:]])
        return env

    async def run(self) -> Report:
        c, r = self.config, self.report
        nats_proxy = proxy.FaultProxy("127.0.0.1", self.servers.nats.port, protocol="nats")
        pg_proxy = proxy.FaultProxy("127.0.0.1", self.servers.pg.port, protocol="postgres")
        await nats_proxy.start()
        await pg_proxy.start()
        self.pool_pg_port = pg_proxy.port
        pool = self._pool(nats_proxy.port, pg_proxy.port)
        nc = None
        try:
            nc = await nats.connect(
                self.servers.nats_url,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.2,
                # The harness kills this server on purpose: its errors are expected.
                error_cb=_ignore,
            )
            js = nc.jetstream()
            inj = injector.Injector(
                nats_server=self.servers.nats,
                pg=self.servers.pg,
                database=DATABASE,
                nats_proxy=nats_proxy,
                pg_proxy=pg_proxy,
                pool=pool,
                js=js,
                spec=self.spec,
                settings=self.settings,
            )
            for stream_spec in self.stream_specs:
                await jetstream.ensure_stream(js, stream_spec, create=True)
            await inj.ensure_consumer()
            payloads = [
                c.target.payloads(i, random.Random(f"{self.seed}:{i}")) for i in range(c.messages)
            ]
            pub = self._publisher(js)
            inj.hunts = self._hunts(pool, pub)
            await self._chaos(pub, pool, inj, payloads)
            await self._heal_and_drain(js, pool)
            await inj.hunts.close()
            r.figures.update(inj.hunts.figures)
            r.final_exit_codes = list((await asyncio.to_thread(pool.stop_all)).values())
            r.stored = (await js.stream_info(self.spec.stream)).state.messages
            everything = payloads + inj.hunts.extra + self.written.payloads
            self._check(pool, everything)
            if c.target.downstream or c.target.writer is not None:
                await self._check_outbox(js)
        finally:
            if nc is not None:
                with contextlib.suppress(nats.errors.Error, OSError, asyncio.TimeoutError):
                    await nc.close()
            r.proxy = dict(nats_proxy.stats + pg_proxy.stats)
            await nats_proxy.close()
            await pg_proxy.close()
            pool.close()
        return r

    def _pool(self, nats_port: int, pg_port: int) -> workers.WorkerPool:
        c = self.config
        return workers.WorkerPool(
            app=c.target.app,
            handlers=c.target.handlers,
            env=self.worker_env(nats_port, pg_port),
            log_dir=self.log_dir,
            count=c.workers,
            seed=self.seed,
            ack_wait_s=c.ack_wait_s,
            args=c.worker_args,
            batch_mode=c.batch_mode,
            slot_env=self.scenario.slot_env,
            arm=self.scenario.arm_workers,
            kill_spots=self.scenario.kill_spots,
            relay_spots=self.scenario.relay_spots,
            slot_args=self.scenario.slot_args,
            active=self.scenario.initial_workers,
        )

    def _publisher(self, js: JetStreamContext) -> publisher.Publisher:
        headers = {
            "Authorization": f"Bearer {self.servers.canaries['authorization header']}",
            "X-Api-Key": self.servers.canaries["api key header"],
        }
        return publisher.Publisher(js, self.config.target.subject or self.spec.subject, headers)

    def _hunts(self, pool: workers.WorkerPool, pub: publisher.Publisher) -> hunts.Hunts:
        return hunts.Hunts(
            pg=self.servers.pg,
            database=DATABASE,
            pool=pool,
            target=self.config.target,
            pub=pub,
            nats_port=self.servers.nats.port,
            nats_credentials=(self.servers.nats_user, self.servers.canaries["nats password"]),
            flood=self.config.flood,
        )

    async def _chaos(
        self,
        pub: publisher.Publisher,
        pool: workers.WorkerPool,
        inj: injector.Injector,
        payloads: list[Payload],
    ) -> None:
        c = self.config
        budget = scenarios.attempts_budget_s(pool.env)
        faults = schedule.build(
            self.seed,
            c.duration_s,
            mean_gap_s=c.mean_fault_gap_s,
            workers=c.workers,
            ack_wait_s=c.ack_wait_s,
            weights=self.scenario.weights,
            required=self.scenario.required,
            shape=schedule.Shape(attempts_budget_s=budget),
        )
        scripted = schedule.timeline(
            self.seed, c.duration_s, self.scenario.timeline, ack_wait_s=c.ack_wait_s
        )
        faults = sorted(faults + scripted, key=lambda f: f.at_s)
        sends = publisher.plan(
            payloads, self.seed, c.duration_s * 0.85, self.stream_spec.duplicate_window_s
        )
        self.late_keys = {send.payload.key for send in sends if send.late}
        pool.start()
        monitor = asyncio.create_task(_monitor(pool, self.report.timings_s))
        # The clock starts once the workers run: the first faults and messages
        # then meet workers at work, not workers still connecting.
        await asyncio.to_thread(pool.wait_started, 30.0)
        started = time.monotonic()
        try:
            await asyncio.gather(
                pub.run(sends, started), inj.run(faults, started), self._write(c.duration_s * 0.85)
            )
            remaining = started + c.duration_s - time.monotonic()
            if remaining > 0:
                await asyncio.sleep(remaining)
            await inj.heal()
            self.report.healed_at = datetime.datetime.now(datetime.timezone.utc).isoformat()
        finally:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
        self.report.publishes = pub.publishes
        self.report.faults = inj.counts

        self.report.timings_s["chaos"] = time.monotonic() - started

    async def _write(self, spread_s: float) -> None:
        """Run the target's writer (if any) through the PostgreSQL proxy, like a web service."""
        writer = self.config.target.writer
        if writer is None:
            return
        url = self.servers.database_url(self.pool_pg_port)
        self.written = await writer(url, self.config.messages // 2, spread_s, self.seed)
        w = self.written
        self.report.figures["writer"] = (
            f"{len(w.payloads)} orders committed once each in the app's own transactions; "
            f"{w.retries} transactions retried, {w.found_committed} found committed on retry "
            "(ambiguous COMMIT)"
        )
        self.report.invariant_problems += [
            f"the writer could not commit order {key} by the end" for key in w.unfinished
        ]

    async def _heal_and_drain(self, js: JetStreamContext, pool: workers.WorkerPool) -> None:
        started = time.monotonic()
        # Unarmed workers from here on; stopping the armed ones gracefully is
        # one more fault (SIGTERM with messages in flight).
        # No overlap seen yet (every held claim was cut short by some fault):
        # one drain worker holds its first claims past AckWait, in calm.
        overlaps = await asyncio.to_thread(_count_in_logs, pool, '"message.claim_timeout"')
        await asyncio.to_thread(functools.partial(pool.replace_all, stall=overlaps == 0))
        monitor = asyncio.create_task(_monitor(pool, self.report.timings_s))
        engine = sa.create_engine(self.servers.pg.url_for(DATABASE, driver="psycopg"))

        def waiting() -> int:
            # A failed message waits for its retry in the database, acked in NATS;
            # an outbox row for its relay.
            tables = models.tables()
            with engine.connect() as conn:
                found = sum(
                    int(conn.execute(retries_sql.count_parked(tables, spec.name)).scalar_one())
                    for spec in self.specs
                )
                if self.config.target.downstream or self.config.target.writer is not None:
                    found += int(conn.execute(outbox_sql.summary(tables)).one()[0])
                return found

        try:
            drained = await _wait_drained(
                js, self.specs, self.config.drain_deadline_s, lambda: asyncio.to_thread(waiting)
            )
        finally:
            engine.dispose()
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
        if not drained:
            self.report.liveness = (
                f"the consumer did not drain within {self.config.drain_deadline_s:g} s "
                f"after healing (pending: {await _pending(js, self.specs)})"
            )
        self.report.timings_s["drain"] = time.monotonic() - started

    async def _check_outbox(self, js: JetStreamContext) -> None:
        """Every outbox row against the streams it went to (:mod:`eop.tools.chaos.relayed`)."""
        target = self.config.target
        engine = sa.create_engine(self.servers.pg.url_for(DATABASE, driver="psycopg"))
        try:
            with engine.connect() as conn:
                rows = relayed.read_rows(conn, target.key_header)
        finally:
            engine.dispose()
        names = sorted({row.stream for row in rows if row.stream is not None})
        streams = {name: await relayed.read_stream(js, name) for name in names}
        effects = {
            name: [self.effects_by_handler.get(s.name, {}) for s in self.specs if s.stream == name]
            for name in names
        }
        self.report.outbox = verdict = relayed.check(rows, streams, effects)
        guarded = self.report.logs.guard_skips
        for name in names:
            skips = sum(guarded[spec.name] for spec in self.specs if spec.stream == name)
            self.report.figures[f"msg-id guard in {name}"] = (
                f"{verdict.copied_in.get(name, 0)} outbox messages stored more than once; "
                f"{skips} deliveries skipped by the guard (as logged, the publisher's "
                "republishes included; a worker killed right after its ack logs none)"
            )

    def _check(self, pool: workers.WorkerPool, payloads: list[Payload]) -> None:
        r, target = self.report, self.config.target
        engine = sa.create_engine(self.servers.pg.url_for(DATABASE, driver="psycopg"))
        try:
            with engine.connect() as conn:
                effects, dead = _effects(conn, target.handler, target.effects_sql)
                self.effects_by_handler[target.handler] = effects
                for index, stage in enumerate(target.downstream, 1):
                    # Dead letters are keyed by msg-id: downstream, a forwarded message's
                    # is the one its outbox row got, so one shows as unexpected, and its
                    # message as lost. None is expected there.
                    stage_effects, stage_dead = _effects(conn, stage.handler, stage.effects_sql)
                    self.effects_by_handler[stage.handler] = stage_effects
                    r.stages[stage.handler] = checker.check_outcomes(
                        checker.planned_at(payloads, index), stage_effects, stage_dead
                    )
                if target.invariant is not None:
                    r.invariant_problems += target.invariant(conn, payloads)
                if target.invariant_sql:
                    violations = conn.execute(sa.text(target.invariant_sql)).all()
                    r.invariant_problems += [f"invariant_sql row {tuple(v)}" for v in violations]
                if target.order_sql:
                    r.order = checker.check_order(conn.execute(sa.text(target.order_sql)))
        finally:
            engine.dispose()
        r.outcomes = checker.check_outcomes(checker.planned_at(payloads, 0), effects, dead)
        # Say which duplicates were republished after the server's window: it
        # tells a msg-id guard failure from a protocol one at a glance.
        r.outcomes.duplicated = [
            f"{item} (republished after the duplicate window)"
            if item.split(":")[0] in self.late_keys
            else item
            for item in r.outcomes.duplicated
        ]
        r.logs = checker.scan_logs(pool.logs(), self.servers.canaries)
        spots = (*self.scenario.kill_spots, *self.scenario.relay_spots)
        r.evidence = checker.evidence(r.logs, spots)
        if self.config.require_evidence:
            r.missing_evidence = checker.missing_evidence(
                r.evidence, spots, races=self.scenario.evidence_races
            )
        r.worker_exits = pool.exits
        r.incarnations = len(pool.incarnations)
        r.stops = list(pool.stops)
        r.stop_limit_s = pool.stop_limit_s


def _effects(
    conn: sa.Connection, handler: str, effects_sql: str
) -> tuple[dict[str, int], dict[str | None, list[str]]]:
    """A handler's effects per key, and its dead letters' reasons per msg-id."""
    effects = {str(k): int(n) for k, n in conn.execute(sa.text(effects_sql))}
    dead: dict[str | None, list[str]] = {}
    rows = conn.execute(
        sa.text("SELECT msg_id, reason FROM eop.dead_letters WHERE subscription = :s"),
        {"s": handler},
    )
    for msg_id, reason in rows:
        dead.setdefault(msg_id, []).append(str(reason))
    return effects, dead


def _count_in_logs(pool: workers.WorkerPool, needle: str) -> int:
    total = 0
    for path in pool.logs():
        with contextlib.suppress(OSError):
            total += path.read_text(encoding="utf-8", errors="replace").count(needle)
    return total


async def _ignore(_: Exception) -> None:
    return None


async def _monitor(pool: workers.WorkerPool, lag: dict[str, float]) -> None:
    """Replace dead workers; measure how late this loop runs (the proxies live in it)."""
    loop = asyncio.get_running_loop()
    while True:
        pool.poll()
        before = loop.time()
        await asyncio.sleep(0.1)
        late = loop.time() - before - 0.1
        lag["max loop lag"] = max(lag.get("max loop lag", 0.0), late)


async def _pending(js: JetStreamContext, specs: list[HandlerSpec]) -> str:
    found = []
    for spec in specs:
        try:
            infos = await partitions.handler_consumers(js, spec)
        except Exception as exc:  # only for the message of a liveness failure
            found.append(f"{spec.name}: unknown ({type(exc).__name__})")
            continue
        pending = sum(i.num_pending or 0 for i in infos)
        unacked = sum(i.num_ack_pending or 0 for i in infos)
        found.append(f"{spec.name}: {pending} undelivered, {unacked} awaiting ack")
    return "; ".join(found)


async def _consumers_quiet(js: JetStreamContext, specs: list[HandlerSpec]) -> bool:
    for spec in specs:
        infos = await partitions.handler_consumers(js, spec)
        if not infos or any(i.num_pending or i.num_ack_pending for i in infos):
            return False
    return True


async def _wait_drained(
    js: JetStreamContext,
    specs: list[HandlerSpec],
    deadline_s: float,
    waiting: Callable[[], Awaitable[int]],
) -> bool:
    """Wait until every consumer has nothing undelivered and nothing unacked, and nothing
    waits in the database (a parked retry, an outbox row), twice in a row."""
    end = time.monotonic() + deadline_s
    streak = 0
    while time.monotonic() < end:
        try:
            quiet = await _consumers_quiet(js, specs) and await waiting() == 0
        except Exception:  # a liveness probe: anything but "drained" means "not yet"
            quiet = False
        streak = streak + 1 if quiet else 0
        if streak >= 2:
            return True
        await asyncio.sleep(0.5)
    return False
