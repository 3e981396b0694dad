"""The examples run as the README says they do."""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from examples.quickstart import app as quickstart

from .bed import bed_settings, drained, running, scalar, wait_for


async def test_quickstart_bills_and_audits_every_order_once(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The quickstart's async and sync handlers each write one row per order."""
    app = quickstart.app.with_settings(**vars(bed_settings(database_url, nats_url)))
    async with engine.begin() as conn:
        await conn.run_sync(quickstart.Base.metadata.create_all)
    async with running(app):
        await quickstart.publish(10, nats_url)
        await quickstart.publish(10, nats_url)  # the same Msg-Ids again: dropped by the server
        await wait_for(lambda: drained(js, "eop-billing"), what="billing")
        await wait_for(lambda: drained(js, "eop-audit"), what="audit")
    assert await scalar(engine, "SELECT count(DISTINCT order_id) FROM invoices") == 10
    assert await scalar(engine, "SELECT count(*) FROM invoices") == 10
    assert await scalar(engine, "SELECT count(*) FROM audit_entries") == 10
