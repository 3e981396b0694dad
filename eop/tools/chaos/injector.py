"""Applies the fault schedule to the running system, then heals it.

Every fault runs as a task of its own, so a long one (a stopped worker, a
server outage) does not delay the next. Blocking steps (starting and stopping
servers) run in threads: the fault proxies share this event loop, and the
workers' traffic must keep flowing through them meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import subprocess
import time
from collections.abc import Sequence

import nats.errors
import nats.js.errors
import sqlalchemy as sa
from nats.js import JetStreamContext
from sqlalchemy.pool import NullPool

from eop.broker import consumers, jetstream
from eop.handler import HandlerSpec
from eop.settings import Settings
from eop.tools import embedded
from eop.tools.chaos import hunts, proxy, schedule, workers


class Injector:
    """Injects scheduled faults into servers, proxies, workers and the consumer."""

    def __init__(
        self,
        *,
        nats_server: embedded.NatsServer,
        pg: embedded.PostgresServer,
        database: str,
        nats_proxy: proxy.FaultProxy,
        pg_proxy: proxy.FaultProxy,
        pool: workers.WorkerPool,
        js: JetStreamContext,
        spec: HandlerSpec,
        settings: Settings,
    ) -> None:
        self.nats, self.pg, self.database = nats_server, pg, database
        self.nats_proxy, self.pg_proxy = nats_proxy, pg_proxy
        self.pool, self.js, self.spec, self.settings = pool, js, spec, settings
        self.counts: collections.Counter[str] = collections.Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self.hunts: hunts.Hunts | None = None
        """Applies the hunts' fault kinds (:mod:`eop.tools.chaos.hunts`)."""

    async def run(self, faults: Sequence[schedule.Fault], started: float) -> None:
        """Start each fault at its time; return once the last one has started."""
        for fault in faults:
            delay = started + fault.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._apply(fault))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def finish(self) -> None:
        """Wait for the faults still under way to end (each ends by itself)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _apply(self, fault: schedule.Fault) -> None:
        apply = getattr(self, f"_{fault.kind}", None) or getattr(self.hunts, fault.kind, None)
        if apply is None:
            self.counts[f"{fault.kind} (skipped)"] += 1
            return
        try:
            done = await apply(fault)
        except Exception as exc:  # the system is under fire: a fault may fail to apply
            done = False
            self.counts[f"{fault.kind} (failed: {type(exc).__name__})"] += 1
            return
        self.counts[fault.kind if done is not False else f"{fault.kind} (skipped)"] += 1

    async def _worker_kill(self, fault: schedule.Fault) -> bool:
        return self.pool.kill(fault.target)

    async def _worker_stop(self, fault: schedule.Fault) -> bool:
        inc = self.pool.pause(fault.target)
        if inc is None:
            return False
        await asyncio.sleep(fault.duration_s)
        self.pool.resume(inc)
        return True

    async def _worker_stop_long(self, fault: schedule.Fault) -> bool:
        """SIGSTOP past AckWait: the target slot's worker, or the next one that can be."""
        for k in range(self.pool.active):
            inc = self.pool.pause(fault.target + k)
            if inc is not None:
                await asyncio.sleep(fault.duration_s)
                self.pool.resume(inc)
                return True
        return False

    async def _scale_workers(self, fault: schedule.Fault) -> bool:
        """Run ``fault.target`` worker commands: start the new ones, or SIGTERM the
        ones beyond and time their stops (``scale-down``)."""
        leaving = self.pool.scale(fault.target)
        for inc in leaving:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(inc.proc.wait, self.pool.stop_limit_s + 5.0)
            code = inc.proc.poll()
            self.pool.record_stop(inc, "scale-down", code)
            if code is None:
                inc.killed_by_harness = True
                inc.send(signal.SIGKILL)
        return True

    async def _nats_kill(self, fault: schedule.Fault) -> bool:
        return await hunts.down_for(self.nats.kill, self.nats.start, fault.duration_s)

    async def _nats_restart(self, fault: schedule.Fault) -> bool:
        return await hunts.down_for(self.nats.stop, self.nats.start, fault.duration_s)

    async def _pg_restart(self, fault: schedule.Fault) -> bool:
        return await hunts.down_for(self.pg.stop, self.pg.start, fault.duration_s)

    async def _pg_crash(self, fault: schedule.Fault) -> bool:
        return await hunts.down_for(self.pg.kill, self.pg.start, fault.duration_s)

    async def _pg_terminate(self, fault: schedule.Fault) -> bool:
        if self.pg.pid is None:
            return False
        if fault.target == 0:
            return bool(await asyncio.to_thread(self.pg.terminate_backends, self.database))
        return bool(await asyncio.to_thread(self._terminate_some, fault.target + 1))

    def _terminate_some(self, every: int) -> int:
        """Terminate one backend in ``every`` (by pid), not all of them."""
        sql = (
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = :database AND pid <> pg_backend_pid() AND pid % :every = 0"
        )
        engine = sa.create_engine(self.pg.sync_url, poolclass=NullPool)
        try:
            with engine.connect() as conn:
                params = {"database": self.database, "every": every}
                return int(conn.execute(sa.text(sql), params).scalar_one())
        finally:
            engine.dispose()

    async def _latency(self, target: proxy.FaultProxy, fault: schedule.Fault) -> bool:
        target.set_latency(fault.amount)
        await asyncio.sleep(fault.duration_s)
        target.set_latency(0.0)
        return True

    async def _nats_latency(self, fault: schedule.Fault) -> bool:
        return await self._latency(self.nats_proxy, fault)

    async def _pg_latency(self, fault: schedule.Fault) -> bool:
        return await self._latency(self.pg_proxy, fault)

    async def _blackhole(self, target: proxy.FaultProxy, fault: schedule.Fault) -> bool:
        target.blackhole(True)
        await asyncio.sleep(fault.duration_s)
        target.blackhole(False)
        return True

    async def _nats_blackhole(self, fault: schedule.Fault) -> bool:
        return await self._blackhole(self.nats_proxy, fault)

    async def _pg_blackhole(self, fault: schedule.Fault) -> bool:
        return await self._blackhole(self.pg_proxy, fault)

    async def _nats_reset(self, fault: schedule.Fault) -> bool:
        return self.nats_proxy.reset(fault.target + 1) > 0

    async def _pg_reset(self, fault: schedule.Fault) -> bool:
        return self.pg_proxy.reset(fault.target + 1) > 0

    async def _drop_ack_reply(self, fault: schedule.Fault) -> bool:
        for _ in range(fault.target):
            self.nats_proxy.drop_next_reply()
        return True

    async def _drop_commit_reply(self, fault: schedule.Fault) -> bool:
        for _ in range(fault.target):
            self.pg_proxy.drop_next_reply()
        return True

    async def _consumer_recreate(self, fault: schedule.Fault) -> bool:
        if self.spec.order_by is not None:
            return False  # its partitions' consumers are the workers' own
        try:
            await self.js.delete_consumer(self.spec.stream, self.spec.durable)
        except (*jetstream.NATS_ERRORS, nats.js.errors.NotFoundError):
            return False
        await asyncio.sleep(fault.duration_s)
        await self.ensure_consumer()
        return True

    async def ensure_consumer(self, deadline_s: float = 60.0) -> None:
        """Make sure the handler's consumer exists (the workers may have recreated it).

        An ordered handler's consumers are its partitions', made by the workers that
        own them: nothing to do.
        """
        if self.spec.order_by is not None:
            return
        end = time.monotonic() + deadline_s
        while True:
            try:
                await consumers.ensure_consumer(self.js, self.spec, self.settings, create=True)
                return
            except (*jetstream.NATS_ERRORS, nats.js.errors.Error):
                if time.monotonic() > end:
                    raise
                await asyncio.sleep(0.2)

    async def heal(self) -> None:
        """End every fault: servers up, proxies clean, workers resumed, consumer present."""
        await self.finish()
        if self.hunts is not None:
            await self.hunts.heal()
        self.nats_proxy.heal()
        self.pg_proxy.heal()
        self.pool.resume_all()
        if self.nats.pid is None:
            await asyncio.to_thread(self.nats.start)
        if self.pg.pid is None:
            await asyncio.to_thread(self.pg.start)
        # The workers recreate it too; if neither can, the drain deadline says so.
        with contextlib.suppress(*jetstream.NATS_ERRORS, nats.js.errors.Error):
            await self.ensure_consumer()
