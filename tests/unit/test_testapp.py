"""eop.testing.TestApp on the in-memory fakes: every handler style, every outcome."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

import eop
from eop import testing
from eop.testing import Outcome

from ..testkit_apps import (
    Invoice,
    Line,
    Order,
    batch_app,
    ordered_app,
    orm_app,
    pydantic_app,
    typed_app,
    writes_app,
)


def invoices(t: testing.TestApp) -> list[tuple[str, str]]:
    """(handler, order id) of the invoices the committed transactions added."""
    return [(e.handler, e.order_id) for e in t.effects if isinstance(e, Invoice)]


async def test_async_and_sync_session_handlers_both_process_one_delivery() -> None:
    """One message on a subject two handlers take: each processes it, each write commits,
    and the async handler's outbox message is captured on its result."""
    async with testing.TestApp(orm_app()) as t:
        delivered = await t.deliver("ORDERS.created", {"id": "o-1"})
    assert delivered.outcomes == {"billing": Outcome.PROCESSED, "audit": Outcome.PROCESSED}
    assert delivered.processed
    assert sorted(invoices(t)) == [("audit", "o-1"), ("billing", "o-1")]
    [sent] = delivered["billing"].outbox
    assert (sent.subject, sent.data) == ("INVOICES.created", b'{"order": "o-1"}')
    assert t.outbox == [sent]
    assert delivered["audit"].outbox == ()


async def test_redelivery_of_the_same_message_is_skipped_as_a_duplicate() -> None:
    """The same stream sequence delivered again (a lost ack) is acked without running."""
    async with testing.TestApp(orm_app()) as t:
        first = await t.deliver("ORDERS.created", {"id": "o-1"}, handler="billing")
        again = await t.redeliver(first)
    assert first.processed
    assert again.duplicate
    assert again.message.seq == first.message.seq
    assert again.message.num_delivered == 2
    assert invoices(t) == [("billing", "o-1")]
    assert len(t.outbox) == 1


async def test_a_republished_msg_id_is_skipped_as_a_duplicate() -> None:
    """The same Nats-Msg-Id under a new sequence (after the server's window) is skipped."""
    async with testing.TestApp(orm_app()) as t:
        first = await t.deliver("ORDERS.created", {"id": "o-1"}, msg_id="o-1", handler="billing")
        again = await t.deliver("ORDERS.created", {"id": "o-1"}, msg_id="o-1", handler="billing")
    assert first.processed
    assert again.duplicate
    assert again.message.seq == first.message.seq + 1
    assert again.message.msg_id == "o-1"
    assert invoices(t) == [("billing", "o-1")]


async def test_a_handler_error_is_raised_after_the_message_was_parked() -> None:
    """An unexpected handler error fails the test at its cause: HandlerFailed from it,
    the message parked for its retry, nothing committed."""
    async with testing.TestApp(orm_app()) as t:
        with pytest.raises(testing.HandlerFailed, match="payment service is down") as info:
            await t.deliver("ORDERS.created", {"id": "o-1", "fail": True}, handler="billing")
        assert isinstance(info.value.__cause__, RuntimeError)
        assert [r.outcome for r in t.results] == [Outcome.RETRY]
        assert invoices(t) == []
        assert t.outbox == []


async def test_retries_run_until_attempts_are_exhausted_then_dead_letter() -> None:
    """With raise_errors=False a failing message is retried (settle) up to max_attempts,
    then dead-lettered with its reason and error."""
    async with testing.TestApp(orm_app(), raise_errors=False) as t:
        first = await t.deliver("ORDERS.created", {"id": "o-1", "fail": True}, handler="billing")
        later = await t.settle()
        [dead] = await t.dead_letters()
    assert first.retried
    assert isinstance(first.error, RuntimeError)
    assert [r.outcome for r in later] == [Outcome.RETRY, Outcome.DEAD_LETTERED]
    assert later[-1].reason == "attempts_exhausted"
    assert (dead.reason, dead.stream_seq, dead.subscription) == ("attempts_exhausted", 1, "billing")
    assert "payment service is down" in dead.error
    assert invoices(t) == []


async def test_reject_dead_letters_at_once_and_is_not_raised() -> None:
    """eop.Reject is the handler's intent: dead-lettered on the first delivery, no raise."""
    async with testing.TestApp(orm_app()) as t:
        delivered = await t.deliver(
            "ORDERS.created", {"id": "o-1", "reject": True}, handler="billing"
        )
        dead = await t.dead_letters()
    assert delivered.dead_lettered
    assert delivered.reason == "rejected"
    assert isinstance(delivered.error, eop.Reject)
    assert [d.reason for d in dead] == ["rejected"]


async def test_garbage_is_dead_lettered_as_undecodable() -> None:
    """A payload that is not JSON: msg.json() raises, the message is dead-lettered at once."""
    async with testing.TestApp(orm_app()) as t:
        delivered = await t.deliver("ORDERS.created", b"\x00 not json", handler="audit")
    assert (delivered.outcome, delivered.reason) == (Outcome.DEAD_LETTERED, "undecodable")


async def test_writes_handlers_record_their_statements_and_outbox() -> None:
    """eop.Writes handlers, async and sync: their queued statements are committed
    (t.statements), and eop.outbox.add(writes, ...) is captured as an outbox message."""
    app = writes_app()
    async with testing.TestApp(app) as t:
        paid = await t.deliver("ORDERS.paid", {"id": "o-1"})
        shipped = await t.deliver("ORDERS.shipped", {"id": "o-1"})
    assert paid.processed
    assert shipped.processed
    assert [params for _, params in t.statements] == [
        {"order_id": "o-1", "handler": "paid"},
        {"order_id": "o-1", "handler": "shipped"},
    ]
    assert [m.subject for m in paid.outbox] == ["RECEIPTS.sent"]


async def test_a_writes_handler_is_refused_what_eop_writes_refuses() -> None:
    """FakeWrites checks statements as eop.Writes does: a SELECT fails the handler."""
    import sqlalchemy as sa

    app = eop.App()

    @app.handler(stream="S", subject="s", name="reads")
    async def reads(msg: eop.Message, writes: eop.Writes) -> None:
        writes.add(sa.select(sa.literal(1)))

    async with testing.TestApp(app) as t:
        with pytest.raises(testing.HandlerFailed, match="INSERT, UPDATE or DELETE"):
            await t.deliver("s", b"{}")


async def test_a_session_handler_running_sql_is_told_to_use_a_database() -> None:
    """The fake session runs no SQL: the error says to test such a handler on a database."""
    import sqlalchemy as sa

    app = eop.App()

    @app.handler(stream="S", subject="s", name="sql")
    async def sql(msg: eop.Message, session: object) -> None:
        await session.execute(sa.text("SELECT 1"))  # type: ignore[attr-defined]

    async with testing.TestApp(app) as t:
        with pytest.raises(testing.HandlerFailed, match=r"TestApp\(app, database=\.\.\.\)"):
            await t.deliver("s", b"{}")


async def test_a_batch_runs_in_one_transaction_and_a_failing_message_alone_retries() -> None:
    """deliver_batch: the batch handler gets the list; one failing message is retried
    on its own (savepoints), the others commit."""
    async with testing.TestApp(batch_app(), raise_errors=False) as t:
        delivered = await t.deliver_batch(
            "ORDERS.bulk", [{"id": "a"}, {"id": "b", "fail": True}, {"id": "c"}]
        )
    assert [d.outcome for d in delivered] == [Outcome.PROCESSED, Outcome.RETRY, Outcome.PROCESSED]
    assert isinstance(delivered[1].error, RuntimeError)
    assert sorted(invoices(t)) == [("bulk", "a"), ("bulk", "c")]


async def test_typed_payloads_are_decoded_and_bad_ones_dead_lettered() -> None:
    """A dataclass payload (given as a dataclass or a dict) reaches the handler decoded,
    with the message; a payload that does not fit is dead-lettered as undecodable."""
    async with testing.TestApp(typed_app()) as t:
        first = await t.deliver("ORDERS.typed", Order(id="o-1", amount_cents=5))
        second = await t.deliver("ORDERS.typed", {"id": "o-2", "amount_cents": 7})
        bad = await t.deliver("ORDERS.typed", {"id": "o-3"})
    assert first.processed
    assert second.processed
    assert invoices(t) == [("typed_one", "o-1:1"), ("typed_one", "o-2:2")]
    assert (bad.outcome, bad.reason) == (Outcome.DEAD_LETTERED, "undecodable")


async def test_typed_batch_writes_handler_gets_the_list_of_payloads() -> None:
    """A sync batch handler taking list[Order] and eop.Writes: one statement per order."""
    async with testing.TestApp(batch_app()) as t:
        delivered = await t.deliver_batch("ORDERS.typed", [Order("a", 1), Order("b", 2)])
    assert all(d.processed for d in delivered)
    assert [p["order_id"] for _, p in t.statements] == ["a", "b"]


async def test_an_ordered_handler_is_retried_by_redelivery() -> None:
    """order_by handlers are not parked: the failure is nak'ed and retry() redelivers it."""
    async with testing.TestApp(ordered_app()) as t:
        first = await t.deliver("ORDERS.x", {"id": "o-1"})
        [again] = await t.retry()
    assert first.retried
    assert again.processed
    assert again.message.num_delivered == 2
    assert invoices(t) == [("ordered", "o-1")]


async def test_a_subject_no_handler_takes_is_a_clear_error() -> None:
    """Delivering on a subject no handler matches names the handlers there are."""
    async with testing.TestApp(orm_app()) as t:
        with pytest.raises(eop.ConfigurationError, match=r"billing \(ORDERS.created on ORDERS\)"):
            await t.deliver("ORDERS.deleted", b"{}")


async def test_one_result_shortcuts_refuse_when_several_handlers_got_it() -> None:
    """delivered.outcome with two handlers says to pick one, instead of guessing."""
    async with testing.TestApp(orm_app()) as t:
        delivered = await t.deliver("ORDERS.created", {"id": "o-1"})
    with pytest.raises(LookupError, match="pick one"):
        _ = delivered.outcome
    assert delivered["audit"].processed


async def test_a_delivery_that_never_settles_raises_delivery_stalled() -> None:
    """A database that keeps failing does not hang the test: DeliveryStalled after timeout_s,
    the message handed back (nak) as a stopping worker would."""
    store = testing.MemoryStore().fail_transactions(times=10_000)
    app = orm_app().with_settings(backoff_base_s=0.01, backoff_max_s=0.01)
    async with testing.TestApp(app, store=store, timeout_s=0.5) as t:
        with pytest.raises(testing.DeliveryStalled, match="did not settle"):
            await t.deliver("ORDERS.created", {"id": "o-1"}, handler="billing")


class UndefinedTable(Exception):
    """What a driver raises for a table no migration created."""

    sqlstate = "42P01"


async def test_a_missing_table_raises_the_workers_configuration_error_not_a_stall() -> None:
    """A handler whose table does not exist fails every attempt the same way: the test kit
    raises the ConfigurationError `eop worker` would stop with (naming the migration),
    soon, instead of dead-lettering or stalling until timeout_s; the next delivery runs."""
    app = eop.App()
    calls: list[str] = []

    @app.handler(stream="ORDERS", subject="ORDERS.created", name="billing")
    async def billing(msg: eop.Message, session: object) -> None:
        """Reaches a table that is not there, the first times."""
        calls.append(msg.text())
        if msg.text() == "missing":
            raise UndefinedTable('relation "invoices" does not exist')

    app = app.with_settings(backoff_base_s=0.01, backoff_max_s=0.01)
    async with testing.TestApp(app, timeout_s=20) as t:
        with pytest.raises(eop.ConfigurationError, match="run the migration") as info:
            await t.deliver("ORDERS.created", b"missing")
        assert 'relation "invoices" does not exist (SQLSTATE 42P01)' in str(info.value)
        assert calls == ["missing"] * 3
        assert (await t.deliver("ORDERS.created", b"fine")).processed


async def test_a_pydantic_payload_is_sent_as_json_and_decoded_for_the_handler() -> None:
    """A pydantic model given to deliver is encoded as JSON; the handler typed with it gets
    it decoded; one missing a field is dead-lettered as undecodable."""
    seen: list[Line] = []
    app = pydantic_app(seen)
    async with testing.TestApp(app) as t:
        good = await t.deliver("ORDERS.line", Line(sku="a-1", quantity=2))
        bad = await t.deliver("ORDERS.line", {"sku": "a-2"})
    assert good.processed
    assert seen == [Line(sku="a-1", quantity=2)]
    assert (bad.outcome, bad.reason) == (Outcome.DEAD_LETTERED, "undecodable")


async def test_a_batch_with_msg_ids_skips_the_republished_one() -> None:
    """deliver_batch's msg_ids: an item whose Nats-Msg-Id was processed before is skipped."""
    async with testing.TestApp(batch_app()) as t:
        await t.deliver("ORDERS.bulk", {"id": "a"}, msg_id="a")
        delivered = await t.deliver_batch(
            "ORDERS.bulk", [{"id": "a"}, {"id": "b"}], msg_ids=["a", "b"]
        )
    assert [d.outcome for d in delivered] == [Outcome.DUPLICATE, Outcome.PROCESSED]
    assert sorted(invoices(t)) == [("bulk", "a"), ("bulk", "b")]


async def test_a_sync_handler_runs_in_a_thread_in_memory_as_in_a_worker() -> None:
    """A plain `def` handler runs off the event loop, as `eop worker` runs it: one that
    calls `asyncio.run` (a sync client built on asyncio) processes its message here too,
    where on the loop it would fail and hide what production does."""
    import asyncio
    import threading

    app = eop.App()
    seen: list[bool] = []

    async def lookup() -> int:
        return 7

    @app.handler(stream="ORDERS", subject="ORDERS.created", name="sync_client")
    def handle(msg: eop.Message, session: object) -> None:
        seen.append(threading.current_thread() is threading.main_thread())
        assert asyncio.run(lookup()) == 7

    async with testing.TestApp(app) as t:
        delivered = await t.deliver("ORDERS.created", {"id": "o-1"})
    assert delivered.processed, delivered
    assert seen == [False]


async def test_a_message_given_to_a_handler_whose_subject_it_does_not_match_is_refused() -> None:
    """handler= names a handler whose consumer would never receive the subject: refused,
    so that a test does not pass on routing no worker does."""
    async with testing.TestApp(orm_app()) as t:
        with pytest.raises(eop.ConfigurationError, match=r"'ORDERS\.paid'"):
            await t.deliver("ORDERS.paid", {"id": "o-1"}, handler="billing")


def sql_app() -> eop.App:
    """A handler that runs SQL through its session: the in-memory session cannot."""
    app = eop.App()

    @app.handler(stream="ORDERS", subject="ORDERS.created", name="reads")
    async def reads(msg: eop.Message, session: AsyncSession) -> None:
        await session.execute(sa.text("SELECT 1"))

    return app


async def test_what_the_in_memory_session_cannot_do_is_raised_not_dead_lettered() -> None:
    """A handler running SQL on the in-memory session: its limit is raised to the test,
    even with raise_errors=False, never counted as the handler's failure and dead-lettered
    as no worker with a database would."""
    async with testing.TestApp(sql_app(), raise_errors=False) as t:
        with pytest.raises(testing.HandlerFailed, match="no 'execute'"):
            await t.deliver("ORDERS.created", {"id": "o-1"})


def writes_missing_app() -> eop.App:
    """An eop.Writes handler whose statement names a parameter it is not given."""
    app = eop.App()
    add = sa.text("INSERT INTO invoices (order_id, amount_cents) VALUES (:order_id, :cents)")

    @app.handler(stream="ORDERS", subject="ORDERS.created", name="bulk", batch=True)
    async def bulk(msgs: list[eop.Message], writes: eop.Writes) -> None:
        for msg in msgs:
            writes.add(add, {"order_id": msg.json()["id"]})

    return app


async def test_a_write_missing_a_parameter_fails_its_handler_as_the_database_would() -> None:
    """writes.add of a text statement without a value for one of its parameters: the
    handler fails here as it fails on a database (where every message would end
    dead-lettered), not processed."""
    async with testing.TestApp(writes_missing_app()) as t:
        with pytest.raises(testing.HandlerFailed, match="no value for 'cents'"):
            await t.deliver("ORDERS.created", {"id": "o-1"})


async def test_a_header_that_is_not_text_is_refused_in_one_line() -> None:
    """NATS headers are strings: an int given as a header's value is refused, naming the
    header, not failed deep in the kit with an AttributeError."""
    async with testing.TestApp(orm_app()) as t:
        with pytest.raises(eop.ConfigurationError, match="header 'Account'"):
            await t.deliver("ORDERS.created", {"id": "o-1"}, headers={"Account": 5})  # type: ignore[dict-item]
