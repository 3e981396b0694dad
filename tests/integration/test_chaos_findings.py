"""Minimal reproductions of anomalies the chaos harness found (eop chaos)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop

from .bed import (
    bed_settings,
    create_effects_table,
    drained,
    effects_by_body,
    publish,
    record_effect,
    scalar,
    wait_for,
)
from .bed import running as run_worker


async def test_republish_after_window_and_after_compaction_is_still_skipped(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A republish after the server's duplicate window is skipped by the msg-id guard,
    even once compaction has moved the watermark past the original message.

    Found by `eop chaos --seed 11`: 4 of 122 late republishes took effect twice.
    """
    await create_effects_table(engine)
    await js.add_stream(name="LATE", subjects=["late.*"], duplicate_window=0.5)
    settings = bed_settings(database_url, nats_url, compaction_interval_s=0.2)
    app = eop.App(settings=settings)

    @app.handler(stream="LATE", subject="late.x", name="late")
    async def effect(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, "late", msg)

    async with run_worker(app):
        await publish(js, "first", msg_id="order-1", subject="late.x")
        await publish(js, "other", msg_id="order-2", subject="late.x")
        await wait_for(lambda: drained(js, "eop-late", "LATE"), what="the first messages")

        async def compacted() -> bool:
            mark = await scalar(engine, "SELECT max(watermark) FROM eop.watermarks")
            return mark is not None and int(mark) >= 2

        await wait_for(compacted, what="the watermark to pass the first message")
        # Rows with a msg-id outlive the watermark (msg_id_retention_s).
        kept = await scalar(engine, "SELECT count(*) FROM eop.inbox WHERE msg_id = 'order-1'")
        assert kept == 1

        async def stored_again() -> bool:
            # Once the server's window (0.5 s) has forgotten the id, it stores it again.
            ack = await publish(js, "first", msg_id="order-1", subject="late.x")
            return not ack.duplicate

        await wait_for(stored_again, what="the server to forget the msg-id")
        await wait_for(lambda: drained(js, "eop-late", "LATE"), what="the republish")
    assert await effects_by_body(engine) == {"first": 1, "other": 1}
