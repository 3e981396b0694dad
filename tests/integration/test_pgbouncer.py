"""eop behind a real PgBouncer: transaction mode, session mode, every command.

Each test starts its own PgBouncer in front of the session's PostgreSQL and
runs the real `eop db upgrade` (twice), `eop worker` (an async handler that
adds to the outbox, the relay, a sync handler that records what the relay
published), `eop status`, `eop dlq list`, `eop outbox list` and `eop audit` through it.
Every message must change the database exactly once, none may be
dead-lettered or parked, and the worker must stop on SIGTERM (no stall).
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from eop.tools import embedded
from tests.conftest import unavailable

from . import bouncer
from .bed import EFFECTS_DDL, error_lines, publish, scalar, wait_for
from .test_cli import Workers, consumer_exists, eop, eop_env

APP = "tests.integration.pooledapp:app"
MESSAGES = 150


@pytest.fixture(scope="module")
def pgbouncer_path() -> str:
    """The pgbouncer binary (`python3 run.py test` installs it with apt-get where it can)."""
    path = bouncer.binary()
    if path is None:
        unavailable("pgbouncer is not installed (apt-get install pgbouncer)")
    return path


@pytest.fixture(scope="module")
def prepared_pgbouncer_path() -> str:
    """A PgBouncer 1.21+ for ``max_prepared_statements`` (`python3 run.py test` builds
    one from Debian's source package when the installed one is older)."""
    path = bouncer.prepared_binary()
    if path is None:
        unavailable(
            "no PgBouncer 1.21+ for max_prepared_statements: set EOP_TEST_PGBOUNCER_PREPARED "
            "(python3 run.py test builds one as root on Debian, see docs/pgbouncer.md)"
        )
    return path


@pytest.fixture
def database(empty_database_url: str) -> str:
    """The name of a fresh database without eop's tables."""
    name = sa.make_url(empty_database_url).database
    assert name is not None
    return name


@pytest.fixture
async def direct(empty_database_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine straight to PostgreSQL, for the test's own reads."""
    engine = create_async_engine(empty_database_url)
    yield engine
    await engine.dispose()


@dataclasses.dataclass
class Run:
    """What one pipeline run through PgBouncer left behind."""

    log: str
    peak_clients: int
    upgrades: list[subprocess.CompletedProcess[str]]


class _Sampler:
    """Polls PgBouncer's client count for a database in a thread; keeps the peak."""

    def __init__(self, pgb: bouncer.PgBouncer, database: str) -> None:
        self.pgb, self.database, self.peak = pgb, database, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.pgb.clients(self.database))

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)


async def _pipeline(
    pgb: bouncer.PgBouncer,
    database: str,
    direct: AsyncEngine,
    js: Any,
    nats_url: str,
    tmp_path: Path,
    **extra: str,
) -> Run:
    """Migrate, run a worker and the ops commands through ``pgb``; check every count."""
    env = eop_env(pgb.url_for(database), nats_url)
    env.update(EOP_CONCURRENCY="8", EOP_OUTBOX_POLL_S="0.2", **extra)
    upgrades = [eop("db", "upgrade", env=env), eop("db", "upgrade", env=env)]
    for done in upgrades:
        assert done.returncode == 0, done.stderr
        assert "eop tables at" in done.stdout
    async with direct.begin() as conn:
        await conn.execute(sa.text(EFFECTS_DDL))
    workers = Workers(env, tmp_path, APP)
    proc = workers.start()
    try:
        for durable in ("eop-created", "eop-shipped"):
            await wait_for(
                lambda d=durable: consumer_exists(js, d),  # type: ignore[misc]
                timeout_s=60,
                what=f"the worker's consumer {durable}; its log:\n{workers.logs()[-3000:]}",
            )
        with _Sampler(pgb, database) as sampler:
            for i in range(MESSAGES):
                await publish(js, f"m{i}", msg_id=f"id-{i}")
            await wait_for(
                lambda: _effects_reach(direct, 2 * MESSAGES),
                timeout_s=180,
                what=f"both effects of every message; worker log:\n{workers.logs()[-3000:]}",
            )
        for command in (("status", APP), ("dlq", "list"), ("outbox", "list"), ("audit", APP)):
            done = eop(*command, env=env)
            assert done.returncode == 0, (command, done.stderr)
            assert "Traceback" not in done.stderr
        assert workers.stop_all() == [0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = workers.logs()
    counts = await _counts(direct)
    assert counts == {"created": [1] * MESSAGES, "shipped": [1] * MESSAGES}
    assert await scalar(direct, "SELECT count(*) FROM eop.dead_letters") == 0
    assert await scalar(direct, "SELECT count(*) FROM eop.retries") == 0
    assert await scalar(direct, "SELECT count(*) FROM eop.outbox WHERE published_at IS NULL") == 0
    assert "Traceback" not in log
    assert "prepared statement" not in log
    return Run(log, sampler.peak, upgrades)


async def _effects_reach(engine: AsyncEngine, expected: int) -> bool:
    return int(await scalar(engine, "SELECT count(*) FROM effects")) >= expected


async def _counts(engine: AsyncEngine) -> dict[str, list[int]]:
    """Per handler, the effect count of each message body, in body order."""
    query = "SELECT handler, body, count(*) FROM effects GROUP BY handler, body ORDER BY 1, 2"
    async with engine.connect() as conn:
        rows = (await conn.execute(sa.text(query))).all()
    counts: dict[str, list[int]] = {}
    for handler, _body, n in rows:
        counts.setdefault(handler, []).append(int(n))
    return counts


async def test_transaction_mode_is_detected_and_every_command_processes_each_message_once(
    pgbouncer_path: str,
    postgres: embedded.PostgresCluster,
    database: str,
    direct: AsyncEngine,
    js: Any,
    nats_url: str,
    tmp_path: Path,
) -> None:
    """PgBouncer in transaction mode without prepared-statement support, db_pooler=auto:
    eop finds the pooler, turns statement caching off on every engine (the worker's, its
    sync handlers' too, the relay's, migrations', ops commands') and polls instead of
    LISTEN; each message once."""
    with bouncer.unprepared_transaction_mode(pgbouncer_path, postgres) as pgb:
        run = await _pipeline(pgb, database, direct, js, nats_url, tmp_path)
    # The worker's engine found it (its sync handlers run on it).
    assert run.log.count('"event": "db.pooler_found"') >= 1
    assert '"event": "relay.polling"' in run.log


@pytest.mark.parametrize(
    ("processes", "pool_size", "bound"),
    [
        # One process, EOP_DB_POOL_SIZE=4: 2 async and 2 sync connections.
        ("1", "4", 4),
        # Two processes, automatic: each max(4, min(concurrency 8, 16) // 2) = 4.
        ("2", "", 8),
    ],
)
async def test_session_mode_keeps_a_worker_within_its_connection_bound(
    pgbouncer_path: str,
    postgres: embedded.PostgresCluster,
    database: str,
    direct: AsyncEngine,
    js: Any,
    nats_url: str,
    tmp_path: Path,
    processes: str,
    pool_size: str,
    bound: int,
) -> None:
    """PgBouncer in session mode, db_pooler=session: an `eop worker` with async and sync
    handlers and the relay never holds more client connections than processes
    times db_connections, so a pool of that size (plus 2 for the commands) serves it without a
    stall."""
    extra = {"EOP_DB_POOL_SIZE": pool_size} if pool_size else {}
    with bouncer.PgBouncer(pgbouncer_path, postgres, "session", pool_size=bound + 2) as pgb:
        run = await _pipeline(
            pgb,
            database,
            direct,
            js,
            nats_url,
            tmp_path,
            EOP_DB_POOLER="session",
            EOP_PROCESSES=processes,
            **extra,
        )
    assert 0 < run.peak_clients <= bound
    # A session pooler keeps a client's server connection: LISTEN works, nothing was probed.
    assert '"event": "db.pooler_found"' not in run.log
    assert '"event": "relay.polling"' not in run.log


async def test_transaction_mode_with_max_prepared_statements_keeps_statement_caching(
    prepared_pgbouncer_path: str,
    postgres: embedded.PostgresCluster,
    database: str,
    direct: AsyncEngine,
    js: Any,
    nats_url: str,
    tmp_path: Path,
) -> None:
    """PgBouncer 1.21+ with max_prepared_statements tracks protocol-level prepared
    statements itself: db_pooler=transaction_prepared keeps the statement caches on
    (nothing probed, no prepared-statement error), and the relay polls; each message
    once."""
    with bouncer.PgBouncer(
        prepared_pgbouncer_path,
        postgres,
        "transaction",
        pool_size=3,
        settings={"max_prepared_statements": "200"},
    ) as pgb:
        run = await _pipeline(
            pgb, database, direct, js, nats_url, tmp_path, EOP_DB_POOLER="transaction_prepared"
        )
        # The caches were on: named statements reached PgBouncer, which prepared them on
        # its server connections (with caching off, asyncpg's are unnamed: none kept).
        assert pgb.server_prepared_statements(database) > 0
    assert '"event": "db.pooler_found"' not in run.log
    assert '"event": "relay.polling"' in run.log


def test_a_pooler_set_as_none_in_front_of_transaction_mode_is_one_clear_error(
    pgbouncer_path: str, postgres: embedded.PostgresCluster, database: str, nats_url: str
) -> None:
    """db_pooler=none through a transaction-mode PgBouncer: prepared statements collide,
    and `eop db upgrade` says so in one `eop: error:` line naming EOP_DB_POOLER, never a
    traceback (the reported "succeeds once, fails the next time")."""
    with bouncer.PgBouncer(
        pgbouncer_path,
        postgres,
        "transaction",
        pool_size=1,
        settings=bouncer.no_prepared_statements(pgbouncer_path),
    ) as pgb:
        env = eop_env(pgb.url_for(database), nats_url, EOP_DB_POOLER="none")
        runs = [eop("db", "upgrade", env=env) for _ in range(3)]
    failed = [run for run in runs if run.returncode != 0]
    assert failed, [run.stdout for run in runs]
    for run in failed:
        (line,) = error_lines(run.stderr)
        assert "EOP_DB_POOLER=transaction" in line, run.stderr
        assert "Traceback" not in run.stderr


async def _owners(engine: AsyncEngine) -> dict[int, tuple[str | None, int | None, int]]:
    """The ledger's partitions: partition -> (owner, owner's pid, epoch); a lease that ran
    out counts as no owner."""
    query = (
        "SELECT partition, CASE WHEN expires_at >= now() THEN owner END,"
        " CASE WHEN expires_at >= now() THEN owner_pid END, epoch"
        " FROM eop.partitions WHERE subscription = 'ledger'"
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(sa.text(query))).all()
    return {int(p): (owner, pid, int(epoch)) for p, owner, pid, epoch in rows}


async def _owned_by(engine: AsyncEngine, pids: set[int], partitions: int) -> bool:
    """Every partition has a live owner, and the owners are exactly the processes ``pids``."""
    found = await _owners(engine)
    owners = {pid for _owner, pid, _epoch in found.values()}
    return len(found) == partitions and owners == pids


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
async def test_an_ordered_handler_keeps_each_key_in_order_through_transaction_mode(
    pgbouncer_path: str,
    postgres: embedded.PostgresCluster,
    database_url: str,
    engine: AsyncEngine,
    js: Any,
    nats_url: str,
    tmp_path: Path,
    stop: str,
) -> None:
    """Two `eop worker` processes on an ordered handler with 2 partitions, both through
    PgBouncer in transaction mode (db_pooler=transaction, 3 server connections shared by
    every client): the stream eop creates has the partition transform, each worker owns one
    partition, and one of them stopped (SIGTERM, or SIGKILL) mid-burst hands its partition
    to the other (at once, or when its lease runs out): every step of every account applied
    once and in order, and the ownership ticks never failed through the pooler (their
    transactions share server connections with the handlers')."""
    import signal

    from .test_ordered_fleet import create_ledger, ledger_counts, publish_burst

    accounts, steps, partitions = 8, 50, 2
    await create_ledger(engine, accounts)
    name = sa.make_url(database_url).database
    assert name is not None
    with bouncer.unprepared_transaction_mode(pgbouncer_path, postgres) as pgb:
        env = eop_env(
            pgb.url_for(name),
            nats_url,
            EOP_DB_POOLER="transaction",
            EOP_PARTITION_LEASE_S="3",
            EOP_CONCURRENCY="32",
            LEDGER_PARTITIONS=str(partitions),
        )
        pool = Workers(env, tmp_path, app="tests.integration.ledgerapp:app")
        first, second = pool.start(), pool.start()
        try:
            await wait_for(
                lambda: _owned_by(engine, {first.pid, second.pid}, partitions),
                timeout_s=60,
                what=f"a partition owned by each worker; their log:\n{pool.logs()[-3000:]}",
            )
            config = (await js.stream_info("LEDGER")).config
            assert config.subject_transform is not None
            assert config.subject_transform.dest == (
                "{{partition(2,1)}}.ledger.{{wildcard(1)}}.step"
            )
            epochs = {p: epoch for p, (_o, _pid, epoch) in (await _owners(engine)).items()}
            with _Sampler(pgb, name) as sampler:
                await publish_burst(nats_url, accounts, steps)
                await wait_for(
                    lambda: _applied_steps(engine, accounts * steps // 4),
                    timeout_s=60,
                    what="a quarter of the steps",
                )
                second.send_signal(getattr(signal, stop))
                at_stop = int(await scalar(engine, "SELECT count(*) FROM applied"))
                await asyncio.to_thread(second.wait, 60)
                await wait_for(
                    lambda: _owned_by(engine, {first.pid}, partitions),
                    timeout_s=60,
                    what="the survivor owning both partitions",
                )
                await wait_for(
                    lambda: _applied_steps(engine, accounts * steps),
                    timeout_s=120,
                    what=f"every step; the workers' log:\n{pool.logs()[-3000:]}",
                )
            after = {p: epoch for p, (_o, _pid, epoch) in (await _owners(engine)).items()}
            assert pool.stop_all() == [0, 0 if stop == "SIGTERM" else -signal.SIGKILL]
        finally:
            for proc in pool.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    log = pool.logs()
    print(f"\n[ordered through PgBouncer, {stop}] steps applied at the stop: {at_stop}")
    assert at_stop < accounts * steps  # mid-burst
    assert await ledger_counts(engine) == (accounts * steps, 0, 0)
    # The stopped worker's partition changed hands: a new epoch; the survivor's did not.
    assert sum(after[p] > epochs[p] for p in epochs) == 1, (epochs, after)
    # More clients than server connections: transactions of both workers (the ticks
    # included) took turns on the same few server connections.
    assert sampler.peak > 3
    assert '"event": "partition.failed"' not in log
    assert '"event": "partition.lost"' not in log
    assert "prepared statement" not in log
    assert "Traceback" not in log


async def _applied_steps(engine: AsyncEngine, count: int) -> bool:
    return int(await scalar(engine, "SELECT count(*) FROM applied")) >= count
