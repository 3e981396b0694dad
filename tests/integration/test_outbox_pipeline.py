"""The relay marks a round's rows while the next round reads and publishes.

A round whose rows were all acknowledged leaves their mark (an UPDATE and its
COMMIT) running while the next round reads and publishes; the next read skips
exactly the rows being marked, so what it reads, and in which order, is what it
would read once the mark committed. Against real JetStream and PostgreSQL.
"""

from __future__ import annotations

import asyncio
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

import eop
from eop.outbox import sql
from eop.pg import models

from .bed import equals, wait_for
from .test_outbox import (
    OUT_SUBJECT,
    ensure_streams,
    make_app,
    out_count,
    out_messages,
    outbox_rows,
    relaying,
)


async def _add(app: eop.App, n: int, prefix: str = "m") -> list[int]:
    """``n`` outbox rows, one transaction each (so each its own commit); their ids."""
    for i in range(n):
        async with app.sessionmaker() as session, session.begin():
            eop.outbox.add(session, OUT_SUBJECT, f"{prefix}{i:04d}")
    async with app.engine.connect() as conn:
        rows = await conn.execute(sa.text("SELECT id FROM eop.outbox ORDER BY id"))
        return [int(r[0]) for r in rows]


async def _pending_ids(engine: AsyncEngine, limit: int, marking: list[int]) -> list[int]:
    stmt = sql.pending(models.tables("eop"), limit, (), marking)
    async with engine.connect() as conn:
        return [int(r[0]) for r in await conn.execute(stmt)]


async def test_a_read_beside_a_mark_skips_exactly_the_rows_being_marked(
    database_url: str, nats_url: str, engine: AsyncEngine
) -> None:
    """The read beside a mark returns what it would return once the mark committed: the
    rows around the marked ones and those between them (committed after the round that
    sent them read), in id order, up to the limit."""
    app = make_app(database_url, nats_url)
    ids = await _add(app, 10)
    marking = [ids[2], ids[3], ids[5]]  # ids[4] lies between them, not being marked
    assert await _pending_ids(engine, 100, marking) == [i for i in ids if i not in marking]
    assert await _pending_ids(engine, 4, marking) == [ids[0], ids[1], ids[4], ids[6]]
    async with engine.begin() as conn:
        await conn.execute(sql.mark_published(models.tables("eop"), marking, ["S"] * 3, [1, 2, 3]))
    assert await _pending_ids(engine, 4, []) == [ids[0], ids[1], ids[4], ids[6]]
    assert await _pending_ids(engine, 100, marking) == await _pending_ids(engine, 100, [])
    await app.dispose()


async def test_a_round_publishes_while_the_previous_rounds_mark_waits(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """With the first round's mark held up (a row it marks locked elsewhere), the second
    round still reads and publishes its rows, and no third starts (one mark in flight);
    once the lock goes, every row is marked, each sent once, in id order."""
    app = make_app(database_url, nats_url, outbox_batch=100)
    await ensure_streams(js)
    ids = await _add(app, 300)
    blocker = await engine.connect()
    transaction = await blocker.begin()
    await blocker.execute(
        sa.text("SELECT id FROM eop.outbox WHERE id = :id FOR UPDATE"), {"id": ids[50]}
    )
    try:
        async with relaying(app, nats_url) as relay:
            await wait_for(lambda: equals(out_count(js), 200), what="the second round's sends")
            await asyncio.sleep(1.0)
            assert await out_count(js) == 200, "a third round ran beside an unfinished mark"
            assert relay.published == 0
            await transaction.rollback()
            await wait_for(lambda: equals(outbox_rows(engine, "published_at IS NULL"), 0))
            assert await outbox_rows(engine, "stream_seq IS NULL") == 0
    finally:
        if transaction.is_active:
            await transaction.rollback()
        await blocker.close()
    stored = [data.decode() for _, _, data in await out_messages(js)]
    assert stored == [f"m{i:04d}" for i in range(300)]
    assert relay.published == 300
    await app.dispose()
