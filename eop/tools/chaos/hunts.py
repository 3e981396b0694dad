"""The faults of the "never zero times" hunts, applied by the chaos harness's
:class:`~eop.tools.chaos.injector.Injector`.

Each outlasts what a message can survive by counting attempts, or feeds the
workers a message that tests their input handling, or times a SIGTERM:

- ``pg_outage_long``: PostgreSQL stopped for longer than the attempts budget;
- ``pg_read_only``: ``ALTER DATABASE ... SET default_transaction_read_only``
  and every backend terminated (new sessions start read-only), as long, then
  reset and terminated again;
- ``row_lock_hold``: the rows every handler updates held ``FOR UPDATE`` by
  another session, as long;
- ``worker_term``: SIGTERM to a running worker, its stop timed;
- ``long_msg_id``: a good message whose ``Nats-Msg-Id`` has 5,000 characters;
- ``raw_bad_subject``: a message published with the raw NATS protocol to a
  subject that is not UTF-8 (expected: one dead letter, ``undecodable``);
- ``poison_flood``: always-failing messages, then good ones; the time until
  the good ones have their effects is a reported figure.

Messages these faults publish are added to :attr:`Hunts.extra`: the checker
judges them like every other.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import string
import subprocess
import time
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from eop.tools import embedded
from eop.tools.chaos import publisher, schedule, workers
from eop.tools.chaos.target import Payload, Target

LONG_MSG_ID_CHARS = 5000
TERM_WAIT_S = 30.0
"""How long a scheduled SIGTERM waits for a running worker before it is skipped."""
_RAW_INBOX = b"_INBOX.eopchaos.raw"


async def down_for(stop: Callable[[], object], start: Callable[[], object], seconds: float) -> bool:
    """A server's outage: ``stop`` it (a clean stop or a kill), wait ``seconds``, ``start``
    it again (both in a thread: they wait for the process). True: the fault was applied."""
    await asyncio.to_thread(stop)
    await asyncio.sleep(seconds)
    await asyncio.to_thread(start)
    return True


class Hunts:
    """Applies the hunt faults; holds what they published and measured."""

    def __init__(
        self,
        *,
        pg: embedded.PostgresServer,
        database: str,
        pool: workers.WorkerPool,
        target: Target,
        pub: publisher.Publisher,
        nats_port: int,
        nats_credentials: tuple[str, str],
        flood: tuple[int, int] = (1200, 200),
    ) -> None:
        self.pg, self.database, self.pool, self.target = pg, database, pool, target
        self.pub = pub
        self.nats_port, self.nats_credentials = nats_port, nats_credentials
        self.flood = flood
        """Always-failing, then good messages of one poison flood."""
        self.extra: list[Payload] = []
        self.figures: dict[str, str] = {}
        self._read_only = False
        self._watchers: set[asyncio.Task[None]] = set()

    # -- PostgreSQL
    async def pg_outage_long(self, fault: schedule.Fault) -> bool:
        """Stop PostgreSQL for longer than a message's attempts budget."""
        return await down_for(self.pg.stop, self.pg.start, fault.duration_s)

    async def pg_read_only(self, fault: schedule.Fault) -> bool:
        """Make the database read-only for new sessions, and cut the old ones."""
        self._read_only = True
        try:
            await asyncio.to_thread(self._set_read_only, True)
            await asyncio.sleep(fault.duration_s)
        finally:
            await self._end_read_only()
        return True

    async def _end_read_only(self) -> None:
        # PostgreSQL may be restarting under another fault: retry, the run
        # must not stay read-only.
        for _ in range(60):
            try:
                await asyncio.to_thread(self._set_read_only, False)
            except sa.exc.SQLAlchemyError:
                await asyncio.sleep(0.5)
                continue
            self._read_only = False
            return

    def _set_read_only(self, on: bool) -> None:
        value = "on" if on else "off"
        self._admin(f'ALTER DATABASE "{self.database}" SET default_transaction_read_only = {value}')
        # Sessions read the database's defaults when they start: cut the old ones.
        self.pg.terminate_backends(self.database)

    def _admin(self, sql: str) -> None:
        engine = sa.create_engine(
            self.pg.sync_url, poolclass=NullPool, isolation_level="AUTOCOMMIT"
        )
        try:
            with engine.connect() as conn:
                conn.execute(sa.text(sql))
        finally:
            engine.dispose()

    async def row_lock_hold(self, fault: schedule.Fault) -> bool:
        """Hold the rows the handlers update, so their statements time out."""
        if not self.target.lock_sql:
            return False
        await asyncio.to_thread(self._hold_locks, self.target.lock_sql, fault.duration_s)
        return True

    def _hold_locks(self, lock_sql: str, seconds: float) -> None:
        url = self.pg.url_for(self.database, driver="psycopg")
        engine = sa.create_engine(url, poolclass=NullPool)
        # Handlers lock the same rows in their own order, so taking them all can
        # deadlock with one, and PostgreSQL may pick this side to abort: try
        # again until the rows are held, then hold them for the whole duration.
        give_up = time.monotonic() + max(seconds, 30.0)
        try:
            while True:
                try:
                    with engine.begin() as conn:
                        conn.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
                        conn.execute(sa.text(lock_sql)).all()
                        time.sleep(seconds)
                        conn.rollback()
                    return
                except sa.exc.OperationalError:
                    if time.monotonic() >= give_up:
                        raise
                    time.sleep(0.05)
        finally:
            engine.dispose()

    # -- workers
    async def worker_term(self, fault: schedule.Fault) -> bool:
        """SIGTERM a running worker and time its stop (the pool replaces it).

        The target slot's, or the next running one's: armed workers die often, and a
        worker still starting or already stopping has no stop to time. When none is
        running (every slot restarting at once), wait for one rather than skip: a
        run whose scheduled SIGTERMs all fall into such a moment would time no stop.
        """
        slots = len(self.pool.slots)
        give_up = time.monotonic() + TERM_WAIT_S
        while True:
            running = (self.pool.started((fault.target + k) % slots) for k in range(slots))
            inc = next((inc for inc in running if inc is not None), None)
            if inc is not None:
                break
            if time.monotonic() >= give_up:
                return False
            await asyncio.sleep(0.25)
        self.pool.send_term(inc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(inc.proc.wait, self.pool.stop_limit_s + 5.0)
        code = inc.proc.poll()
        self.pool.record_stop(inc, "mid-run", code)
        if code is None:
            inc.killed_by_harness = True
            # The whole group: a hung supervisor's children would outlive a kill of it alone.
            inc.send(signal.SIGKILL)
        return True

    # -- messages
    async def long_msg_id(self, fault: schedule.Fault) -> bool:
        """Publish a good message with a 5,000-character msg-id."""
        if self.target.make_good is None:
            return False
        rng = random.Random(fault.target)
        alphabet = string.ascii_letters + string.digits
        key = "L" + "".join(rng.choice(alphabet) for _ in range(LONG_MSG_ID_CHARS - 1))
        payload = self.target.make_good(key, rng)
        self.extra.append(payload)
        await self.pub.publish(payload)
        return True

    async def raw_bad_subject(self, fault: schedule.Fault) -> bool:
        """Publish, with the raw protocol, to a subject that is not UTF-8."""
        if self.target.bad_subject is None:
            return False
        key = f"u{fault.target:010d}"
        # Poison by content too: whatever a worker makes of its subject, it
        # must settle it once (one dead letter), never apply it.
        data = json.dumps({"id": key, "kind": "poison"}).encode()
        payload = Payload(key=key, data=data, poison=True)
        self.extra.append(payload)
        for _ in range(50):
            with contextlib.suppress(OSError, asyncio.TimeoutError, ConnectionError):
                if await asyncio.wait_for(self._raw_publish(key, data), 5.0):
                    return True
            await asyncio.sleep(0.5)
        return False

    async def _raw_publish(self, key: str, data: bytes) -> bool:
        """HPUB with a reply inbox; True once JetStream acknowledged storing it."""
        assert self.target.bad_subject is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", self.nats_port)
        try:
            await reader.readline()  # INFO
            user, password = self.nats_credentials
            connect = {"user": user, "pass": password, "headers": True, "verbose": False}
            headers = f"NATS/1.0\r\nNats-Msg-Id: {key}\r\n\r\n".encode()
            writer.write(
                b"CONNECT " + json.dumps(connect).encode() + b"\r\n"
                b"SUB " + _RAW_INBOX + b" 1\r\n"
                b"HPUB "
                + self.target.bad_subject
                + b" "
                + _RAW_INBOX
                + f" {len(headers)} {len(headers) + len(data)}\r\n".encode()
                + headers
                + data
                + b"\r\n"
            )
            await writer.drain()
            while True:
                line = await reader.readline()
                if not line or line.startswith(b"-ERR"):
                    return False
                if line.startswith(b"PING"):
                    writer.write(b"PONG\r\n")
                if line.startswith(b"MSG"):
                    reply = await reader.readline()
                    return b'"seq"' in reply and b'"error"' not in reply
        finally:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    async def poison_flood(self, fault: schedule.Fault) -> bool:
        """Publish always-failing messages, then good ones; time until the good are done."""
        if self.target.make_good is None or self.target.make_failing is None:
            return False
        rng = random.Random(fault.target)
        poison, good = self.flood
        failing = [self.target.make_failing(f"f{fault.target}-{i:05d}") for i in range(poison)]
        goods = [self.target.make_good(f"g{fault.target}-{i:05d}", rng) for i in range(good)]
        self.extra += failing + goods
        for payload in failing + goods:
            await self.pub.publish(payload)
        label = f"poison flood ({poison} failing, then {good} good): time to good"
        self.figures[label] = "not done by the end of the drain"
        task = asyncio.create_task(self._time_to_good(label, [p.key for p in goods]))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        return True

    async def _time_to_good(self, label: str, keys: list[str]) -> None:
        started = time.monotonic()
        while True:
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                done = await asyncio.to_thread(self._count_done, keys)
                if done == len(keys):
                    seconds = time.monotonic() - started
                    self.figures[label] = f"{seconds:.1f} s after the last good one was published"
                    return
                self.figures[label] = f"not done by the end of the drain ({done}/{len(keys)})"
            await asyncio.sleep(0.25)

    def _count_done(self, keys: list[str]) -> int:
        sql = f"SELECT count(*) FROM ({self.target.effects_sql}) AS e(key, n) WHERE key = ANY(:k)"
        url = self.pg.url_for(self.database, driver="psycopg")
        engine = sa.create_engine(url, poolclass=NullPool)
        try:
            with engine.connect() as conn:
                return int(conn.execute(sa.text(sql), {"k": keys}).scalar_one())
        finally:
            engine.dispose()

    async def heal(self) -> None:
        """End a read-only window left behind."""
        if self._read_only:
            await self._end_read_only()

    async def close(self) -> None:
        """Stop timing poison floods (after the drain)."""
        for task in list(self._watchers):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
