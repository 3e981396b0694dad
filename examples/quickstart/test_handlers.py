"""Tests of the quickstart's handlers, written as a user of eop writes them (docs/testing.md).

    pip install 'eop[testing]'
    pytest examples/quickstart/test_handlers.py

The first test needs nothing but eop: the inbox and the handlers' writes are
kept in memory. The others use the fixtures of eop's pytest plugin: a
throwaway PostgreSQL (from the ``embedded`` extra), a copy of a migrated
database per test, and ``eop_test_app``, the app running on it.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

import eop
from eop.testing import TestApp
from examples.quickstart.app import AuditEntry, Base, Invoice, app

# Works with pytest-asyncio in strict mode too (with asyncio_mode = auto it is not needed).
pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="session")
def eop_metadata() -> list[sa.MetaData]:
    """The app's own tables, created once in the template every test database copies."""
    return [Base.metadata]


@pytest.fixture
def eop_app() -> eop.App:
    """The app under test (or set `eop_app = examples.quickstart.app:app` in pytest.ini)."""
    return app


async def test_an_order_is_billed_and_audited_in_memory() -> None:
    """No server at all: both handlers run through eop's protocol, their writes kept."""
    async with TestApp(app) as t:
        delivered = await t.deliver("ORDERS.created", {"id": "o-1", "amount_cents": 250})
    assert delivered.processed
    [invoice] = [e for e in t.effects if isinstance(e, Invoice)]
    assert (invoice.order_id, invoice.amount_cents) == ("o-1", 250)


async def test_each_order_is_billed_once(eop_test_app: TestApp, eop_engine: AsyncEngine) -> None:
    """A redelivery (same sequence) and a republish (same Nats-Msg-Id) are both skipped."""
    order = {"id": "o-1", "amount_cents": 250}
    first = await eop_test_app.deliver("ORDERS.created", order, msg_id="o-1")
    again = await eop_test_app.redeliver(first)
    republished = await eop_test_app.deliver("ORDERS.created", order, msg_id="o-1")
    assert first.processed
    assert again.duplicate
    assert republished.duplicate
    async with eop_engine.connect() as conn:
        invoices = await conn.scalar(sa.select(sa.func.count()).select_from(Invoice))
        audits = await conn.scalar(sa.select(sa.func.count()).select_from(AuditEntry))
    assert (invoices, audits) == (1, 1)


async def test_garbage_is_dead_lettered_not_retried(eop_test_app: TestApp) -> None:
    """A payload that is not JSON is dead-lettered at once, with its reason."""
    delivered = await eop_test_app.deliver("ORDERS.created", b"not json", handler="billing")
    assert delivered.dead_lettered
    [dead] = await eop_test_app.dead_letters()
    assert (dead.reason, dead.payload) == ("undecodable", b"not json")


async def test_an_order_without_an_amount_is_retried_then_dead_lettered(
    eop_test_app: TestApp,
) -> None:
    """A handler error: the message is parked for its retries, then dead-lettered."""
    delivered = await eop_test_app.deliver(
        "ORDERS.created", {"id": "o-2"}, handler="billing", raise_errors=False
    )
    assert delivered.retried
    assert isinstance(delivered.error, KeyError)
    retries = await eop_test_app.settle(raise_errors=False)
    assert retries[-1].dead_lettered
    assert retries[-1].reason == "attempts_exhausted"
