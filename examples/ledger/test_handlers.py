"""Tests of the ledger's ordered handler, written as a user of eop writes them (docs/testing.md).

    pip install 'eop[testing]'
    pytest examples/ledger/test_handlers.py

Nothing but eop is needed: the inbox and the handler's writes are kept in memory.
"""

from __future__ import annotations

import pytest

from eop.testing import Outcome, TestApp
from examples.ledger import app as ledger
from examples.ledger.app import Posting, app

# Works with pytest-asyncio in strict mode too (with asyncio_mode = auto it is not needed).
pytestmark = pytest.mark.asyncio


def posted(t: TestApp) -> list[str]:
    """The entries posted, in commit order."""
    return [e.entry_id for e in t.effects if isinstance(e, Posting)]


async def test_an_entry_waiting_for_its_rate_holds_back_its_account_only() -> None:
    """a1 has no rate yet: a2 and a3 (same account) wait behind it, b1 is posted; once the
    rate is there, the retry posts a1, then a2 and a3, in order."""
    with pytest.MonkeyPatch.context() as patch:
        async with TestApp(app) as t:
            a1 = await t.deliver("LEDGER.A", {"id": "a1", "amount_cents": 100, "currency": "EUR"})
            a2 = await t.deliver("LEDGER.A", {"id": "a2", "amount_cents": 200, "currency": "USD"})
            a3 = await t.deliver("LEDGER.A", {"id": "a3", "amount_cents": 300, "currency": "USD"})
            b1 = await t.deliver("LEDGER.B", {"id": "b1", "amount_cents": 400, "currency": "USD"})

            assert a1.retried
            assert (a2.held, a3.held) == (True, True)
            assert a2.held_behind == a1.message.seq
            assert b1.processed
            assert [r.message.seq for r in t.held] == [a2.message.seq, a3.message.seq]
            assert posted(t) == ["b1"]

            patch.setitem(ledger.RATES, "EUR", 1.1)  # the rate comes in
            later = await t.retry()

    assert [r.outcome for r in later] == [Outcome.PROCESSED] * 3
    assert posted(t) == ["b1", "a1", "a2", "a3"]
    assert t.held == []


async def test_an_entry_without_a_rate_is_dead_lettered_then_its_account_goes_on() -> None:
    """Without a rate, a1 is retried until its attempts are spent and dead-lettered; then
    the entries held behind it are posted."""
    async with TestApp(app.with_settings(max_attempts=3)) as t:
        await t.deliver("LEDGER.A", {"id": "a1", "amount_cents": 100, "currency": "XXX"})
        await t.deliver("LEDGER.A", {"id": "a2", "amount_cents": 200, "currency": "USD"})
        settled = await t.settle()
        [dead] = await t.dead_letters()

    assert [r.outcome for r in settled] == [
        Outcome.RETRY,
        Outcome.DEAD_LETTERED,
        Outcome.PROCESSED,
    ]
    assert dead.reason == "attempts_exhausted"
    assert posted(t) == ["a2"]
