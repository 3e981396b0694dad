"""Per-key ordering: a key blocked behind a retried message, and the leases of those waiting."""

from __future__ import annotations

import asyncio

from eop import testing
from eop.protocol import ordering
from eop.types import Outcome

from .support import FAST


async def test_messages_waiting_behind_a_retried_one_keep_their_leases() -> None:
    """While a key is blocked, the deliveries held back get in_progress() heartbeats."""
    blocked = ordering.BlockedKeys()
    retried = testing.FakeDelivery.make(seq=1)
    waiting = [testing.FakeDelivery.make(seq=2), testing.FakeDelivery.make(seq=3)]
    blocked.update("h", "k", retried, Outcome.RETRY, FAST)
    assert blocked.blocked_seq("h", "k") == 1

    async def settle_once_beaten() -> None:
        for d in waiting:
            await asyncio.wait_for(d.wait_for_in_progress(2), timeout=10)
        blocked.update("h", "k", retried, Outcome.PROCESSED, FAST)

    settler = asyncio.create_task(settle_once_beaten())
    await asyncio.wait_for(blocked.wait("h", "k", list(waiting), 0.01), timeout=10)
    await settler
    assert blocked.blocked_seq("h", "k") is None
    assert all(d.in_progress_calls >= 2 for d in waiting)
