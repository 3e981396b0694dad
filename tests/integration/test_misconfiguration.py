"""A database error that only a change of configuration can end stops the worker loudly.

A pooler that ``db_pooler`` does not know about (``none`` or ``session`` in
front of PgBouncer in transaction mode), or a table no migration created,
fails every transaction the same way. The worker must not cycle through
``transaction.retry`` for ever without a word: it stops, within a bound, with
one ``eop: error:`` line naming the fix and an error-level ``db.misconfigured``
log line, and every message waits for redelivery: none dead-lettered, none
lost, each processed exactly once by the worker started after the fix. The
reverse (``transaction`` where nothing needed it) only costs performance: it
processes every message, with a warning where eop can tell.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from eop.tools import embedded

from . import bouncer
from .bed import EFFECTS_DDL, STREAM, SUBJECT, error_lines, publish, scalar, wait_for
from .misconfiguredapp import SHIPPED
from .test_cli import Workers, eop_env
from .test_pgbouncer import pgbouncer_path  # noqa: F401 (a fixture)

APP = "tests.integration.misconfiguredapp:app"
MESSAGES = 120
SUBJECTS = {"created": SUBJECT, "shipped": SHIPPED}
#: From the worker's start to its exit: a stall guard, not a timing.
STOP_BOUND_S = 45.0
_BUSY = {"EOP_BATCH": "1", "EOP_CONCURRENCY": "16", "EOP_RELAY": "false"}


def _database(database_url: str) -> str:
    name = sa.make_url(database_url).database
    assert name is not None
    return name


async def _publish_all(js: Any, handler: str) -> None:
    """Create the stream (as the worker would) and publish every message before it starts."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    for i in range(MESSAGES):
        await publish(js, f"m{i}", msg_id=f"id-{i}", subject=SUBJECTS[handler])


async def _stops_loudly(env: dict[str, str], handler: str, tmp_path: Path) -> str:
    """Run a worker of ``handler`` until it stops by itself; its log (stderr included)."""
    workers = Workers(env, tmp_path / "misconfigured", APP)
    (tmp_path / "misconfigured").mkdir()
    started = time.monotonic()
    proc = workers.start("--handler", handler)
    try:
        code = await asyncio.to_thread(proc.wait, STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        tail = workers.logs()[-3000:]
        pytest.fail(f"the worker still ran after {STOP_BOUND_S:.0f} s; its log:\n{tail}")
    log = workers.logs()
    errors = error_lines(log)
    print(f"\n[{handler}] exited {code} after {time.monotonic() - started:.1f} s: {errors}")
    assert code == 1, log[-3000:]
    assert len(errors) == 1, log[-3000:]
    assert "Traceback" not in log
    return log


async def _then_each_message_once(
    env: dict[str, str], handler: str, engine: AsyncEngine, tmp_path: Path, messages: int = MESSAGES
) -> None:
    """Nothing dead-lettered or parked; a worker started after the fix processes each
    message exactly once, and stops on SIGTERM."""
    assert await scalar(engine, "SELECT count(*) FROM eop.dead_letters") == 0
    (tmp_path / "fixed").mkdir()
    workers = Workers(env, tmp_path / "fixed", APP)
    proc = workers.start("--handler", handler)
    try:
        await wait_for(
            lambda: _effects_reach(engine, messages),
            timeout_s=60,
            what=f"every message's effect; the worker's log:\n{workers.logs()[-3000:]}",
        )
        assert workers.stop_all() == [0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    query = "SELECT body, count(*) FROM effects GROUP BY body"
    async with engine.connect() as conn:
        counts = {body: int(n) for body, n in (await conn.execute(sa.text(query))).all()}
    assert counts == {f"m{i}": 1 for i in range(messages)}
    assert await scalar(engine, "SELECT count(*) FROM eop.dead_letters") == 0
    assert await scalar(engine, "SELECT count(*) FROM eop.retries") == 0


async def _effects_reach(engine: AsyncEngine, expected: int) -> bool:
    return int(await scalar(engine, "SELECT count(*) FROM effects")) >= expected


def _error_logged(log: str, problem: str, handler: str) -> bool:
    """An error-level ``db.misconfigured`` line for ``problem`` in ``handler``."""
    return any(
        '"event": "db.misconfigured"' in line
        and '"level": "error"' in line
        and f'"problem": "{problem}"' in line
        and f'"where": "handler \'{handler}\'"' in line
        for line in log.splitlines()
    )


BehindTransactionMode = Callable[[str, dict[str, str], dict[str, str]], Awaitable[str]]
"""Given a handler and its ``broken`` and ``fixed`` environments: the log of the worker
that stopped by itself."""


@pytest.fixture
def behind_transaction_mode(
    pgbouncer_path: str,  # noqa: F811
    postgres: embedded.PostgresCluster,
    database_url: str,
    engine: AsyncEngine,
    js: Any,
    nats_url: str,
    tmp_path: Path,
) -> BehindTransactionMode:
    """Through PgBouncer in transaction mode without prepared statements: a worker of
    ``handler`` with the ``broken`` environment stops by itself (its log, returned); one
    with the ``fixed`` environment then processes each message once."""

    async def run(handler: str, broken: dict[str, str], fixed: dict[str, str]) -> str:
        async with engine.begin() as conn:
            await conn.execute(sa.text(EFFECTS_DDL))
        await _publish_all(js, handler)
        with bouncer.unprepared_transaction_mode(pgbouncer_path, postgres) as pgb:
            url = pgb.url_for(_database(database_url))
            # One message per transaction, 16 at a time, on 3 server connections: a client
            # connection's next transaction soon lands where its statements are not. The
            # relay is off: the handler's transactions must be what stops the worker.
            env = eop_env(url, nats_url, **broken, **_BUSY)
            log = await _stops_loudly(env, handler, tmp_path)
            await _then_each_message_once(
                eop_env(url, nats_url, **fixed, **_BUSY), handler, engine, tmp_path
            )
        return log

    return run


@pytest.mark.parametrize("handler", ["created", "shipped"])
@pytest.mark.parametrize("pooler", ["none", "session"])
async def test_a_pooler_setting_that_caches_statements_behind_transaction_mode_stops_the_worker(
    behind_transaction_mode: BehindTransactionMode, pooler: str, handler: str
) -> None:
    """db_pooler=none or session through PgBouncer in transaction mode (no
    prepared-statement support, 3 server connections shared by every client): the async
    handler's (asyncpg) and the sync handler's (psycopg) prepared statements collide.
    The worker stops within the bound with one `eop: error:` line naming
    EOP_DB_POOLER=transaction and an error-level log line; no message is dead-lettered,
    and with EOP_DB_POOLER=transaction each is processed once."""
    log = await behind_transaction_mode(
        handler, {"EOP_DB_POOLER": pooler}, {"EOP_DB_POOLER": "transaction"}
    )
    (line,) = error_lines(log)
    assert "EOP_DB_POOLER=transaction" in line, line
    assert _error_logged(log, "pooler", handler), log[-3000:]
    # The handler's own transactions (asyncpg's or psycopg's statements) met it.
    assert any(
        '"event": "transaction.retry"' in line and f'"handler": "{handler}"' in line
        for line in log.splitlines()
    ), log[-3000:]


async def test_an_apps_own_engine_caching_statements_behind_transaction_mode_names_its_fix(
    behind_transaction_mode: BehindTransactionMode,
) -> None:
    """An app given its own asyncpg engine, with its statement caches, behind PgBouncer in
    transaction mode, EOP_DB_POOLER at its default: eop's own engines prepare nothing, so
    the one `eop: error:` line names the engine's connect arguments, not EOP_DB_POOLER
    (which is already right); with them, each message is processed once."""
    log = await behind_transaction_mode(
        "created", {"MISCONFIGURED_OWN_ENGINE": "plain"}, {"MISCONFIGURED_OWN_ENGINE": "uncached"}
    )
    (line,) = error_lines(log)
    assert '"statement_cache_size": 0' in line, line
    assert "set EOP_DB_POOLER" not in line, line


@pytest.mark.parametrize("handler", ["created", "shipped"])
async def test_a_missing_table_stops_the_worker_instead_of_dead_lettering(
    database_url: str,
    engine: AsyncEngine,
    js: Any,
    nats_url: str,
    tmp_path: Path,
    handler: str,
) -> None:
    """The handlers' table was never created (a migration that did not run): every
    attempt fails with 42P01. The worker stops within the bound with one `eop: error:`
    line naming the table and the fix, instead of dead-lettering every message after
    max_attempts; once the table exists, each message is processed once."""
    await _publish_all(js, handler)
    env = eop_env(database_url, nats_url, EOP_MAX_ATTEMPTS="2", **_BUSY)
    log = await _stops_loudly(env, handler, tmp_path)
    (line,) = error_lines(log)
    assert f"handler {handler!r}" in line, line
    assert 'relation "effects" does not exist' in line, line
    assert "migration" in line, line
    assert _error_logged(log, "schema", handler), log[-3000:]
    async with engine.begin() as conn:
        await conn.execute(sa.text(EFFECTS_DDL))
    await _then_each_message_once(env, handler, engine, tmp_path)


@pytest.mark.parametrize("target", ["postgresql", "session"])
async def test_transaction_where_no_transaction_pooler_is_only_slower(
    pgbouncer_path: str,  # noqa: F811
    postgres: embedded.PostgresCluster,
    database_url: str,
    engine: AsyncEngine,
    js: Any,
    nats_url: str,
    tmp_path: Path,
    target: str,
) -> None:
    """db_pooler=transaction straight to PostgreSQL, or through PgBouncer in session mode:
    nothing breaks (no prepared statement outlives a transaction anywhere), it only gives
    up statement caching and LISTEN. Both handlers process each message once and the
    worker runs on, no error; straight to PostgreSQL the worker's engine (the sync
    handler's too) warns once (db.pooler_unneeded); behind a session pooler eop cannot
    tell the mode, no warning."""
    async with engine.begin() as conn:
        await conn.execute(sa.text(EFFECTS_DDL))
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    for handler in SUBJECTS:
        for i in range(MESSAGES):
            await publish(js, f"m{i}", msg_id=f"{handler}-{i}", subject=SUBJECTS[handler])
    with contextlib.ExitStack() as stack:
        url = database_url
        if target == "session":
            pgb = stack.enter_context(bouncer.PgBouncer(pgbouncer_path, postgres, "session"))
            url = pgb.url_for(_database(database_url))
        env = eop_env(url, nats_url, EOP_DB_POOLER="transaction", EOP_DB_POOL_SIZE="4", **_BUSY)
        workers = Workers(env, tmp_path, APP)
        proc = workers.start()
        try:
            await wait_for(
                lambda: _effects_reach(engine, 2 * MESSAGES),
                timeout_s=60,
                what=f"every message's effect; the worker's log:\n{workers.logs()[-3000:]}",
            )
            assert proc.poll() is None
            assert workers.stop_all() == [0]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = workers.logs()
    query = "SELECT handler, count(*), count(DISTINCT body) FROM effects GROUP BY handler"
    async with engine.connect() as conn:
        rows = {h: (int(n), int(d)) for h, n, d in (await conn.execute(sa.text(query))).all()}
    assert rows == {h: (MESSAGES, MESSAGES) for h in SUBJECTS}
    assert await scalar(engine, "SELECT count(*) FROM eop.dead_letters") == 0
    assert '"event": "db.misconfigured"' not in log
    assert error_lines(log) == []
    warnings = log.count('"event": "db.pooler_unneeded"')
    assert warnings == (1 if target == "postgresql" else 0), log[-3000:]


async def _admin(engine: AsyncEngine, statement: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(sa.text(statement))


async def test_a_login_refused_while_the_worker_runs_stops_it_instead_of_failing_messages(
    database_url: str,
    engine: AsyncEngine,
    js: Any,
    nats_url: str,
    tmp_path: Path,
) -> None:
    """The worker's role loses its login while it runs (as after a rotated password or a
    pg_hba.conf change) and its connections are cut: every new connection is refused
    (SQLSTATE 28000). The worker stops within the bound with one `eop: error:` line
    naming the URL's credentials, and a `db.misconfigured` line (`login`); no message is
    dead-lettered, and once the role may log in again a worker processes each once."""
    role = f"eop_rotated_{int(time.time() * 1000) % 10**9}"
    await _admin(engine, f"CREATE ROLE {role} LOGIN SUPERUSER PASSWORD 'before'")
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text(EFFECTS_DDL))
        await _publish_all(js, "created")
        url = sa.make_url(database_url).set(username=role, password="before")
        env = eop_env(url.render_as_string(hide_password=False), nats_url, **_BUSY)
        (tmp_path / "refused").mkdir()
        workers = Workers(env, tmp_path / "refused", APP)
        proc = workers.start("--handler", "created")
        try:
            await wait_for(
                lambda: _effects_reach(engine, 1),
                timeout_s=60,
                what=f"a first effect; the worker's log:\n{workers.logs()[-3000:]}",
            )
            await _admin(engine, f"ALTER ROLE {role} NOLOGIN")
            await _admin(
                engine,
                f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'",
            )
            for i in range(MESSAGES, 2 * MESSAGES):
                await publish(js, f"m{i}", msg_id=f"id-{i}", subject=SUBJECT)
            try:
                code = await asyncio.to_thread(proc.wait, STOP_BOUND_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the worker still ran; its log:\n{workers.logs()[-3000:]}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log = workers.logs()
        lines = error_lines(log)
        assert code == 1, log[-3000:]
        assert len(lines) == 1, log[-3000:]
        assert "refuses new connections" in lines[0], lines[0]
        assert "EOP_DATABASE_URL" in lines[0], lines[0]
        assert "before" not in lines[0]  # the password
        assert '"problem": "login"' in log, log[-3000:]
        # The handler's transactions retried it uncounted, never failing a message.
        failed = [line for line in log.splitlines() if '"event": "message.failed"' in line]
        assert failed == [], failed[:3]
        assert "Traceback" not in log
        assert await scalar(engine, "SELECT count(*) FROM eop.dead_letters") == 0

        await _admin(engine, f"ALTER ROLE {role} LOGIN")
        await _then_each_message_once(env, "created", engine, tmp_path, 2 * MESSAGES)
    finally:
        await _admin(
            engine,
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'",
        )
        with contextlib.suppress(Exception):
            await _admin(engine, f"DROP ROLE {role}")
