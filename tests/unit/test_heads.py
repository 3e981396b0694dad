"""The head messages of an ordered handler's lanes (:mod:`eop.ordering.heads`), on fakes.

Messages handed in while the handler's transactions are all busy run together
in the next one, each lane getting its own message's outcome; a failing
handler among them is settled alone; a redelivery runs alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
from structlog.testing import capture_logs

from eop import testing
from eop.message import Message
from eop.ordering import heads
from eop.types import Outcome

from .support import MakeHarness, delivery


def _heads(make_harness: MakeHarness, transactions: int = 1) -> tuple[heads.Heads, Any]:
    harness = make_harness(order_by="subject:1")
    tasks: set[asyncio.Task[Any]] = set()

    def spawn(coro: Coroutine[Any, Any, None]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        tasks.add(task)
        return task

    return heads.Heads(harness.processor, transactions=transactions, most=64, spawn=spawn), harness


def _keyed(seq: int) -> testing.FakeDelivery:
    return delivery(str(seq).encode(), seq=seq, subject=f"orders.k{seq}.new")


async def _first_busy(h: heads.Heads, harness: Any) -> tuple[asyncio.Event, asyncio.Future[Any]]:
    """Message 1 handed in, its handler running until the event returned is set."""
    release = asyncio.Event()

    async def slow(msg: Message, session: Any) -> None:
        await release.wait()

    harness.then(slow)
    first = asyncio.ensure_future(h.handle(_keyed(1), harness.processor.clock()))
    await asyncio.sleep(0.01)
    return release, first


async def test_messages_queued_behind_a_busy_transaction_commit_together_each_with_its_outcome(
    make_harness: MakeHarness,
) -> None:
    """With its one transaction busy, three lanes' messages wait, then share one
    transaction (one claim, one COMMIT): each lane gets PROCESSED, every message acked."""
    h, harness = _heads(make_harness, transactions=1)
    release, first = await _first_busy(h, harness)
    queued = [_keyed(seq) for seq in (2, 3, 4)]
    waiting = [asyncio.ensure_future(h.handle(d, harness.processor.clock())) for d in queued]
    await asyncio.sleep(0.01)
    assert harness.store.transactions == 1  # the three wait for the busy one
    release.set()
    assert await first == Outcome.PROCESSED
    assert await asyncio.gather(*waiting) == [Outcome.PROCESSED] * 3
    assert (harness.store.transactions, harness.store.commits) == (2, 2)
    assert all(d.acked for d in queued)
    assert [m.seq for m in harness.calls] == [1, 2, 3, 4]


async def test_a_failing_handler_among_queued_messages_is_retried_alone_the_others_commit(
    make_harness: MakeHarness,
) -> None:
    """Of three queued messages the second one's handler fails: it alone is nak'ed
    (RETRY, which blocks its key), the first and third commit; each lane gets its own."""
    h, harness = _heads(make_harness, transactions=1)
    release = asyncio.Event()

    async def slow(msg: Message, session: Any) -> None:
        await release.wait()

    # The first message alone; then the batch without savepoints (the second fails, it
    # is rolled back whole), then with a savepoint each.
    harness.then(slow, None, RuntimeError("boom"), None, RuntimeError("boom"), None)
    first = asyncio.ensure_future(h.handle(_keyed(1), harness.processor.clock()))
    await asyncio.sleep(0.01)
    queued = [_keyed(seq) for seq in (2, 3, 4)]
    waiting = [asyncio.ensure_future(h.handle(d, harness.processor.clock())) for d in queued]
    await asyncio.sleep(0.01)
    release.set()
    assert await first == Outcome.PROCESSED
    assert await asyncio.gather(*waiting) == [Outcome.PROCESSED, Outcome.RETRY, Outcome.PROCESSED]
    assert (queued[0].acked, queued[1].naked, queued[2].acked) == (True, True, True)
    assert not queued[1].acked


async def test_an_ordered_handlers_transactions_log_one_info_line_each(
    make_harness: MakeHarness,
) -> None:
    """Each transaction of an ordered handler logs ``batch.processed`` at info level, as
    an unordered handler's fetched batch does: the message that ran alone, then the three
    that waited for it and ran together, with their count and outcomes."""
    h, harness = _heads(make_harness, transactions=1)
    release = asyncio.Event()

    async def slow(msg: Message, session: Any) -> None:
        await release.wait()

    harness.then(slow)
    with capture_logs() as logs:
        first = asyncio.ensure_future(h.handle(_keyed(1), harness.processor.clock()))
        await asyncio.sleep(0.01)
        queued = [_keyed(seq) for seq in (2, 3, 4)]
        waiting = [asyncio.ensure_future(h.handle(d, harness.processor.clock())) for d in queued]
        await asyncio.sleep(0.01)
        release.set()
        await first
        await asyncio.gather(*waiting)
    lines = [e for e in logs if e["event"] == "batch.processed"]
    assert [(e["log_level"], e["first_seq"], e["last_seq"], e["messages"]) for e in lines] == [
        ("info", 1, 1, 1),
        ("info", 2, 4, 3),
    ]
    assert [e["processed"] for e in lines] == [1, 3]


async def test_a_redelivery_runs_alone_and_forgets_its_counted_failures(
    make_harness: MakeHarness,
) -> None:
    """A redelivered message of an ordered handler goes through the per-message protocol,
    which forgets the failures counted for its earlier deliveries once it succeeds."""
    h, harness = _heads(make_harness, transactions=4)
    again = delivery(b"1", seq=1, num_delivered=2, subject="orders.k1.new")
    harness.failed_before(again, 1)
    assert await h.handle(again, harness.processor.clock()) == Outcome.PROCESSED
    assert harness.store.attempts.get(("orders", "ORDERS", "e1", 1), 0) == 0


async def test_beside_a_running_transaction_one_message_waits_and_a_full_group_opens_another(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With connections to spare, a message handed in while a transaction runs waits
    for it (lanes gather instead of each taking a connection); a full group of waiting
    messages opens another transaction at once."""
    monkeypatch.setattr(heads, "LINGER_S", 60.0)  # no linger within the test
    h, harness = _heads(make_harness, transactions=4)
    release = asyncio.Event()

    async def slow(msg: Message, session: Any) -> None:
        await release.wait()

    harness.then(*([slow] * 20))
    first = asyncio.ensure_future(h.handle(_keyed(1), harness.processor.clock()))
    await asyncio.sleep(0.01)
    group = [_keyed(seq) for seq in range(2, 2 + heads.GROUP)]
    waiting = [asyncio.ensure_future(h.handle(d, harness.processor.clock())) for d in group[:-1]]
    await asyncio.sleep(0.01)
    assert harness.store.transactions == 1  # one short of a group: they wait
    waiting.append(asyncio.ensure_future(h.handle(group[-1], harness.processor.clock())))
    await asyncio.sleep(0.01)
    assert harness.store.transactions == 2  # a full group: another transaction
    release.set()
    assert await first == Outcome.PROCESSED
    assert await asyncio.gather(*waiting) == [Outcome.PROCESSED] * heads.GROUP
    assert harness.store.commits == 2


async def test_waiting_groups_are_spread_over_the_free_connections(
    make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three groups handed in beside a running transaction start three transactions (as
    many as free connections allow), not one holding them all: a batch runs its handlers
    one after another, so lanes taken whole would shrink the handler's concurrency."""
    monkeypatch.setattr(heads, "LINGER_S", 60.0)
    h, harness = _heads(make_harness, transactions=4)
    release = asyncio.Event()

    async def slow(msg: Message, session: Any) -> None:
        await release.wait()

    harness.then(*([slow] * 40))
    first = asyncio.ensure_future(h.handle(_keyed(1), harness.processor.clock()))
    await asyncio.sleep(0.01)
    queued = [_keyed(seq) for seq in range(2, 2 + 3 * heads.GROUP)]
    waiting = []
    for d in queued:  # handed in together, as the lanes of an ended batch come back
        waiting.append(asyncio.ensure_future(h.handle(d, harness.processor.clock())))
    await asyncio.sleep(0.01)
    assert harness.store.transactions == 4  # the first, and three groups beside it
    release.set()
    assert await first == Outcome.PROCESSED
    assert await asyncio.gather(*waiting) == [Outcome.PROCESSED] * len(queued)


async def test_a_message_waiting_beside_a_slow_transaction_starts_after_the_linger(
    make_harness: MakeHarness,
) -> None:
    """Gathering holds no key behind another key's slow handler: a lone message handed in
    beside a running transaction takes a free connection once it waited the linger."""
    h, harness = _heads(make_harness, transactions=4)
    release = asyncio.Event()

    async def slow(msg: Message, session: Any) -> None:
        await release.wait()

    harness.then(slow, None)
    first = asyncio.ensure_future(h.handle(_keyed(1), harness.processor.clock()))
    await asyncio.sleep(0.001)
    second = h.handle(_keyed(2), harness.processor.clock())
    assert await asyncio.wait_for(second, 1.0) == Outcome.PROCESSED  # the first still runs
    assert not first.done()
    release.set()
    assert await first == Outcome.PROCESSED


async def test_a_stop_hands_the_waiting_messages_back_at_once_unrun(
    make_harness: MakeHarness,
) -> None:
    """The worker stops while lanes' messages wait behind a busy transaction: they are
    nak'ed at once (delay 0) and their lanes told LEFT, without running and without
    waiting for that transaction, which finishes and commits its own message. A message
    handed in after the stop is handed back too."""
    h, harness = _heads(make_harness, transactions=1)
    release, first = await _first_busy(h, harness)
    queued = [_keyed(seq) for seq in (2, 3)]
    waiting = [asyncio.ensure_future(h.handle(d, harness.processor.clock())) for d in queued]
    await asyncio.sleep(0.01)
    harness.processor.stopping.set()
    assert await asyncio.gather(*waiting) == [Outcome.LEFT] * 2
    assert not first.done()
    assert [(d.naked, d.nak_delay) for d in queued] == [(True, 0.0)] * 2
    late = _keyed(4)
    assert await h.handle(late, harness.processor.clock()) == Outcome.LEFT
    assert (late.naked, late.nak_delay) == (True, 0.0)
    release.set()
    assert await first == Outcome.PROCESSED
    assert [m.seq for m in harness.calls] == [1]
