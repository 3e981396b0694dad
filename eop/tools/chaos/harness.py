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

Its test bed (the run's :class:`Config`, its servers, their set-up and teardown) is
:mod:`eop.tools.chaos.testbed`, its checks :mod:`eop.tools.chaos.verdict`; this module is
the run between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import os
import random
import sys
import time
from pathlib import Path

import nats
import nats.errors
import sqlalchemy as sa
from nats.js import JetStreamContext

from eop import errors
from eop.app import App
from eop.broker import jetstream
from eop.handler import HandlerSpec
from eop.outbox import sql as outbox_sql
from eop.pg import models
from eop.pg.sql import retries as retries_sql
from eop.settings import Settings
from eop.tools import embedded
from eop.tools.chaos import (
    hunts,
    injector,
    proxy,
    publisher,
    scenarios,
    schedule,
    verdict,
    workers,
)
from eop.tools.chaos.report import Report
from eop.tools.chaos.target import Payload, WriterResult

# The test bed's names, importable from here as they were before it was a module of its own.
from eop.tools.chaos.testbed import DATABASE as DATABASE
from eop.tools.chaos.testbed import Config as Config
from eop.tools.chaos.testbed import Servers as Servers
from eop.tools.chaos.testbed import execute as execute
from eop.tools.chaos.testbed import make_canaries as make_canaries
from eop.tools.chaos.testbed import with_scenario as with_scenario


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


class _Run:
    """One run's moving parts, inside the event loop."""

    def __init__(self, config: Config, seed: int, servers: Servers, log_dir: Path) -> None:

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
        engine = sa.create_engine(self._database_url())

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
            drained = await verdict.wait_drained(
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
                f"after healing (pending: {await verdict.describe_pending(js, self.specs)})"
            )
        self.report.timings_s["drain"] = time.monotonic() - started

    def _check(self, pool: workers.WorkerPool, payloads: list[Payload]) -> None:
        """The run's checks once its workers stopped (:func:`eop.tools.chaos.verdict.check`)."""
        self.effects_by_handler.update(
            verdict.check(
                self.report,
                self.config.target,
                self.scenario,
                database_url=self._database_url(),
                pool=pool,
                payloads=payloads,
                late_keys=self.late_keys,
                canaries=self.servers.canaries,
                require_evidence=self.config.require_evidence,
            )
        )

    async def _check_outbox(self, js: JetStreamContext) -> None:
        """Every outbox row against the streams it went to (:mod:`eop.tools.chaos.relayed`)."""
        await verdict.check_outbox(
            self.report,
            self.config.target,
            self.specs,
            self.effects_by_handler,
            database_url=self._database_url(),
            js=js,
        )

    def _database_url(self) -> str:
        return self.servers.pg.url_for(DATABASE, driver="psycopg")


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
