"""Sync handlers at default settings: hot rows, threads and connections, no stall."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import eop
from eop import settings as settings_mod
from eop.broker import jetstream

from .bed import STREAM, SUBJECT, create_effects_table, drained, publish, running, scalar, wait_for

HOT_ROWS = 10
MESSAGES = 500


async def create_balances(engine: AsyncEngine) -> None:
    """The effects table and ``HOT_ROWS`` balance rows every message updates one of."""
    await create_effects_table(engine)
    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE balances (id int PRIMARY KEY, amount int)"))
        await conn.execute(
            sa.text("INSERT INTO balances SELECT g, 0 FROM generate_series(0, :n - 1) g"),
            {"n": HOT_ROWS},
        )


def hot_row_app(database_url: str, nats_url: str, **changes: Any) -> eop.App:
    """An app at default settings (but the servers) with a sync hot-row handler."""
    settings = settings_mod.Settings(database_url=database_url, nats_url=nats_url, **changes)
    app = eop.App(settings=settings)
    app.stream(STREAM, subjects=["ORDERS.>"], storage="file")

    @app.handler(stream=STREAM, subject=SUBJECT, name="hot")
    def hot(msg: eop.Message, session: Session) -> None:
        session.execute(
            sa.text("UPDATE balances SET amount = amount + 1 WHERE id = :id"),
            {"id": int(msg.data) % HOT_ROWS},
        )
        session.execute(
            sa.text("INSERT INTO effects (handler, msg_key, body) VALUES ('hot', :k, :b)"),
            {"k": msg.idempotency_key, "b": msg.data.decode()},
        )

    return app


async def publish_steadily(js: Any, count: int, per_second: float, start: int = 0) -> None:
    """Publish ``count`` messages ``0..count-1``, one at a time, at about ``per_second``.

    One at a time, so that fetches return a message or two each: many small
    transactions in flight at once, as under a steady live load.
    """
    for i in range(count):
        await publish(js, str(i + start))
        await asyncio.sleep(1 / per_second)


async def test_sync_hot_row_handler_at_default_settings_drains_every_message_once(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """One worker, default concurrency and pools, a sync handler on 10 hot rows: no stall.

    Every message takes effect exactly once and none is dead-lettered: the
    threads that run sync transactions never wait for a connection held by a
    transaction that waits for a thread.
    """
    await create_balances(engine)
    app = hot_row_app(database_url, nats_url)
    await jetstream.ensure_stream(js, app.stream_spec(STREAM), create=True)
    await publish_steadily(js, 100, per_second=5000)
    async with running(app):
        await publish_steadily(js, MESSAGES - 100, per_second=300, start=100)
        await wait_for(lambda: drained(js, "eop-hot"), timeout_s=90, what="every message processed")
    counts = await scalar(
        engine,
        "SELECT count(*) FILTER (WHERE n <> 1) FROM (SELECT count(*) n FROM effects "
        "GROUP BY body) t",
    )
    assert counts == 0
    assert await scalar(engine, "SELECT count(DISTINCT body) FROM effects") == MESSAGES
    assert await scalar(engine, "SELECT sum(amount) FROM balances") == MESSAGES
    assert await scalar(engine, "SELECT count(*) FROM eop.dead_letters") == 0


def mixed_app(database_url: str, nats_url: str) -> eop.App:
    """Default settings but one transaction per message; an async and a sync handler."""
    settings = settings_mod.Settings(
        database_url=database_url, nats_url=nats_url, batch_transactions=False
    )
    app = eop.App(settings=settings)
    app.stream(STREAM, subjects=["ORDERS.>"], storage="file")
    insert = sa.text("INSERT INTO effects (handler, msg_key, body) VALUES (:h, :k, :b)")

    @app.handler(stream=STREAM, subject=SUBJECT, name="loop")
    async def in_loop(msg: eop.Message, session: AsyncSession) -> None:
        await asyncio.sleep(0.005)  # holds its connection a while, as real work does
        await session.execute(insert, {"h": "loop", "k": msg.idempotency_key, "b": "a"})

    @app.handler(stream=STREAM, subject="ORDERS.sync", name="thread")
    def in_thread(msg: eop.Message, session: Session) -> None:
        time.sleep(0.005)
        session.execute(insert, {"h": "thread", "k": msg.idempotency_key, "b": "s"})

    return app


async def test_a_worker_with_async_and_sync_handlers_stays_within_db_connections(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """pg_stat_activity never shows more backends on the worker's database than
    ``db_connections()``, both pools together, while 128 transactions at a time
    (one per message) of both kinds compete for them."""
    await create_effects_table(engine)
    await engine.dispose()  # the test's own connections must not count
    app = mixed_app(database_url, nats_url)
    bound = app.settings.db_connections()
    url = sa.make_url(database_url)
    monitor = create_async_engine(url.set(database="postgres"), poolclass=sa.NullPool)
    counts: list[int] = []
    stop = asyncio.Event()

    async def watch() -> None:
        async with monitor.connect() as conn:
            while not stop.is_set():
                query = sa.text("SELECT count(*) FROM pg_stat_activity WHERE datname = :db")
                counts.append(int((await conn.execute(query, {"db": url.database})).scalar_one()))
                await asyncio.sleep(0.01)

    # A backlog: the worker starts with every slot's worth of messages to take.
    await jetstream.ensure_stream(js, app.stream_spec(STREAM), create=True)
    for i in range(MESSAGES):
        await publish(js, str(i))
        await publish(js, str(i), subject="ORDERS.sync")
    async with running(app):
        watcher = asyncio.create_task(watch())
        for durable in ("eop-loop", "eop-thread"):
            await wait_for(lambda d=durable: drained(js, d), timeout_s=90, what=durable)
        stop.set()
        await watcher
    await monitor.dispose()
    assert max(counts) <= bound, f"{max(counts)} connections, bound {bound}"
    assert await scalar(engine, "SELECT count(DISTINCT msg_key) FROM effects") == 2 * MESSAGES
