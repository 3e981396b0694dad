"""eop.testing.TestApp on a real PostgreSQL: the real store, eop's tables, the handlers'
own tables, for every handler style."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from eop import testing
from eop.testing import Outcome

from ..testkit_apps import Base, Order, batch_app, ordered_app, orm_app, typed_app, writes_app
from .bed import scalar


@pytest.fixture
async def tables(engine: AsyncEngine) -> AsyncEngine:
    """The test database with the test apps' tables."""
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    return engine


async def invoices(engine: AsyncEngine) -> list[tuple[str, str]]:
    """(handler, order id) of the committed invoices."""
    async with engine.connect() as conn:
        rows = await conn.execute(sa.text("SELECT handler, order_id FROM invoices ORDER BY 1, 2"))
        return [(h, o) for h, o in rows]


async def test_orm_handlers_commit_their_rows_and_the_outbox_in_the_database(
    tables: AsyncEngine,
) -> None:
    """Async (AsyncSession) and sync (Session) handlers write their rows in the test
    database; the outbox row is read back as the result's message; a redelivery is a
    duplicate and writes nothing more."""
    async with testing.TestApp(orm_app(), database=tables, migrate=False) as t:
        delivered = await t.deliver("ORDERS.created", {"id": "o-1"}, msg_id="o-1")
        again = await t.redeliver(delivered)
        republished = await t.deliver("ORDERS.created", {"id": "o-1"}, msg_id="o-1")
    assert delivered.processed
    assert again.duplicate
    assert republished.duplicate
    assert await invoices(tables) == [("audit", "o-1"), ("billing", "o-1")]
    [sent] = delivered["billing"].outbox
    assert (sent.subject, sent.data) == ("INVOICES.created", b'{"order": "o-1"}')
    assert t.outbox == [sent]
    assert await scalar(tables, "SELECT count(*) FROM eop.outbox") == 1
    assert await scalar(tables, "SELECT count(*) FROM eop.inbox WHERE outcome = 'processed'") == 2


async def test_failures_are_parked_in_the_database_then_dead_lettered(tables: AsyncEngine) -> None:
    """A failing handler's message is parked in eop.retries (acked); settle() runs the
    retries the database holds until max_attempts, then the dead letter is read back."""
    async with testing.TestApp(orm_app(), database=tables, raise_errors=False) as t:
        first = await t.deliver("ORDERS.created", {"id": "o-1", "fail": True}, handler="billing")
        parked = await scalar(tables, "SELECT count(*) FROM eop.retries WHERE parked")
        later = await t.settle()
        [dead] = await t.dead_letters()
    assert first.retried
    assert parked == 1
    assert [r.outcome for r in later] == [Outcome.RETRY, Outcome.DEAD_LETTERED]
    assert [r.message.num_delivered for r in later] == [2, 3]
    assert (dead.reason, dead.subscription, dead.payload) == (
        "attempts_exhausted",
        "billing",
        b'{"id": "o-1", "fail": true}',
    )
    assert await invoices(tables) == []
    assert await scalar(tables, "SELECT count(*) FROM eop.retries") == 0


async def test_a_handler_error_on_the_database_is_raised_with_its_cause(
    tables: AsyncEngine,
) -> None:
    """An integrity error in the handler's writes is the handler's: HandlerFailed from it."""
    async with testing.TestApp(orm_app(), database=tables) as t:
        async with tables.begin() as conn:
            await conn.execute(sa.text("ALTER TABLE invoices ADD CHECK (order_id <> 'bad')"))
        with pytest.raises(testing.HandlerFailed, match=r"IntegrityError|CheckViolation"):
            await t.deliver("ORDERS.created", {"id": "bad"}, handler="audit")


async def test_writes_handlers_run_their_statements_in_the_database(tables: AsyncEngine) -> None:
    """eop.Writes handlers, async and sync: rows inserted, the outbox added through the
    writes queue committed with them."""
    async with testing.TestApp(writes_app(), database=tables) as t:
        paid = await t.deliver("ORDERS.paid", {"id": "o-1"})
        shipped = await t.deliver("ORDERS.shipped", {"id": "o-2"})
    assert paid.processed
    assert shipped.processed
    assert await invoices(tables) == [("paid", "o-1"), ("shipped", "o-2")]
    assert [m.subject for m in paid.outbox] == ["RECEIPTS.sent"]


async def test_batches_commit_together_and_a_failing_message_is_parked_alone(
    tables: AsyncEngine,
) -> None:
    """A batch handler on the database: the good messages commit, the failing one is parked,
    and a typed batch handler with eop.Writes inserts one row per payload."""
    async with testing.TestApp(batch_app(), database=tables, raise_errors=False) as t:
        bulk = await t.deliver_batch("ORDERS.bulk", [{"id": "a"}, {"id": "b", "fail": True}])
        typed = await t.deliver_batch("ORDERS.typed", [Order("c", 1), Order("d", 2)])
    assert [d.outcome for d in bulk] == [Outcome.PROCESSED, Outcome.RETRY]
    assert all(d.processed for d in typed)
    assert await invoices(tables) == [("bulk", "a"), ("typed", "c"), ("typed", "d")]


async def test_typed_and_ordered_handlers_on_the_database(tables: AsyncEngine) -> None:
    """A typed payload handler writes its row; an ordered handler's nak'ed failure is
    redelivered by retry() and processed."""
    async with testing.TestApp(typed_app(), database=tables) as t:
        typed = await t.deliver("ORDERS.typed", {"id": "o-1", "amount_cents": 3})
    async with testing.TestApp(ordered_app(), database=tables) as t:
        first = await t.deliver("ORDERS.x", {"id": "o-2"})
        [again] = await t.retry()
    assert typed.processed
    assert first.retried
    assert again.processed
    assert await invoices(tables) == [("ordered", "o-2"), ("typed_one", "o-1:1")]


async def test_migrate_creates_eops_tables_in_the_schema_asked(empty_database_url: str) -> None:
    """On a database without eop's tables, TestApp(migrate=True) creates them in the
    schema given, and the handlers run there."""
    engine = create_async_engine(empty_database_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        async with testing.TestApp(orm_app(), database=empty_database_url, schema="kit") as t:
            delivered = await t.deliver("ORDERS.created", {"id": "o-1"})
        assert delivered.processed
        assert await scalar(engine, "SELECT count(*) FROM kit.inbox") == 2
        assert await scalar(engine, "SELECT count(*) FROM kit.outbox") == 1
    finally:
        await engine.dispose()
