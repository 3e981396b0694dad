"""A held message keeps its lease, whatever it waits for.

A message a worker holds may wait a long time before its turn: behind a hot
row another transaction holds, behind its batch's neighbours run one at a
time after a lock timeout, for a pooled connection or a thread. Its lease is
renewed all that time, so the server does not redeliver it, and waiting never
counts towards ``max_deliveries``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

import eop

from .bed import (
    STREAM,
    SUBJECT,
    create_effects_table,
    drained,
    effects_by_body,
    publish,
    record_effect,
    running,
    scalar,
    wait_for,
)

MESSAGES = 200
ACK_WAIT_S = 2.0
MAX_DELIVERIES = 2


def _scaled_settings(database_url: str, nats_url: str, **changes: Any) -> eop.Settings:
    """eop's defaults, with AckWait and the lock timeout scaled down together (30 s and
    5 s by default) so that a hold outlasts every delivery in seconds."""
    return eop.Settings(
        database_url=database_url,
        nats_url=nats_url,
        ack_wait_s=ACK_WAIT_S,
        lease_margin_s=0.5,
        lock_timeout_s=ACK_WAIT_S / 6,
        max_deliveries=MAX_DELIVERIES,
        **changes,
    )


async def test_a_hot_row_held_past_every_delivery_dead_letters_nothing(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """An outside transaction holds the row every message updates for longer than
    ``max_deliveries`` x AckWait, while two workers hold the messages (async ORM and
    sync Session handlers): not one is dead-lettered as a crash loop, all take
    effect once, and the server redelivers none of them."""
    await create_effects_table(engine)
    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE hot (id int PRIMARY KEY, n int NOT NULL)"))
        await conn.execute(sa.text("INSERT INTO hot VALUES (1, 0), (2, 0)"))
    settings = _scaled_settings(database_url, nats_url)
    app = eop.App(settings=settings)

    @app.handler(stream=STREAM, subject=SUBJECT, name="hot_async")
    async def on_async(msg: eop.Message, session: AsyncSession) -> None:
        await session.execute(sa.text("UPDATE hot SET n = n + 1 WHERE id = 1"))
        await record_effect(session, "hot_async", msg)

    @app.handler(stream=STREAM, subject=SUBJECT, name="hot_sync")
    def on_sync(msg: eop.Message, session: Session) -> None:
        session.execute(sa.text("UPDATE hot SET n = n + 1 WHERE id = 2"))
        session.execute(
            sa.text("INSERT INTO effects (handler, msg_key, body) VALUES (:h, :k, :b)"),
            {"h": "hot_sync", "k": msg.idempotency_key, "b": msg.data.decode()},
        )

    async with engine.connect() as holder:
        await holder.execute(sa.text("SELECT * FROM hot FOR UPDATE"))
        async with running(app), running(app):
            for i in range(MESSAGES):
                await publish(js, f"m{i}")
            await asyncio.sleep((MAX_DELIVERIES + 2) * ACK_WAIT_S)
            await holder.rollback()
            for name in ("eop-hot_async", "eop-hot_sync"):
                await wait_for(
                    lambda name=name: drained(js, name, engine=engine),
                    timeout_s=60,
                    what=f"{name} after the row is released",
                )
    dead = await scalar(engine, "SELECT count(*) FROM eop.dead_letters")
    redelivered = [
        (await js.consumer_info(STREAM, f"eop-{name}")).num_redelivered
        for name in ("hot_async", "hot_sync")
    ]
    effects = await effects_by_body(engine)
    assert dead == 0, f"{dead} good messages dead-lettered while they waited"
    assert await scalar(engine, "SELECT n FROM hot WHERE id = 1") == MESSAGES
    assert await scalar(engine, "SELECT n FROM hot WHERE id = 2") == MESSAGES
    assert effects == {f"m{i}": 2 for i in range(MESSAGES)}
    assert redelivered == [0, 0], f"redelivered while held: {redelivered}"


async def test_parked_retries_waiting_on_a_hot_row_keep_their_runs_leases(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Messages whose first attempt failed wait in the retries table; their runs then
    wait behind a hot row for longer than ``max_deliveries`` x AckWait. The run's lease
    in the retries table is renewed as a delivery's is, so no other poll takes it again
    and no run counts towards a crash loop: none is dead-lettered, all take effect once."""
    await create_effects_table(engine)
    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE hot (id int PRIMARY KEY, n int NOT NULL)"))
        await conn.execute(sa.text("INSERT INTO hot VALUES (1, 0)"))
    settings = _scaled_settings(database_url, nats_url, backoff_base_s=0.05, retry_poll_s=0.1)
    app = eop.App(settings=settings)

    @app.handler(stream=STREAM, subject=SUBJECT, name="parked_hot")
    async def on_message(msg: eop.Message, session: AsyncSession) -> None:
        if msg.num_delivered == 1:
            raise eop.Retry("first attempts fail: the message is parked")
        await session.execute(sa.text("UPDATE hot SET n = n + 1 WHERE id = 1"))
        await record_effect(session, "parked_hot", msg)

    messages = 40
    async with engine.connect() as holder:
        await holder.execute(sa.text("SELECT * FROM hot FOR UPDATE"))
        async with running(app), running(app):
            for i in range(messages):
                await publish(js, f"m{i}")
            await asyncio.sleep((MAX_DELIVERIES + 2) * ACK_WAIT_S)
            await holder.rollback()
            await wait_for(
                lambda: drained(js, "eop-parked_hot", engine=engine),
                timeout_s=60,
                what="the parked retries after the row is released",
            )
    dead = await scalar(engine, "SELECT count(*) FROM eop.dead_letters")
    assert dead == 0, f"{dead} good messages dead-lettered while their runs waited"
    assert await scalar(engine, "SELECT n FROM hot WHERE id = 1") == messages
    assert await effects_by_body(engine) == {f"m{i}": 1 for i in range(messages)}
