"""Per-key ordering: a key blocked behind a retried message, and the leases of those waiting."""

from __future__ import annotations

import asyncio

from eop import testing
from eop.protocol import ordering
from eop.runtime import ordered
from eop.types import Outcome


async def _always(seq: int) -> bool:
    return True


async def _never(seq: int) -> bool:
    return False


async def test_messages_waiting_behind_a_retried_one_keep_their_leases() -> None:
    """While a key is blocked, the deliveries held back get in_progress() heartbeats."""
    blocked = ordering.BlockedKeys()
    retried = testing.FakeDelivery.make(seq=1)
    waiting = [testing.FakeDelivery.make(seq=2), testing.FakeDelivery.make(seq=3)]
    blocked.update("h", "k", retried, Outcome.RETRY)
    assert blocked.blocked_seq("h", "k") == 1

    async def settle_once_beaten() -> None:
        for d in waiting:
            await asyncio.wait_for(d.wait_for_in_progress(2), timeout=10)
        blocked.update("h", "k", retried, Outcome.PROCESSED)

    settler = asyncio.create_task(settle_once_beaten())
    lost = asyncio.Event()
    went_on = await asyncio.wait_for(
        blocked.wait("h", "k", list(waiting), 0.01, lost=lost, stored=_always, hold_s=60),
        timeout=10,
    )
    await settler
    assert went_on
    assert blocked.blocked_seq("h", "k") is None
    assert all(d.in_progress_calls >= 2 for d in waiting)


async def test_a_blocked_key_waits_past_any_time_while_its_message_is_stored() -> None:
    """No time limit lets a key's later messages overtake its retried one: after each
    hold the stream is asked, and the key stays blocked while it still holds the message."""
    blocked = ordering.BlockedKeys()
    blocked.update("h", "k", testing.FakeDelivery.make(seq=5), Outcome.RETRY)
    asked: list[int] = []

    async def stored(seq: int) -> bool:
        asked.append(seq)
        return True

    waiting = blocked.wait("h", "k", [], 0.01, lost=asyncio.Event(), stored=stored, hold_s=0.02)
    task = asyncio.ensure_future(waiting)
    await asyncio.sleep(0.3)
    assert not task.done()
    assert len(asked) >= 3
    assert set(asked) == {5}
    blocked.update("h", "k", testing.FakeDelivery.make(seq=5), Outcome.PROCESSED)
    assert await asyncio.wait_for(task, 5)


async def test_a_blocked_key_is_released_when_the_stream_no_longer_holds_the_message() -> None:
    """A retried message deleted from the stream (limits, a purge) never comes back: its
    key goes on instead of waiting for ever."""
    blocked = ordering.BlockedKeys()
    blocked.update("h", "k", testing.FakeDelivery.make(seq=5), Outcome.RETRY)
    went_on = await asyncio.wait_for(
        blocked.wait("h", "k", [], 0.01, lost=asyncio.Event(), stored=_never, hold_s=0.02), 5
    )
    assert went_on
    assert blocked.blocked_seq("h", "k") is None


async def test_a_key_stops_waiting_when_its_partition_is_lost() -> None:
    """Once the process no longer owns the partition, its waiting messages are left for
    the new owner (False), not run."""
    blocked = ordering.BlockedKeys()
    blocked.update("h", "k", testing.FakeDelivery.make(seq=5), Outcome.RETRY)
    lost = asyncio.Event()
    task = asyncio.ensure_future(
        blocked.wait("h", "k", [], 0.01, lost=lost, stored=_always, hold_s=60)
    )
    await asyncio.sleep(0.05)
    lost.set()
    assert await asyncio.wait_for(task, 5) is False


def test_partition_shares_add_up_whoever_computes_them() -> None:
    """Every member ranks the members by name: the shares sum to the partition count,
    and differ by one at most."""
    for count in (1, 2, 7, 16):
        for n in (1, 2, 3, 5):
            members = [f"m{i}" for i in range(n)]
            shares = [ordered.share(members, m, count) for m in members]
            assert sum(shares) == count
            assert max(shares) - min(shares) <= 1
    assert ordered.share(["a", "b"], "c", 4) == 0
