"""Settling deliveries: the confirmed ack, nak, term and heartbeats."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import nats.errors
import pytest
import structlog
from structlog.testing import capture_logs

from eop import log, testing
from eop.broker import ack

from .support import events

LOGGER = structlog.get_logger("test")


# -------------------------------------------------------------------- confirm


async def confirm(
    delivery: testing.FakeDelivery, give_up_s: float = 0.2, stopping: asyncio.Event | None = None
) -> bool:
    return await ack.confirm(
        delivery, timeout_s=0.05, give_up_s=give_up_s, logger=LOGGER, stopping=stopping
    )


async def test_confirm_returns_true_once_the_server_has_the_ack() -> None:
    d = testing.FakeDelivery.make()
    assert await confirm(d) is True
    assert (d.acked, d.ack_attempts) == (True, 1)


@pytest.mark.parametrize(
    "error",
    [
        nats.errors.TimeoutError,
        asyncio.TimeoutError,
        nats.errors.NoRespondersError,
        nats.errors.ConnectionReconnectingError,
        nats.errors.ConnectionClosedError,
    ],
)
async def test_confirm_retries_lost_replies_and_reconnects(error: type[BaseException]) -> None:
    d = testing.FakeDelivery.make().fail_acks(2, error)
    assert await confirm(d) is True
    assert d.ack_attempts == 3
    assert d.acked


async def test_confirm_treats_already_acked_as_done() -> None:
    d = testing.FakeDelivery.make().fail_acks(1, nats.errors.MsgAlreadyAckdError)
    assert await confirm(d) is True
    assert d.ack_attempts == 1


async def test_confirm_gives_up_after_the_bound_with_a_warning() -> None:
    d = testing.FakeDelivery.make().fail_acks(10_000)
    with capture_logs() as logs:
        assert await confirm(d, give_up_s=0.1) is False
    [warning] = events(logs, log.Event.ACK_GAVE_UP)
    assert warning["log_level"] == "warning"
    assert warning["error"] == "TimeoutError"
    assert not d.acked


async def test_acks_nobody_answers_are_given_up_sooner_than_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No responders for the ack subject (the consumer gone with a partition's old epoch,
    or its leader being elected) is resent only for NO_RESPONDERS_GIVE_UP_S, not the whole
    ``give_up_s``: a stopping worker waited the full bound for such acks."""
    monkeypatch.setattr(ack, "NO_RESPONDERS_GIVE_UP_S", 0.1)
    d = testing.FakeDelivery.make().fail_acks(10_000, nats.errors.NoRespondersError)
    with capture_logs() as logs:
        assert await confirm(d, give_up_s=30.0) is False
    [warning] = events(logs, log.Event.ACK_GAVE_UP)
    assert warning["error"] == "NoRespondersError"
    # Resent at 50 ms, then 100 ms: over 0.1 s after a few, where 30 s takes dozens.
    assert 1 < d.ack_attempts <= 5
    # Other failures still have the whole bound: a lost reply is resent past it.
    lost = testing.FakeDelivery.make().fail_acks(4)
    assert await confirm(lost, give_up_s=30.0) is True


async def test_a_stopping_worker_gives_up_unanswered_acks_sooner_than_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NATS down as the worker stops: its acks time out. Once the worker stops they are
    resent only for NO_RESPONDERS_GIVE_UP_S, not the whole ``give_up_s``: a stop with NATS
    down took the full bound. Not stopping, a lost reply keeps the whole bound."""
    monkeypatch.setattr(ack, "NO_RESPONDERS_GIVE_UP_S", 0.1)
    stopping = asyncio.Event()
    stopping.set()
    d = testing.FakeDelivery.make().fail_acks(10_000)
    with capture_logs() as logs:
        assert await confirm(d, give_up_s=30.0, stopping=stopping) is False
    [warning] = events(logs, log.Event.ACK_GAVE_UP)
    assert warning["error"] == "TimeoutError"
    assert 1 < d.ack_attempts <= 5
    lost = testing.FakeDelivery.make().fail_acks(4)
    assert await confirm(lost, give_up_s=30.0, stopping=asyncio.Event()) is True


async def test_acks_to_a_consumer_found_gone_are_given_up_at_their_first_no_responders(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once an ack to a consumer was given up on no responders (deleted with a partition's
    old epoch), the next acks to it are given up at their first no responders, not after
    NO_RESPONDERS_GIVE_UP_S each: a lane settling one message after another waited that
    long for every one. Another consumer's acks keep their resends, and a confirmed ack
    takes the consumer off."""
    monkeypatch.setattr(ack, "NO_RESPONDERS_GIVE_UP_S", 0.1)
    gone: set[tuple[str, str]] = set()

    def to(consumer: str, seq: int) -> testing.FakeDelivery:
        return testing.FakeDelivery.make(seq=seq, consumer=consumer)

    async def confirm_to(d: testing.FakeDelivery) -> bool:
        return await ack.confirm(d, timeout_s=0.05, give_up_s=30.0, logger=LOGGER, gone=gone)

    first = to("old-e1", 1).fail_acks(10_000, nats.errors.NoRespondersError)
    assert await confirm_to(first) is False
    assert first.ack_attempts > 1
    assert gone == {("S", "old-e1")}
    later = to("old-e1", 2).fail_acks(10_000, nats.errors.NoRespondersError)
    with capture_logs() as logs:
        assert await confirm_to(later) is False
    assert later.ack_attempts == 1
    [warning] = events(logs, log.Event.ACK_GAVE_UP)
    assert warning["error"] == "NoRespondersError"
    # Only no responders: a lost reply to the same consumer is resent as before.
    lost = to("old-e1", 3).fail_acks(2)
    other = to("new-e2", 4).fail_acks(2, nats.errors.NoRespondersError)
    assert await confirm_to(lost) is True
    assert await confirm_to(other) is True
    assert (lost.ack_attempts, other.ack_attempts) == (3, 3)
    assert gone == set()
    again = to("old-e1", 5).fail_acks(2, nats.errors.NoRespondersError)
    assert await confirm_to(again) is True
    assert again.ack_attempts == 3


async def test_a_batch_confirmed_takes_its_consumer_off_the_gone_ones() -> None:
    """The gone consumers are shared by an Acker's batches and single acks: a batch's
    reply of no responders to one is given up at the first resend; a batch confirmed by
    a consumer (its leader elected again) takes it off."""
    acker = ack.Acker(FakeAckConnection({}))
    acker.gone.add(("S", "eop-test"))
    ds = deliveries(2)
    ds[0].fail_acks(10_000, nats.errors.NoRespondersError)
    nc = FakeAckConnection({ds[0].reply: "503"})
    acker._nc = nc
    assert await confirm_many(acker, ds, give_up_s=30.0) == [False, True]
    assert ds[0].ack_attempts == 1
    # ds[1] confirmed in the same batch: the consumer answers after all.
    assert acker.gone == set()
    acker.gone.add(("S", "eop-test"))
    acker._nc = FakeAckConnection({})
    assert await confirm_many(acker, deliveries(2)) == [True, True]
    assert acker.gone == set()


async def test_confirm_logs_each_retry_at_debug_level() -> None:
    d = testing.FakeDelivery.make().fail_acks(1)
    with capture_logs() as logs:
        await confirm(d)
    [retry] = events(logs, log.Event.ACK_RETRY)
    assert (retry["log_level"], retry["attempt"], retry["error"]) == ("debug", 1, "TimeoutError")


async def test_confirm_does_not_retry_an_unexpected_error() -> None:
    d = testing.FakeDelivery.make().fail_acks(1, nats.errors.BadSubscriptionError)
    with pytest.raises(nats.errors.BadSubscriptionError):
        await confirm(d)
    assert d.ack_attempts == 1


# ------------------------------------------------------------------ nak, term


async def test_nak_sends_the_delay() -> None:
    d = testing.FakeDelivery.make()
    await ack.nak(d, 2.5, LOGGER)
    assert (d.naked, d.nak_delay) == (True, 2.5)


@pytest.mark.parametrize("error", [nats.errors.TimeoutError, nats.errors.ConnectionClosedError])
async def test_a_failed_nak_is_swallowed(error: type[BaseException]) -> None:
    """A lost nak only means the redelivery waits for AckWait."""
    d = testing.FakeDelivery.make().fail("nak", 1, error)
    await ack.nak(d, 1.0, LOGGER)
    assert not d.naked


async def test_nak_of_an_already_settled_delivery_is_swallowed() -> None:
    d = testing.FakeDelivery.make()
    await d.ack_sync()
    await ack.nak(d, 1.0, LOGGER)
    assert (d.acked, d.naked) == (True, False)


async def test_term_tells_the_server_never_to_redeliver() -> None:
    d = testing.FakeDelivery.make()
    await ack.term(d, LOGGER)
    assert d.termed


async def test_a_failed_term_is_swallowed() -> None:
    """A lost term means a redelivery, which finds the inbox row and is acked."""
    d = testing.FakeDelivery.make().fail("term", 1)
    await ack.term(d, LOGGER)
    assert not d.termed


# ---------------------------------------------------------------- confirm_many


class FakeAckConnection:
    """Just enough of a nats-py client for :class:`ack.Acker`: replies as told per delivery."""

    def __init__(self, replies: dict[str, str | None]) -> None:
        self.replies = replies  # delivery reply subject -> "ok", "503" or None (lost)
        self.published: list[tuple[str, bytes, str]] = []
        self.subscriptions: list[str] = []
        self._cb: Any = None

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(self, subject: str, cb: Any) -> None:
        self.subscriptions.append(subject)
        self._cb = cb

    async def publish(self, subject: str, payload: bytes, reply: str) -> None:
        self.published.append((subject, payload, reply))
        answer = self.replies.get(subject, "ok")
        if answer is not None:
            headers = {"Status": answer} if answer != "ok" else None
            msg = types.SimpleNamespace(subject=reply, headers=headers, data=b"")
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._cb(msg)))


async def confirm_many(
    acker: ack.Acker, deliveries: list[testing.FakeDelivery], give_up_s: float = 0.2
) -> list[bool]:
    loggers = [LOGGER] * len(deliveries)
    return await acker.confirm_many(deliveries, loggers, timeout_s=0.05, give_up_s=give_up_s)


def deliveries(count: int) -> list[testing.FakeDelivery]:
    return [testing.FakeDelivery.make(seq=seq) for seq in range(1, count + 1)]


async def test_confirm_many_sends_every_ack_and_waits_for_the_replies_together() -> None:
    ds = deliveries(5)
    nc = FakeAckConnection({})
    acker = ack.Acker(nc)
    assert await confirm_many(acker, ds) == [True] * 5
    assert [(s, p) for s, p, _ in nc.published] == [(d.reply, b"+ACK") for d in ds]
    assert len({reply for _, _, reply in nc.published}) == 5
    # No per-message fallback: every reply came back on the shared subscription.
    assert all(d.ack_attempts == 0 for d in ds)
    assert await confirm_many(acker, deliveries(2)) == [True, True]
    assert nc.subscriptions == ["_INBOX.test.*"]
    assert acker._batches == []


async def test_replies_of_concurrent_batches_each_confirm_their_own_batch() -> None:
    """Two batches in flight on one Acker: a reply finds its batch by its token alone."""
    first, second = deliveries(3), [testing.FakeDelivery.make(seq=seq) for seq in (10, 11)]
    nc = FakeAckConnection({second[0].reply: None})
    acker = ack.Acker(nc)
    results = await asyncio.gather(confirm_many(acker, first), confirm_many(acker, second))
    assert results == [[True] * 3, [True, True]]
    # Only the lost reply's delivery took the per-message path.
    assert [d.ack_attempts for d in (*first, *second)] == [0, 0, 0, 1, 0]
    assert acker._batches == []


async def test_confirm_many_retries_a_lost_reply_with_the_confirmed_ack() -> None:
    ds = deliveries(3)
    nc = FakeAckConnection({ds[1].reply: None})
    assert await confirm_many(ack.Acker(nc), ds) == [True, True, True]
    assert [d.ack_attempts for d in ds] == [0, 1, 0]
    assert ds[1].acked


async def test_confirm_many_retries_no_responders_and_then_gives_up_with_a_warning() -> None:
    ds = deliveries(2)
    ds[0].fail_acks(10_000, nats.errors.NoRespondersError)
    nc = FakeAckConnection({ds[0].reply: "503"})
    with capture_logs() as logs:
        assert await confirm_many(ack.Acker(nc), ds, give_up_s=0.1) == [False, True]
    [warning] = events(logs, log.Event.ACK_GAVE_UP)
    assert warning["error"] == "NoRespondersError"
    assert ds[0].ack_attempts > 1


async def test_confirm_many_falls_back_to_single_acks_when_publishing_fails() -> None:
    class Reconnecting(FakeAckConnection):
        async def publish(self, subject: str, payload: bytes, reply: str) -> None:
            raise nats.errors.ConnectionReconnectingError

    ds = deliveries(3)
    assert await confirm_many(ack.Acker(Reconnecting({})), ds) == [True] * 3
    assert [d.ack_attempts for d in ds] == [1, 1, 1]


async def test_a_late_reply_after_the_fallback_is_ignored() -> None:
    ds = deliveries(1)
    nc = FakeAckConnection({ds[0].reply: None})
    acker = ack.Acker(nc)
    assert await confirm_many(acker, ds) == [True]
    late = types.SimpleNamespace(subject=nc.published[0][2], headers=None, data=b"")
    await acker._on_reply(late)  # nothing waits for it any more: no error
    assert acker._batches == []


async def test_a_reply_finds_its_batch_by_token_and_a_stray_token_confirms_nothing() -> None:
    """Batches own consecutive tokens: a reply confirms the ack of its token in its
    batch; a token outside every waiting batch (a finished batch's late reply) or not
    a number confirms nothing."""
    loop = asyncio.get_running_loop()
    acker = ack.Acker(FakeAckConnection({}))
    first = ack._Waiting(1, 3, loop.create_future())
    later = ack._Waiting(7, 2, loop.create_future())
    acker._batches[:] = [first, later]
    for stray in (b"0", b"4", b"6", b"9", b"x2", b""):
        acker._settle(stray, True)
    assert (first.confirmed, later.confirmed) == ([False] * 3, [False] * 2)
    acker._settle(b"2", True)
    acker._settle(b"8", True)
    assert (first.confirmed, later.confirmed) == ([False, True, False], [False, True])
