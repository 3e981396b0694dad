"""Django ORM handlers in the transaction of the claim, on a worker in this process.

Each test counts effects per message (duplicates and losses), dead letters
(a good message dead-lettered is a failure) and waits for its consumer to
drain within a generous bound (a stall is a failure).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from structlog.testing import capture_logs

from eop.contrib.django import get_app
from eop.ops import dlq
from eop.runtime.worker import Worker
from tests.integration.bed import drained, running, wait_for

from .conftest import query

pytestmark = pytest.mark.timeout(180)


@contextlib.asynccontextmanager
async def worker(nats_url: str, *handlers: str, **overrides: Any) -> AsyncIterator[Worker]:
    """A worker of the project's app (settings.EOP, Django's database) on ``handlers``."""
    app = get_app({"nats_url": nats_url, "concurrency": 8, "batch": 8, **overrides})
    async with running(app, handlers=handlers) as w:
        yield w


async def rows(sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """Rows of ``sql``, read through Django off the event loop."""
    return await sync_to_async(query)(sql, *params)


async def effects(handler: str) -> dict[str, int]:
    """Effects of ``handler`` per message key."""
    found = await rows(
        "SELECT key, count(*) FROM shop_effect WHERE handler = %s GROUP BY key", handler
    )
    return {key: int(n) for key, n in found}


async def balance(name: str) -> int:
    """The balance of account ``name``."""
    return int((await rows("SELECT balance FROM shop_account WHERE name = %s", name))[0][0])


async def accounts(*names: str) -> None:
    """Accounts at 0."""
    for name in names:
        await rows("INSERT INTO shop_account (name, balance) VALUES (%s, 0) RETURNING id", name)


async def settled(js: Any, durable: str) -> bool:
    """The consumer has nothing pending or unacked, and no retry waits in the database."""
    if not await drained(js, durable, "DJ"):
        return False
    return not await rows("SELECT 1 FROM eop.retries")


def body(key: object, **extra: object) -> bytes:
    """A message's payload."""
    return json.dumps({"key": str(key), **extra}).encode()


@pytest.mark.parametrize("batch_transactions", [True, False], ids=["batch", "per-message"])
async def test_sync_orm_handler_writes_once_in_the_claims_transaction_and_a_poison_message_is_dead_lettered(  # noqa: E501
    project: str, nats_url: str, js: Any, batch_transactions: bool
) -> None:
    """A sync handler's ORM rows commit with its claim, once per message (a republish of the
    same msg-id included); the poison message's rows roll back with each failed attempt and
    it ends as the one dead letter."""
    await accounts("hot")
    async with worker(nats_url, "sync_effects", batch_transactions=batch_transactions):
        for i in range(60):
            await js.publish("dj.sync", body(i), headers={"Nats-Msg-Id": f"s-{i}"})
        await js.publish("dj.sync", body(7), headers={"Nats-Msg-Id": "s-7"})  # a republish
        await js.publish("dj.sync", body("poison", poison=True))
        await wait_for(
            lambda: settled(js, "eop-sync_effects"), timeout_s=90, what="the consumer to drain"
        )
    assert await effects("sync") == {str(i): 1 for i in range(60)}
    assert await rows("SELECT DISTINCT saw_claim FROM shop_effect") == [(True,)]
    assert await balance("hot") == 60
    dead = await rows("SELECT id, subscription, reason FROM eop.dead_letters")
    assert [d[1:] for d in dead] == [("sync_effects", "attempts_exhausted")]
    # `eop dlq replay --rerun` runs the handler on Django's connection too (the dead
    # letter's JSON headers read back through Django's cursor): it fails again, rolled back.
    result = await dlq.Replayer(get_app()).replay(dead[0][0], mode="rerun")
    assert (result.status, result.detail) == (
        "failed",
        "ValueError: poison: this message always fails",
    )
    assert await effects("sync") == {str(i): 1 for i in range(60)}


async def test_async_orm_handler_runs_on_the_lanes_connection_with_its_outbox_row(
    project: str, nats_url: str, js: Any
) -> None:
    """An async handler's ``acreate``/``aupdate`` and its ``aadd`` to the outbox run in the
    transaction of the claim (it sees its own uncommitted inbox row), once per message;
    the relay publishes each forwarded message."""
    await accounts("hot")
    async with worker(nats_url, "async_effects"):
        for i in range(40):
            await js.publish("dj.async", body(i))
        await wait_for(lambda: settled(js, "eop-async_effects"), timeout_s=90, what="drained")

        async def published() -> bool:
            found = await rows("SELECT count(*) FROM eop.outbox WHERE published_at IS NOT NULL")
            return bool(found[0][0] == 40)

        await wait_for(published, timeout_s=60, what="the relay to publish")
    assert await effects("async") == {str(i): 1 for i in range(40)}
    assert await rows("SELECT DISTINCT saw_claim FROM shop_effect") == [(True,)]
    assert await balance("hot") == 40
    assert await rows("SELECT count(*) FROM eop.outbox") == [(40,)]
    assert await rows("SELECT count(*) FROM eop.dead_letters") == [(0,)]
    stream = await js.stream_info("DJ")
    assert stream.state.messages == 80  # 40 in, 40 forwarded


@pytest.mark.parametrize("batch_transactions", [True, False], ids=["batch", "per-message"])
async def test_an_on_commit_callback_that_raises_is_logged_and_its_message_acked_once(
    project: str, nats_url: str, js: Any, batch_transactions: bool
) -> None:
    """A ``transaction.on_commit`` callback runs after COMMIT: when it raises, the message's
    effect is committed all the same. It is acked as processed, once, and the callback's
    error is an error-level ``transaction.on_commit_failed`` line (it was seen nowhere:
    the message counted a failure, and its retry found it done)."""
    with capture_logs() as logs:
        async with worker(nats_url, "on_commit_fails", batch_transactions=batch_transactions):
            for i in range(10):
                await js.publish("dj.oncommit", body(i))
            await wait_for(lambda: settled(js, "eop-on_commit_fails"), timeout_s=90, what="drained")
    assert await effects("oncommit") == {str(i): 1 for i in range(10)}
    assert await rows("SELECT count(*) FROM eop.dead_letters") == [(0,)]
    failed = [e for e in logs if e["event"] == "transaction.on_commit_failed"]
    assert failed, "the callback's error is logged"
    assert all(e["log_level"] == "error" for e in failed)
    assert all("the on_commit callback failed" in e["error"] for e in failed)
    assert not [e for e in logs if e["event"] in ("message.retry", "message.duplicate")]


async def test_a_commit_or_rollback_statement_of_a_handler_is_found_before_eops_commit(
    project: str, nats_url: str, js: Any
) -> None:
    """A handler that ends eop's transaction with a ``COMMIT`` or ``ROLLBACK`` statement on
    Django's cursor (which ``atomic()`` does not refuse) fails with
    TransactionEndedByHandler, logged with its message, instead of eop committing apart
    from the claim. The COMMIT's message was committed with its claim and its write
    before it: never run again, not dead-lettered. The ROLLBACK's fails each run and is
    dead-lettered with that error. Good messages take effect once each. (A batch of one:
    in a batch, the COMMIT commits the claims of all its messages.)"""
    with capture_logs() as logs:
        async with worker(nats_url, "raw_end", batch=1, max_attempts=2):
            for i in range(3):
                await js.publish("dj.rawend", body(f"good-{i}"))
                await js.publish("dj.rawend", body(f"commit-{i}", end="COMMIT"))
                await js.publish("dj.rawend", body(f"rollback-{i}", end="ROLLBACK"))
            await wait_for(lambda: settled(js, "eop-raw_end"), timeout_s=90, what="drained")
    expected = {f"{kind}-{i}": 1 for kind in ("good", "commit") for i in range(3)}
    assert await effects("rawend") == expected
    ended = {
        (e["handler"], e["first_seq"]) for e in logs if e["event"] == "transaction.ended_by_handler"
    }
    assert {seq for _, seq in ended} == {2, 3, 5, 6, 8, 9}
    assert {handler for handler, _ in ended} == {"raw_end"}
    dead = await rows("SELECT stream_seq, error FROM eop.dead_letters ORDER BY stream_seq")
    assert [seq for seq, _ in dead] == [3, 6, 9]
    assert all("past Django's atomic() block" in error for _, error in dead)


async def test_crossing_hot_rows_deadlock_and_still_apply_each_message_once(
    project: str, nats_url: str, js: Any
) -> None:
    """Handlers locking two hot rows in opposite orders deadlock in their batches; eop
    retries them (never counting an attempt): every message applied once, none dead."""
    await accounts("a", "b")
    async with worker(nats_url, "crossing", concurrency=16, batch=8, db_pool_size=8):
        for i in range(160):
            await js.publish("dj.crossing", body(i))
        await wait_for(lambda: settled(js, "eop-crossing"), timeout_s=120, what="drained")
    assert await effects("crossing") == {str(i): 1 for i in range(160)}
    assert await balance("a") == 160
    assert await balance("b") == 160
    assert await rows("SELECT count(*) FROM eop.dead_letters") == [(0,)]


async def test_outbox_in_a_view_commits_with_the_views_transaction_and_is_consumed_once(
    project: str, nats_url: str, js: Any
) -> None:
    """``eop.contrib.django.add`` in a view's ``transaction.atomic()``: the order and its
    message commit together, a refused request leaves neither; the relay publishes the
    committed ones and a Django handler consumes each once."""
    from django.test import AsyncClient

    client = AsyncClient()
    async with worker(nats_url, "orders"):
        for ref, fail in (("o1", False), ("o2", True), ("o3", False)):
            response = await client.post(
                "/orders/",
                json.dumps({"ref": ref, "total": 10, "fail": fail}),
                content_type="application/json",
            )
            assert response.status_code == (409 if fail else 201)
        assert await rows("SELECT ref FROM shop_order ORDER BY ref") == [("o1",), ("o3",)]
        assert await rows("SELECT count(*) FROM eop.outbox") == [(2,)]

        async def consumed() -> bool:
            return await effects("orders") == {"o1": 1, "o3": 1}

        await wait_for(consumed, timeout_s=60, what="the orders to be consumed")
        await wait_for(lambda: settled(js, "eop-orders"), timeout_s=60, what="drained")
    assert await effects("orders") == {"o1": 1, "o3": 1}
    assert await rows("SELECT DISTINCT saw_claim FROM shop_effect") == [(True,)]


def test_eops_engines_cannot_be_pointed_away_from_djangos_database(project: str) -> None:
    """A database_url (a --database-url flag) naming another database than DATABASES is
    refused: the claims and eop's bookkeeping would each see half of the inbox."""
    from eop import errors
    from eop.contrib.django.store import DjangoStore

    app = get_app()
    DjangoStore(app, "default").close()  # Django's own: accepted
    elsewhere = app.with_settings(database_url="postgresql+asyncpg://postgres@127.0.0.1:1/other")
    with pytest.raises(errors.ConfigurationError, match=r"is not DATABASES\['default'\]"):
        elsewhere.make_store()
