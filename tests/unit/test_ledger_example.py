"""examples/ledger/test_handlers.py, run with the unit tests: it needs no server."""

from __future__ import annotations

from examples.ledger import test_handlers as example


async def test_the_ledger_example_holds_an_account_behind_its_retried_entry() -> None:
    """The example's in-memory test of per-key order passes: held entries, then in order."""
    await example.test_an_entry_waiting_for_its_rate_holds_back_its_account_only()


async def test_the_ledger_example_goes_on_after_a_dead_letter() -> None:
    """The example's test of an entry dead-lettered after max_attempts passes."""
    await example.test_an_entry_without_a_rate_is_dead_lettered_then_its_account_goes_on()
