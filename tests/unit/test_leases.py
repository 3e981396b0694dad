"""The leases of held deliveries: renewed from one task until released, whatever they
wait for (eop.broker.leases)."""

from __future__ import annotations

import asyncio

import nats.errors
from structlog.testing import capture_logs

from eop import log, testing
from eop.broker import leases

ACK_WAIT_S = 0.03  # renewed every 10 ms


async def test_a_held_delivery_is_renewed_until_it_is_released() -> None:
    """in_progress() goes on while the delivery is held, and stops once it is released."""
    d = testing.FakeDelivery.make()
    keeper = leases.Leases()
    keeper.hold([d], ACK_WAIT_S)
    await asyncio.wait_for(d.wait_for_in_progress(3), timeout=10)
    keeper.release([d])
    calls = d.in_progress_calls
    await asyncio.sleep(0.1)
    assert d.in_progress_calls <= calls + 1
    assert len(keeper) == 0
    await keeper.close()


async def test_renewed_at_moves_with_each_renewal_so_waiting_spends_no_lease() -> None:
    """The processor's lease check reads the last renewal, not the fetch: a delivery that
    waited many AckWaits while held still has its lease."""
    d = testing.FakeDelivery.make()
    keeper = leases.Leases()
    keeper.hold([d], ACK_WAIT_S, at=0.0)
    assert keeper.renewed_at(d, 0.0) == 0.0
    await asyncio.wait_for(d.wait_for_in_progress(2), timeout=10)
    assert keeper.renewed_at(d, 0.0) > 0.0
    assert keeper.renewed_at(testing.FakeDelivery.make(), 7.0) == 7.0
    await keeper.close()


async def test_a_delivery_held_twice_is_renewed_until_both_release_it() -> None:
    """The worker holds a delivery from its fetch, the processor again around its
    transaction: the processor's release does not end the worker's hold."""
    d = testing.FakeDelivery.make()
    keeper = leases.Leases()
    keeper.hold([d], ACK_WAIT_S)
    async with keeper.keep([d], ACK_WAIT_S):
        await asyncio.wait_for(d.wait_for_in_progress(1), timeout=10)
    calls = d.in_progress_calls
    await asyncio.wait_for(d.wait_for_in_progress(calls + 2), timeout=10)
    keeper.release([d])
    assert len(keeper) == 0
    await keeper.close()


async def test_a_delivery_nakd_while_still_held_is_not_renewed_again() -> None:
    """A retried message of a batch whose others still run is nak'ed while its holders
    still hold it: an in_progress() after the nak would make the server wait a whole
    AckWait instead of the nak's delay. It is dropped at the next round, unrenewed, and
    its holders' releases then find nothing; the other held deliveries go on."""
    nakd, other = testing.FakeDelivery.make(), testing.FakeDelivery.make(seq=2)
    keeper = leases.Leases()
    keeper.hold([nakd, other], ACK_WAIT_S)
    keeper.hold([nakd], ACK_WAIT_S)
    await asyncio.wait_for(nakd.wait_for_in_progress(1), timeout=10)
    await nakd.nak(delay=0.5)
    calls = nakd.in_progress_calls
    await asyncio.wait_for(other.wait_for_in_progress(other.in_progress_calls + 3), timeout=10)
    assert nakd.in_progress_calls == calls
    assert len(keeper) == 1
    keeper.release([nakd])
    keeper.release([nakd])
    keeper.release([other])
    assert len(keeper) == 0
    await keeper.close()


async def test_every_held_delivery_is_renewed_from_one_task() -> None:
    """Hundreds of held deliveries cost one task, not one each."""
    held = [testing.FakeDelivery.make(seq=seq) for seq in range(1, 301)]
    keeper = leases.Leases()
    before = asyncio.all_tasks()
    keeper.hold(held, ACK_WAIT_S)
    for d in held:
        await asyncio.wait_for(d.wait_for_in_progress(2), timeout=10)
    assert len(asyncio.all_tasks() - before) == 1
    keeper.release(held)
    await keeper.close()
    assert asyncio.all_tasks() == before


async def test_failed_renewals_are_one_warning_per_streak_and_are_tried_again() -> None:
    """A lost in_progress() (NATS reconnecting) is a warning naming how many failed, not
    one line per delivery or per round; the renewals go on for every delivery."""
    failing = [
        testing.FakeDelivery.make(seq=seq).fail("in_progress", 1, nats.errors.TimeoutError)
        for seq in (1, 2, 3)
    ]
    fine = testing.FakeDelivery.make(seq=4)
    keeper = leases.Leases()
    with capture_logs() as logs:
        keeper.hold([*failing, fine], ACK_WAIT_S)
        for d in [*failing, fine]:
            await asyncio.wait_for(d.wait_for_in_progress(2), timeout=10)
        keeper.release([*failing, fine])
        await keeper.close()
    warnings = [e for e in logs if e["event"] == log.Event.HEARTBEAT_FAILED]
    assert warnings[0]["log_level"] == "warning"
    assert warnings[0]["deliveries"] == 3
    assert len(warnings) == 1


async def test_oldest_s_tells_how_long_the_longest_held_delivery_waits() -> None:
    """Renewals do not reset it: a delivery held for many AckWaits shows its whole wait."""
    now = [100.0]
    keeper = leases.Leases(clock=lambda: now[0])
    assert keeper.oldest_s() == 0.0
    keeper.hold([testing.FakeDelivery.make()], 30.0)
    now[0] = 250.0
    assert keeper.oldest_s() == 150.0
    await keeper.close()
