"""eop's local timeouts hold in every transaction of the real store, whatever its first
statement: on asyncpg the claim carries them (no ``SET LOCAL`` of its own), and any
other first statement, or a handler given the session, sends them first.

These drive :class:`eop.pg.store.PostgresStore` as the protocols do, without NATS.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop
from eop import settings as settings_mod
from eop.pg import contract, models
from eop.pg.failures import DbFailure, classify
from eop.pg.store import PostgresStore

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
# Neither is PostgreSQL's default nor a whole number of seconds, which it would show as "2s".
LOCK, STATEMENT = "1500ms", "2500ms"
SHOW = sa.text("SELECT current_setting('lock_timeout'), current_setting('statement_timeout')")


def message(seq: int, subscription: str, epoch: str = "e1") -> eop.Message:
    return eop.Message(
        subscription=subscription,
        subject="orders.new",
        data=b"{}",
        headers={},
        stream="ORDERS",
        stream_epoch=epoch,
        seq=seq,
        num_delivered=1,
        timestamp=NOW,
    )


@pytest.fixture(params=["async", "bridged", "psycopg"])
async def app(request: pytest.FixtureRequest, database_url: str) -> AsyncIterator[eop.App]:
    """An app with one handler that reads its transaction's timeouts into ``app.seen``:
    ``async def``, or ``def`` on the async engine (the default), or ``def`` on a psycopg
    ``sync_sessionmaker``."""
    settings = settings_mod.Settings(
        database_url=database_url, lock_timeout_s=1.5, statement_timeout_s=2.5
    )
    app = eop.App(settings=settings)
    if request.param == "psycopg":
        app = eop.App(settings=settings, sync_sessionmaker=app.sync_sessionmaker)
    seen: list[tuple[str, str]] = []
    app.seen = seen  # type: ignore[attr-defined]  # the test's own note on the app

    if request.param == "async":

        @app.handler(stream="ORDERS", subject="orders.>", name="h")
        async def read_async(msg: eop.Message, session: AsyncSession) -> None:
            seen.append(tuple((await session.execute(SHOW)).one()))  # type: ignore[arg-type]

    else:

        @app.handler(stream="ORDERS", subject="orders.>", name="h")
        def read_sync(msg: eop.Message, session: orm.Session) -> None:
            seen.append(tuple(session.execute(SHOW).one()))  # type: ignore[arg-type]

    yield app
    await app.dispose()


@pytest.fixture
async def store(app: eop.App) -> AsyncIterator[PostgresStore]:
    store = app.make_store()
    yield store
    store.close()


async def _claim_with_its_lane(tx: contract.Transaction) -> None:
    await tx.claim_many([message(1, "h")], models.OUTCOME_PROCESSED)


async def _claim_making_its_lane(tx: contract.Transaction) -> None:
    await tx.claim_many([message(1, "h", epoch="new")], models.OUTCOME_PROCESSED)


async def _look_up(tx: contract.Transaction) -> None:
    await tx.find(message(1, "h"))


async def _lock_a_parked_run(tx: contract.Transaction) -> None:
    await tx.lock_run(message(1, "h"), 1)


async def _nothing(tx: contract.Transaction) -> None:
    pass


async def _take_turn(tx: contract.Transaction) -> None:
    await tx.take_turn()


FIRST: dict[str, Callable[[contract.Transaction], Awaitable[None]]] = {
    "the claim": _claim_with_its_lane,
    "a claim whose epoch has no lane yet": _claim_making_its_lane,
    "a look-up": _look_up,
    "the fleet's turn (after a deadlock)": _take_turn,
    "the handler": _nothing,
}


@pytest.mark.parametrize("first", FIRST)
async def test_a_transaction_runs_under_eops_timeouts_whatever_its_first_statement(
    app: Any, store: PostgresStore, engine: AsyncEngine, first: str
) -> None:
    """After the claim (with its lane or making it), a look-up or nothing at all, the
    handler's own statements run under eop's lock_timeout and statement_timeout: the claim
    set them itself, or they were sent before the other statement (or the handler)."""
    async with engine.begin() as conn:
        await conn.execute(
            sa.text(
                "INSERT INTO eop.watermarks (subscription, stream, stream_epoch, watermark)"
                " VALUES ('h', 'ORDERS', 'e1', 0)"
            )
        )
    async with store.transaction(app.handlers["h"]) as tx:
        await FIRST[first](tx)
        await tx.run(message(2, "h"))
        await tx.rollback()
    assert app.seen == [(LOCK, STATEMENT)]


async def test_a_first_claim_waits_on_a_locked_watermark_no_longer_than_the_lock_timeout(
    app: Any, store: PostgresStore, engine: AsyncEngine
) -> None:
    """The claim reads its lane's watermark FOR SHARE; while another transaction holds it
    (as compaction's raise does), the claim gives up at eop's lock_timeout, although it
    is the statement that sets it: a lock timeout, which the batch takes as contention."""
    async with engine.begin() as conn:
        await conn.execute(
            sa.text(
                "INSERT INTO eop.watermarks (subscription, stream, stream_epoch, watermark)"
                " VALUES ('h', 'ORDERS', 'e1', 0)"
            )
        )
    await _gives_up_at_the_lock_timeout(
        store,
        app.handlers["h"],
        engine,
        "SELECT * FROM eop.watermarks FOR UPDATE",
        _claim_with_its_lane,
    )


async def test_a_statement_before_the_claim_waits_no_longer_than_the_lock_timeout(
    app: Any, store: PostgresStore, engine: AsyncEngine
) -> None:
    """A parked retry's run locks its retries row before anything else in its transaction
    (no claim yet to carry the timeouts): while another transaction holds that row, it
    gives up at eop's lock_timeout, so the timeouts were sent before it."""
    async with engine.begin() as conn:
        await conn.execute(
            sa.text(
                "INSERT INTO eop.retries (subscription, stream, stream_epoch, stream_seq,"
                " failures, runs, parked, due_at, last_error, subject, headers, payload)"
                " VALUES ('h', 'ORDERS', 'e1', 1, 1, 1, true, now(), 'boom', 'orders.new',"
                " '', '')"
            )
        )
    await _gives_up_at_the_lock_timeout(
        store,
        app.handlers["h"],
        engine,
        "SELECT * FROM eop.retries FOR UPDATE",
        _lock_a_parked_run,
    )


async def test_a_contended_transaction_waits_for_its_turn_no_longer_than_the_lock_timeout(
    app: Any, store: PostgresStore
) -> None:
    """The fleet's turn is one contended transaction at a time, every handler's: while a
    transaction holds it, another (here in another app's store: another process), of the
    same handler or of another, waits for it, at most eop's lock_timeout (a lock timeout,
    which contention retries); once the holder ends, the turn is free."""
    spec = app.handlers["h"]
    other = dataclasses.replace(spec, name="other")
    elsewhere = eop.App(settings=app.settings)
    peer = elsewhere.make_store()
    try:
        async with store.transaction(spec) as holder:
            await holder.take_turn()
            for waiting in (spec, other):
                with pytest.raises(Exception) as raised:  # noqa: PT011  # the driver's error, classified below
                    async with peer.transaction(waiting) as tx:
                        await asyncio.wait_for(tx.take_turn(), 30.0)
                assert classify(raised.value) is DbFailure.LOCK_TIMEOUT, repr(raised.value)
            await holder.rollback()
        async with peer.transaction(other) as tx:
            await asyncio.wait_for(tx.take_turn(), 30.0)
    finally:
        peer.close()
        await elsewhere.dispose()


async def _gives_up_at_the_lock_timeout(
    store: PostgresStore,
    spec: Any,
    engine: AsyncEngine,
    hold: str,
    first: Callable[[contract.Transaction], Awaitable[None]],
) -> None:
    """While another transaction holds the rows ``hold`` locks, ``first`` (a transaction's
    first statement) fails with a lock timeout instead of waiting for it."""
    async with engine.connect() as holder:
        await holder.execute(sa.text("SET lock_timeout = 0"))
        await holder.execute(sa.text(hold))
        with pytest.raises(Exception) as raised:  # noqa: PT011  # the driver's error, classified below
            async with store.transaction(spec) as tx:
                # Bounded by the test, not the setting: a statement that ignored it would
                # wait for the holder, which never lets go.
                await asyncio.wait_for(first(tx), 30.0)
        await holder.rollback()
    assert classify(raised.value) is DbFailure.LOCK_TIMEOUT, repr(raised.value)
