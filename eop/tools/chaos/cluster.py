"""The chaos run on a NATS cluster: leaders of an R3 stream and its consumer killed.

    from eop.tools import chaos
    report = chaos.run(chaos.Config(scenario="cluster", messages=600, duration_s=36))

Three nats-servers (:class:`eop.tools.embedded_cluster.NatsCluster`) each with its
own store; the target's streams created with three replicas (the consumer
follows its stream's); worker processes connected to all three URLs; the
publisher retrying each message with its ``Nats-Msg-Id`` until a server has
it. Meanwhile, one at a time, the server leading the stream (then the one
leading the consumer, in turn) is SIGKILLed, left down a moment, and started
again on the same store; the next kill waits until every server is healthy
again, so a quorum of two always survives. Then drain and check as the
single-server harness does: lost, duplicated, wrongly dead-lettered, stalls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import random
import statistics
import time
from pathlib import Path
from typing import Literal

import nats
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from eop import errors
from eop.broker import consumers, jetstream
from eop.handler import HandlerSpec
from eop.tools import embedded_cluster
from eop.tools.chaos import harness, publisher, scenarios, testbed, workers
from eop.tools.chaos.report import Report
from eop.tools.chaos.target import Payload

REPLICAS = 3
Role = Literal["stream", "consumer"]
_INFO_ERRORS = (*jetstream.NATS_ERRORS, nats.js.errors.Error)


def run(config: testbed.Config) -> Report:
    """Run the ``cluster`` scenario (or another with ``nats_nodes`` > 1)."""
    config = testbed.with_scenario(config)
    nodes_count = scenarios.get(config.scenario).nats_nodes
    return testbed.execute(
        config,
        lambda args: embedded_cluster.NatsCluster(nodes_count, args=args),
        lambda nodes: nodes.servers[nodes.names[0]],
        lambda seed, servers, log_dir, nodes: _ClusterRun(
            config, seed, servers, log_dir, nodes
        ).run(),
    )


@dataclasses.dataclass(frozen=True)
class Kill:
    """One leader killed, and how long the cluster took to get over it."""

    role: Role
    server: str
    led_both: bool
    """It led the stream and the consumer."""
    election_s: float | None
    """From the kill until the group answered with another leader (None: not in time)."""
    healthy_s: float
    """From its restart until every server was healthy again."""


@dataclasses.dataclass
class LeaderKiller:
    """Kills the stream's leader and the consumer's leader in turn, one at a time."""

    nodes: embedded_cluster.NatsCluster
    js: JetStreamContext
    spec: HandlerSpec
    rng: random.Random
    gap_s: float
    kills: list[Kill] = dataclasses.field(default_factory=list)
    counts: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    async def run(self, until: float) -> None:
        """Kill, restart and wait for health, again and again until ``until``
        (``time.monotonic()``); every server runs when it returns."""
        roles: tuple[Role, Role] = ("stream", "consumer")
        turn = 0
        while time.monotonic() + self.gap_s < until:
            await asyncio.sleep(self.rng.uniform(0.5, 1.5) * self.gap_s)
            role = roles[turn % 2]
            turn += 1
            leaders = {r: await self.leader(r) for r in roles}
            victim = leaders[role]
            if victim is None:
                self.counts[f"{role}_leader_kill (skipped)"] += 1
                continue
            await self._kill(role, victim, led_both=leaders["stream"] == leaders["consumer"])

    async def _kill(self, role: Role, victim: str, *, led_both: bool) -> None:
        killed_at = time.monotonic()
        await asyncio.to_thread(self.nodes.kill, victim)
        self.counts[f"{role}_leader_kill"] += 1
        election_s = await self._elected(role, victim, killed_at)
        # Down a while longer: the workers' and publisher's connections to it fail over.
        await asyncio.sleep(self.rng.uniform(0.5, 3.0))
        restarted_at = time.monotonic()
        await asyncio.to_thread(self.nodes.start_server, victim)
        await asyncio.to_thread(self.nodes.wait_healthy, 90.0)
        self.kills.append(Kill(role, victim, led_both, election_s, time.monotonic() - restarted_at))

    async def _elected(self, role: Role, old: str, since: float) -> float | None:
        end = since + 30.0
        while time.monotonic() < end:
            leader = await self.leader(role)
            if leader is not None and leader != old:
                return time.monotonic() - since
            await asyncio.sleep(0.1)
        return None

    async def leader(self, role: Role) -> str | None:
        """The server leading the stream or the consumer now (None: no answer, or none)."""
        try:
            if role == "stream":
                info = await self.js.stream_info(self.spec.stream)
                cluster = info.cluster
            else:
                consumer = await self.js.consumer_info(self.spec.stream, self.spec.durable)
                cluster = consumer.cluster
        except _INFO_ERRORS:
            return None
        return cluster.leader if cluster is not None and cluster.leader else None

    def figures(self) -> dict[str, str]:
        """What the kills took, measured (never asserted)."""
        return kill_figures(self.kills)


def kill_figures(kills: list[Kill]) -> dict[str, str]:
    """Who was killed, and how long elections and recoveries took (for the report)."""
    if not kills:
        return {"leader kills": "none"}
    elections = [k.election_s for k in kills if k.election_s is not None]
    return {
        "leader kills": ", ".join(
            f"{k.role} leader {k.server}{' (both)' if k.led_both else ''}" for k in kills
        ),
        "new leader after a kill": _spread(elections)
        + f" ({len(kills) - len(elections)} not within 30 s)",
        "all servers healthy after a restart": _spread([k.healthy_s for k in kills]),
    }


def _spread(values: list[float]) -> str:
    if not values:
        return "none"
    return f"median {statistics.median(values):.1f} s, max {max(values):.1f} s"


class _ClusterRun(harness._Run):
    """The harness's run, on a cluster: no proxies, the leader killer as the faults."""

    def __init__(
        self,
        config: testbed.Config,
        seed: int,
        servers: testbed.Servers,
        log_dir: Path,
        nodes: embedded_cluster.NatsCluster,
    ) -> None:
        super().__init__(config, seed, servers, log_dir)
        self.nodes = nodes
        self.stream_specs = [dataclasses.replace(s, replicas=REPLICAS) for s in self.stream_specs]

    @property
    def nats_urls(self) -> list[str]:
        return [self.servers.nats_url_at(port) for port in self.nodes.ports]

    def worker_env(self, nats_port: int, pg_port: int) -> dict[str, str]:
        env = super().worker_env(nats_port, pg_port)
        env["EOP_NATS_URL"] = ",".join(self.nats_urls)
        return env

    async def run(self) -> Report:
        c, r = self.config, self.report
        self.pool_pg_port = self.servers.pg.port
        pool = self._pool(0, self.pool_pg_port)
        nc = None
        try:
            nc = await nats.connect(
                servers=self.nats_urls,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.2,
                error_cb=harness._ignore,  # the run kills servers on purpose
            )
            js = nc.jetstream()
            await self._provision(js)
            payloads = [
                c.target.payloads(i, random.Random(f"{self.seed}:{i}")) for i in range(c.messages)
            ]
            pub = self._publisher(js)
            killer = LeaderKiller(
                # A short timeout: a request to a dead leader must not hide the election.
                self.nodes, nc.jetstream(timeout=1.0), self.spec,
                random.Random(f"eop-chaos-leaders:{self.seed}"), c.mean_fault_gap_s,
            )  # fmt: skip
            await self._chaos_on_cluster(pub, pool, killer, payloads)
            await self._heal_and_drain(js, pool)
            r.final_exit_codes = list((await asyncio.to_thread(pool.stop_all)).values())
            r.stored = (await js.stream_info(self.spec.stream)).state.messages
            self._check(pool, payloads)
        finally:
            if nc is not None:
                with contextlib.suppress(nats.errors.Error, OSError, asyncio.TimeoutError):
                    await nc.close()
            pool.close()
        return r

    async def _provision(self, js: JetStreamContext, deadline_s: float = 60.0) -> None:
        """The R3 streams and the consumers (a fresh cluster may still be electing)."""
        end = time.monotonic() + deadline_s
        while True:
            try:
                for stream_spec in self.stream_specs:
                    await jetstream.ensure_stream(js, stream_spec, create=True)
                for spec in self.specs:
                    await consumers.ensure_consumer(js, spec, self.settings, create=True)
                return
            except errors.EopError:
                if time.monotonic() > end:
                    raise
                await asyncio.sleep(0.5)

    async def _chaos_on_cluster(
        self,
        pub: publisher.Publisher,
        pool: workers.WorkerPool,
        killer: LeaderKiller,
        payloads: list[Payload],
    ) -> None:
        c = self.config
        sends = publisher.plan(
            payloads, self.seed, c.duration_s * 0.85, self.stream_spec.duplicate_window_s
        )
        self.late_keys = {send.payload.key for send in sends if send.late}
        pool.start()
        monitor = asyncio.create_task(harness._monitor(pool, self.report.timings_s))
        await asyncio.to_thread(pool.wait_started, 30.0)
        started = time.monotonic()
        try:
            await asyncio.gather(pub.run(sends, started), killer.run(started + c.duration_s))
            remaining = started + c.duration_s - time.monotonic()
            if remaining > 0:
                await asyncio.sleep(remaining)
        finally:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
        self.report.publishes = pub.publishes
        self.report.faults = killer.counts
        self.report.figures.update(killer.figures())
        self.report.figures["publish retries"] = str(pub.retries)
        self.report.timings_s["chaos"] = time.monotonic() - started
