"""Settlements only for deliveries of their stream's current incarnation (eop.broker.fence):
the verdicts, and the ack, nak and term that follow them."""

from __future__ import annotations

import datetime

import structlog
from structlog.testing import capture_logs

from eop import log, testing
from eop.broker import ack, fence
from eop.pg import retries

from .support import events

LOGGER = structlog.get_logger("test")
RECREATED = datetime.datetime(2026, 1, 1, 12, tzinfo=datetime.timezone.utc)
BEFORE = RECREATED - datetime.timedelta(seconds=1)


class Readings:
    """A stream recreated at RECREATED; ``answer`` is what a reading finds (True: the
    stream, False: no stream, None: no server), counted."""

    def __init__(self, answer: bool | None = True) -> None:
        self.answer = answer
        self.asked: list[tuple[str, float]] = []

    async def read_within(self, stream: str, within_s: float, timeout_s: float) -> bool | None:
        self.asked.append((stream, within_s))
        return self.answer

    def of_current(self, stream: str, stored_at: datetime.datetime | None) -> bool:
        return stored_at is None or stored_at >= RECREATED


def delivery(stored_at: datetime.datetime, stream: str = "S", seq: int = 1) -> testing.FakeDelivery:
    return testing.FakeDelivery.make(stream=stream, seq=seq, timestamp=stored_at)


async def test_verdicts_tell_the_current_incarnation_from_an_earlier_one_by_one_reading() -> None:
    """One reading a stream for the whole batch; a delivery stored before the stream's
    recreation may not be settled, one after may; a parked retry (no reply subject)
    sends nothing and needs no reading."""
    readings = Readings()
    parked = retries.ParkedDelivery.__new__(retries.ParkedDelivery)
    found = await fence.Fence(readings).verdicts(
        [delivery(BEFORE), delivery(RECREATED, seq=2), parked, delivery(RECREATED, stream="T")]
    )
    assert found == [False, True, True, True]
    assert readings.asked == [("S", fence.FENCE_S), ("T", fence.FENCE_S)]


async def test_a_stream_gone_or_unreadable_is_no_and_unknown() -> None:
    assert await fence.Fence(Readings(False)).verdict(delivery(RECREATED)) is False
    assert await fence.Fence(Readings(None)).verdict(delivery(RECREATED)) is None


async def test_an_ack_of_an_earlier_incarnation_is_not_sent_and_is_logged() -> None:
    d = delivery(BEFORE)
    with capture_logs() as logs:
        assert (
            await ack.confirm(
                d, timeout_s=0.05, give_up_s=0.2, logger=LOGGER, fence=fence.Fence(Readings())
            )
            is False
        )
    assert (d.acked, d.ack_attempts) == (False, 0)
    [warning] = events(logs, log.Event.ACK_FENCED)
    assert (warning["log_level"], warning["action"]) == ("warning", "ack")


async def test_an_ack_resent_after_the_stream_was_recreated_is_stopped() -> None:
    """The first try's reading allowed it; its reply was lost; by the resend a reading
    shows the stream recreated: no resend."""
    readings = Readings()
    d = delivery(RECREATED).fail_acks(10_000)
    checked = fence.Fence(readings)
    original = readings.of_current

    def recreated_after_the_first(stream: str, stored_at: datetime.datetime | None) -> bool:
        return len(readings.asked) < 2 and original(stream, stored_at)

    readings.of_current = recreated_after_the_first  # type: ignore[method-assign]
    with capture_logs() as logs:
        assert (
            await ack.confirm(d, timeout_s=0.05, give_up_s=2.0, logger=LOGGER, fence=checked)
            is False
        )
    assert d.ack_attempts == 1
    assert events(logs, log.Event.ACK_FENCED)


async def test_an_ack_waits_for_a_reading_it_cannot_make_yet() -> None:
    """No reading can be made: nothing is sent; once one can, the ack goes."""
    readings = Readings(None)
    d = delivery(RECREATED)
    checked = fence.Fence(readings)
    original = readings.read_within

    async def answers_on_the_third(stream: str, within_s: float, timeout_s: float) -> bool | None:
        await original(stream, within_s, timeout_s)
        return True if len(readings.asked) >= 3 else None

    readings.read_within = answers_on_the_third  # type: ignore[method-assign]
    assert await ack.confirm(d, timeout_s=0.05, give_up_s=2.0, logger=LOGGER, fence=checked) is True
    assert (d.acked, d.ack_attempts, len(readings.asked)) == (True, 1, 3)


async def test_a_nak_or_term_of_an_earlier_incarnation_is_not_sent() -> None:
    checked = fence.Fence(Readings())
    old, new = delivery(BEFORE), delivery(RECREATED, seq=2)
    with capture_logs() as logs:
        await ack.nak(old, 1.0, LOGGER, checked)
        await ack.term(old, LOGGER, checked)
        await ack.nak(new, 1.0, LOGGER, checked)
    assert (old.naked, old.termed) == (False, False)
    assert (new.naked, new.nak_delay) == (True, 1.0)
    assert [e["action"] for e in events(logs, log.Event.ACK_FENCED)] == ["nak", "term"]
