"""Compaction's raise of the watermark against a real PostgreSQL: one statement that is its
own transaction, so it holds the watermark row (which every claim of the epoch reads
``FOR SHARE``) only while it runs; it still waits for the claims that read the row before
it; and it leaves nothing set on the pooled connection it used."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop
from eop import settings as settings_mod
from eop.pg import models
from eop.pg.sql import inbox as inbox_sql
from eop.protocol import compaction

from .bed import wait_for

SUB, STREAM, EPOCH = "h", "ORDERS", "e1"
WATERMARK = sa.text(
    "SELECT watermark FROM eop.watermarks"
    " WHERE subscription = 'h' AND stream = 'ORDERS' AND stream_epoch = 'e1'"
)
SYNCHRONOUS_COMMIT = sa.text("SELECT current_setting('synchronous_commit'), pg_backend_pid()")


@pytest.fixture
async def app(database_url: str, engine: AsyncEngine) -> AsyncIterator[eop.App]:
    """An app of one handler, whose pool holds one connection, and the handler's watermark
    row at 0 (as a subscription's bind leaves it)."""
    app = eop.App(settings=settings_mod.Settings(database_url=database_url, db_pool_size=1))

    @app.handler(stream=STREAM, subject="orders.>", name=SUB)
    async def noop(msg: eop.Message, session: AsyncSession) -> None:
        """A handler that does nothing (the compactor only needs its names)."""

    async with engine.begin() as conn:
        await conn.execute(
            sa.text(
                "INSERT INTO eop.watermarks (subscription, stream, stream_epoch, watermark)"
                " VALUES ('h', 'ORDERS', 'e1', 0)"
            )
        )
    yield app
    await app.dispose()


def compactor(app: eop.App, lock_wait_ms: int = 60_000) -> compaction.Compactor:
    """A compactor on ``app``'s store that knows its watermark row exists (no NATS: only
    its raise is run), its raise waiting at most ``lock_wait_ms`` for a lock."""
    made = compaction.Compactor(
        None,  # type: ignore[arg-type]
        app.make_store(),
        app.handlers[SUB],
        None,  # type: ignore[arg-type]
        settle_lock_ms=lock_wait_ms,
    )
    made._known.add(EPOCH)
    return made


async def test_the_raise_is_one_statement_that_leaves_no_transaction_open(
    app: eop.App, engine: AsyncEngine
) -> None:
    """The raise sends its UPDATE alone and the server commits it as it ends: right after
    the statement, its connection holds no transaction (so no lock on the watermark row
    that claims would wait for), and another connection reads the raised value, unlocked.
    A raise sent in a transaction of its own keeps the row until its COMMIT: a round trip
    to the worker and a flush of the WAL later."""
    sent: list[tuple[str, bool]] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        in_transaction = conn.connection.driver_connection.is_in_transaction()
        sent.append((statement.split(None, 1)[0].upper(), in_transaction))

    sa.event.listen(app.engine.sync_engine, "after_cursor_execute", seen)
    try:
        assert await compactor(app)._advance(EPOCH, 5) == 5
    finally:
        sa.event.remove(app.engine.sync_engine, "after_cursor_execute", seen)
    assert sent == [("UPDATE", False)]
    async with engine.connect() as conn:
        await conn.execute(sa.text("SET LOCAL lock_timeout = '1ms'"))
        locked = await conn.execute(sa.text(f"{WATERMARK.text} FOR UPDATE"))
        assert locked.scalar_one() == 5


async def test_the_raise_commits_unflushed_in_its_own_transaction_only(
    app: eop.App, engine: AsyncEngine
) -> None:
    """The raise's statement turns ``synchronous_commit`` off for its own transaction: seen
    inside a transaction that runs it, gone once that transaction ends; and the pooled
    connection a raise ran on is back at the server's setting afterwards, and out of
    autocommit: its next statement opens a transaction."""
    t = models.tables("eop")
    stmt, params = inbox_sql.advance_watermark(t, SUB, STREAM, EPOCH, 7, 250)
    lock_wait = sa.text("SELECT current_setting('lock_timeout')")
    async with engine.connect() as conn:
        await conn.execute(stmt, params)
        inside = (await conn.execute(SYNCHRONOUS_COMMIT)).one()[0]
        wait_inside = (await conn.execute(lock_wait)).scalar_one()
        await conn.rollback()
        after = (await conn.execute(SYNCHRONOUS_COMMIT)).one()[0]
        wait_after = (await conn.execute(lock_wait)).scalar_one()
    assert (inside, after) == ("off", "on")
    assert wait_inside == "250ms"
    assert wait_after != "250ms"

    pids: list[int] = []

    def seen(conn: Any, *args: Any) -> None:
        pids.append(conn.connection.driver_connection.get_server_pid())

    sa.event.listen(app.engine.sync_engine, "after_cursor_execute", seen)
    try:
        assert await compactor(app)._advance(EPOCH, 9) == 9
    finally:
        sa.event.remove(app.engine.sync_engine, "after_cursor_execute", seen)
    async with app.engine.connect() as conn:
        setting, pid = (await conn.execute(SYNCHRONOUS_COMMIT)).one()
        raw = await conn.get_raw_connection()
        in_transaction = raw.driver_connection.is_in_transaction()  # type: ignore[union-attr]
    assert pids == [pid]  # the one pooled connection, again
    assert setting == "on"
    assert in_transaction  # no longer in autocommit


async def test_the_raise_waits_for_a_claim_that_read_the_watermark_before_it(
    app: eop.App, engine: AsyncEngine
) -> None:
    """A claim reads the watermark row FOR SHARE and holds it to its COMMIT: a raise that
    comes meanwhile waits for that COMMIT (the claim's rows must not be deleted under
    it), then raises."""
    raising: asyncio.Task[int] | None = None
    async with engine.connect() as claim:
        assert (await claim.execute(sa.text(f"{WATERMARK.text} FOR SHARE"))).scalar_one() == 0
        raising = asyncio.create_task(compactor(app)._advance(EPOCH, 11))

        async def waits() -> bool:
            async with engine.connect() as conn:
                found = await conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock' AND query LIKE 'UPDATE%watermarks%'"
                    )
                )
                return bool(found.scalar_one())

        await wait_for(waits, what="the raise waiting for the claim's share lock")
        assert not raising.done()
        await claim.commit()
    assert await raising == 11
    async with engine.connect() as conn:
        assert (await conn.execute(WATERMARK)).scalar_one() == 11


async def test_a_raise_behind_claims_held_up_gives_way_and_its_connection_back(
    app: eop.App, engine: AsyncEngine
) -> None:
    """Claims held up on hot rows can share the watermark row for minutes: a raise waiting
    behind them held a pool connection all that time, one more each round. It waits at
    most its lock bound, raises nothing, and the next round, once the claims are done,
    raises."""
    bounded = compactor(app, lock_wait_ms=200)
    async with engine.connect() as claim:
        assert (await claim.execute(sa.text(f"{WATERMARK.text} FOR SHARE"))).scalar_one() == 0
        assert await asyncio.wait_for(bounded._advance(EPOCH, 11), 10) == 0
        async with engine.connect() as conn:
            assert (await conn.execute(WATERMARK)).scalar_one() == 0
        # The pool's one connection is free again (the app's pool holds one).
        async with app.make_store().session() as session:
            assert (await session.execute(sa.text("SELECT 1"))).scalar_one() == 1
        await claim.commit()
    assert await bounded._advance(EPOCH, 11) == 11


async def test_rounds_that_keep_giving_way_are_logged_ever_more_rarely(
    app: eop.App, engine: AsyncEngine
) -> None:
    """A storm of hot rows defers every round: ``inbox.compaction_deferred`` is logged for
    the 1st, 2nd and 4th round in a row, with the count, not every interval; a raise that
    goes through starts the count again."""
    bounded = compactor(app, lock_wait_ms=50)
    with structlog.testing.capture_logs() as logs:
        async with engine.connect() as claim:
            await claim.execute(sa.text(f"{WATERMARK.text} FOR SHARE"))
            for _ in range(5):
                assert await bounded._advance(EPOCH, 11) == 0
            await claim.commit()
        assert await bounded._advance(EPOCH, 11) == 11
        async with engine.connect() as claim:
            await claim.execute(sa.text(f"{WATERMARK.text} FOR SHARE"))
            assert await bounded._advance(EPOCH, 12) == 0
            await claim.commit()
    deferred = [e["rounds"] for e in logs if e["event"] == "inbox.compaction_deferred"]
    assert deferred == [1, 2, 4, 1]
