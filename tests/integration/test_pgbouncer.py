"""eop behind a real PgBouncer: transaction mode, session mode, every command.

Each test starts its own PgBouncer in front of the session's PostgreSQL and
runs the real `eop db upgrade` (twice), `eop worker` (an async handler that
adds to the outbox, the relay, a sync handler that records what the relay
published), `eop status`, `eop dlq list`, `eop outbox list` and `eop audit` through it.
Every message must change the database exactly once, none may be
dead-lettered or parked, and the worker must stop on SIGTERM (no stall).
"""

from __future__ import annotations

import dataclasses
import subprocess
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from eop import embedded
from tests.conftest import unavailable

from . import bouncer
from .bed import EFFECTS_DDL, publish, scalar, wait_for
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
    eop finds the pooler, turns statement caching off on every engine (worker async and
    sync, relay, migrations, ops commands) and polls instead of LISTEN; each message once."""
    with bouncer.PgBouncer(
        pgbouncer_path,
        postgres,
        "transaction",
        pool_size=3,
        settings=bouncer.no_prepared_statements(pgbouncer_path),
    ) as pgb:
        run = await _pipeline(pgb, database, direct, js, nats_url, tmp_path)
    # Both of the worker's engines found it: the async one and the sync one (psycopg).
    assert run.log.count('"event": "db.pooler_found"') >= 2
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
    traceback (the issue's "succeeds once, fails the next time")."""
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
        assert run.stderr.startswith("eop: error: "), run.stderr
        assert "EOP_DB_POOLER=transaction" in run.stderr.splitlines()[0]
        assert "Traceback" not in run.stderr
