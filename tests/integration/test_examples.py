"""The examples run as the README says they do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from eop import embedded
from examples.quickstart import app as quickstart

from .bed import bed_settings, drained, equals, running, scalar, wait_for

EXAMPLE_TESTS = Path(quickstart.__file__).parent / "test_handlers.py"


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


async def test_outbox_example_ships_every_order_posted_to_the_endpoint_once(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The outbox example: orders posted to its FastAPI endpoint are announced through the
    outbox, reserved by one handler, which requests the shipment through the outbox, and
    shipped by the other: one reservation and one shipment per order; a repeated POST is
    a 409 and announces nothing more."""
    import httpx

    from examples.outbox import app as example
    from examples.outbox import web

    app = example.app.with_settings(**vars(bed_settings(database_url, nats_url)))
    async with engine.begin() as conn:
        await conn.run_sync(example.Base.metadata.create_all)
    api = web.make_api(app)
    async with running(app):
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://orders") as client:
            for i in range(20):
                response = await client.post("/orders", json={"id": f"o-{i}", "total_cents": i})
                assert response.status_code == 201
            again = await client.post("/orders", json={"id": "o-3", "total_cents": 3})
            assert again.status_code == 409
        await wait_for(
            lambda: equals(scalar(engine, "SELECT count(*) FROM shipments"), 20),
            what="20 shipments",
        )
        await wait_for(lambda: drained(js, "eop-reserve"), what="reserve")
        await wait_for(lambda: drained(js, "eop-ship", stream="SHIPMENTS"), what="ship")
    assert await scalar(engine, "SELECT count(DISTINCT order_id) FROM reservations") == 20
    assert await scalar(engine, "SELECT count(*) FROM reservations") == 20
    assert await scalar(engine, "SELECT count(DISTINCT order_id) FROM shipments") == 20
    assert await scalar(engine, "SELECT count(*) FROM shipments") == 20
    assert await scalar(engine, "SELECT count(*) FROM eop.outbox WHERE published_at IS NULL") == 0


def test_the_quickstart_handler_tests_pass_as_a_user_runs_them(
    pytester: pytest.Pytester, postgres: embedded.PostgresCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/quickstart/test_handlers.py, run by pytest in a fresh process outside the
    repository (eop's pytest plugin loaded from its entry point, no conftest): every test
    passes, in memory and on the plugin's database."""
    monkeypatch.setenv("EOP_TEST_DATABASE_URL", postgres.url)
    pytester.makepyfile(test_handlers=EXAMPLE_TESTS.read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=4)
