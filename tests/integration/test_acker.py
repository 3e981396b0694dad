"""A batch's confirmed acks against a real JetStream server (eop.broker.ack.Acker).

On eop's connections the acks of a batch are one command in nats-py's buffer
(``eop.broker.client.Client.publish_many``); on a plain nats-py client, one ``publish``
each. Either way every ack is confirmed by the server, an ack whose reply does
not come takes the per-message retries, and an armed ``during_ack`` fault
point is passed before each ack.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats
import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from eop import faults, log, nats_access
from eop.broker import ack, client, connection, fetcher
from eop.tools import embedded
from eop.tools.chaos.proxy import FaultProxy

STREAM, DURABLE, SUBJECT = "ACKED", "acker", "acked.x"
ACK_WAIT_S = 1.0


class Recorder:
    """A logger (:class:`eop.log.Logger`) that keeps the events it is given."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def bind(self, **more: Any) -> Recorder:
        return self

    def debug(self, event: str, **kw: Any) -> None:
        self.events.append(event)

    info = warning = error = debug


async def _stream(js: Any, count: int) -> None:
    await js.add_stream(name=STREAM, subjects=[SUBJECT])
    config = ConsumerConfig(
        durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S
    )
    await js.add_consumer(STREAM, config)
    for i in range(count):
        await js.publish(SUBJECT, f"m{i}".encode())


async def _connect(nats_url: str) -> client.Client:
    return await connection.connect_nats(
        nats_access.NatsAccess(url=nats_url), name="acker-test", max_reconnect_attempts=-1
    )


async def _fetch_all(f: fetcher.Fetcher, timeout_s: float = 2.0) -> list[Any]:
    """Every message the consumer gives until a quiet ``timeout_s``, each acked (so that
    it does not come back meanwhile)."""
    got: list[Any] = []
    while True:
        try:
            msgs = await f.fetch(64, timeout_s=timeout_s)
        except nats.errors.TimeoutError:
            return got
        for m in msgs:
            await m.ack_sync(timeout=10)
        got += msgs


async def _redelivered_after_ack_wait(f: fetcher.Fetcher) -> list[int]:
    """Stream sequences the server hands out again once AckWait has passed."""
    await asyncio.sleep(ACK_WAIT_S + 0.5)
    return [m.metadata.sequence.stream for m in await _fetch_all(f)]


async def _wait_until(condition: Any, what: str, bound_s: float = 30.0) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting for {what} after {bound_s} s")
        await asyncio.sleep(0.02)


def _counting_publishes(nc: Any) -> list[str]:
    """Record the subjects of the acks sent with ``nc.publish`` (one call per ack)."""
    subjects: list[str] = []
    publish = nc.publish

    async def counted(subject: str, *args: Any, **kwargs: Any) -> None:
        if subject.startswith("$JS.ACK."):
            subjects.append(subject)
        await publish(subject, *args, **kwargs)

    nc.publish = counted
    return subjects


# ---------------------------------------------------------------- publish_many


async def test_publish_many_delivers_each_payload_to_its_subject_with_its_reply(
    nats_url: str,
) -> None:
    """One buffer of PUB commands reaches a subscriber as the messages ``publish`` would
    send, in order, each with its own reply subject."""
    nc = await _connect(nats_url)
    try:
        sub = await nc.subscribe("many.*")
        await nc.flush()
        subjects = [f"many.{i}" for i in range(5)]
        await nc.publish_many(subjects, b"+ACK", [f"back.{i}" for i in range(5)])
        got = [await sub.next_msg(timeout=30) for _ in subjects]
        assert [(m.subject, m.reply, m.data) for m in got] == [
            (f"many.{i}", f"back.{i}", b"+ACK") for i in range(5)
        ]
        assert nc.stats["out_msgs"] == 5
    finally:
        await nc.close()


@pytest.mark.parametrize("bad", ["", "a b", "a\r\nPUB x 1", "a\tb", "a\nb"])
@pytest.mark.parametrize("where", ["subject", "reply"])
async def test_publish_many_refuses_an_unsafe_subject_and_sends_none_of_the_batch(
    nats_url: str, bad: str, where: str
) -> None:
    """A subject or reply that is empty or holds whitespace or CRLF (which would end the
    command and start another) raises ``BadSubjectError``, as ``publish`` does, and
    nothing of the batch is written, even with nats-py's subject validation skipped."""
    nc = await _connect(nats_url)
    nc._skip_subject_validation = True
    try:
        sub = await nc.subscribe("safe.*")
        await nc.flush()
        subjects, replies = ["safe.1", "safe.2"], ["r.1", "r.2"]
        (subjects if where == "subject" else replies)[1] = bad
        with pytest.raises(nats.errors.BadSubjectError):
            await nc.publish_many(subjects, b"x", replies)
        await nc.publish("safe.3", b"y")
        assert (await sub.next_msg(timeout=30)).subject == "safe.3"
        assert nc.stats["out_msgs"] == 1
    finally:
        await nc.close()


async def test_publish_many_raises_what_publish_raises_on_a_closed_or_reconnecting_connection(
    nats_url: str, nats_server: embedded.NatsServer
) -> None:
    """Closed: ``ConnectionClosedError``. Reconnecting without a pending buffer:
    ``OutboundBufferLimitError``. The errors the ack's retries already classify."""
    nc = client.Client()
    await nc.connect(nats_url, pending_size=0, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
    try:
        await asyncio.to_thread(nats_server.stop)
        await _wait_until(lambda: nc.is_reconnecting, "the client to reconnect")
        for send in (
            nc.publish("a.1", b"x", reply="r.1"),
            nc.publish_many(["a.1"], b"x", ["r.1"]),
        ):
            with pytest.raises(nats.errors.OutboundBufferLimitError):
                await send
        # Back first: nats-py's close() during a reconnect may raise CancelledError.
        await asyncio.to_thread(nats_server.start)
        await _wait_until(lambda: nc.is_connected, "the client to be back")
    finally:
        await nc.close()
    for send in (nc.publish("a.1", b"x", reply="r.1"), nc.publish_many(["a.1"], b"x", ["r.1"])):
        with pytest.raises(nats.errors.ConnectionClosedError):
            await send


# ---------------------------------------------------------------- confirm_many


async def test_batched_acks_are_all_confirmed_and_nothing_is_redelivered(
    nats_url: str, js: Any
) -> None:
    """Batches of 64 fetched and acked with ``confirm_many`` on eop's connection: every
    ack is confirmed from the batch's replies (no per-message publish, no retry), the
    consumer has nothing pending, and nothing comes back after AckWait."""
    await _stream(js, 150)
    nc = await _connect(nats_url)
    try:
        f = await fetcher.Fetcher(nc, STREAM, DURABLE).start()
        acker, recorder = ack.Acker(nc), Recorder()
        per_message = _counting_publishes(nc)
        seqs: list[int] = []
        while len(seqs) < 150:
            msgs = await f.fetch(64, timeout_s=30.0)
            confirmed = await acker.confirm_many(
                msgs, [recorder] * len(msgs), timeout_s=10.0, give_up_s=30.0
            )
            assert confirmed == [True] * len(msgs)
            seqs += [m.metadata.sequence.stream for m in msgs]
        assert seqs == list(range(1, 151))
        assert per_message == []  # every ack went out in publish_many's buffers
        assert recorder.events == []  # no retry, no warning
        info = await js.consumer_info(STREAM, DURABLE)
        assert (info.num_ack_pending, info.num_pending) == (0, 0)
        assert await _redelivered_after_ack_wait(f) == []
        await f.stop()
    finally:
        await nc.close()


async def test_acks_to_a_deleted_consumer_after_the_first_are_given_up_without_resends(
    nats_url: str, js: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ordered handler's lane acks one message after another; its partition's consumer
    is deleted under it (a new owner's epoch). The server answers no responders: the
    first ack is resent until NO_RESPONDERS_GIVE_UP_S, the next ones to that consumer are
    given up at their first answer. An ack to a consumer that exists is unaffected."""
    monkeypatch.setattr(ack, "NO_RESPONDERS_GIVE_UP_S", 0.3)
    await _stream(js, 3)
    await js.add_consumer(
        STREAM, ConsumerConfig(durable_name="alive", ack_policy=AckPolicy.EXPLICIT)
    )
    nc = await _connect(nats_url)
    try:
        f = await fetcher.Fetcher(nc, STREAM, DURABLE).start()
        msgs = await f.fetch(64, timeout_s=30.0)
        assert len(msgs) == 3
        await f.stop()
        alive = await fetcher.Fetcher(nc, STREAM, "alive").start()
        [kept, *_] = await alive.fetch(1, timeout_s=30.0)
        await js.delete_consumer(STREAM, DURABLE)
        acker = ack.Acker(nc)
        recorders = [Recorder() for _ in msgs]
        for m, recorder in zip(msgs, recorders, strict=True):
            assert await acker.confirm_many([m], [recorder], timeout_s=1.0, give_up_s=30.0) == [
                False
            ]
        first, *later = (r.events for r in recorders)
        assert first.count(log.Event.ACK_RETRY) > 1
        assert first[-1] == log.Event.ACK_GAVE_UP
        assert later == [[log.Event.ACK_GAVE_UP]] * 2
        other = Recorder()
        assert await acker.confirm_many([kept], [other], timeout_s=1.0, give_up_s=30.0) == [True]
        assert other.events == []
        await alive.stop()
    finally:
        await nc.close()


async def test_a_plain_nats_py_client_confirms_a_batch_one_publish_per_ack(
    nc: Any, js: Any
) -> None:
    """Not an eop connection: the old path, one ``publish`` per ack, still confirms all."""
    await _stream(js, 10)
    f = await fetcher.Fetcher(nc, STREAM, DURABLE).start()
    per_message = _counting_publishes(nc)
    msgs = await f.fetch(64, timeout_s=30.0)
    confirmed = await ack.Acker(nc).confirm_many(
        msgs, [Recorder()] * len(msgs), timeout_s=10.0, give_up_s=30.0
    )
    assert confirmed == [True] * 10
    assert per_message == [m.reply for m in msgs]
    assert await _redelivered_after_ack_wait(f) == []
    await f.stop()


async def test_lost_replies_in_a_batch_send_only_those_acks_again_one_by_one(
    nats_server: embedded.NatsServer, js: Any
) -> None:
    """Through a proxy that loses the replies to two of a batch's acks: the others are
    confirmed from the batch's replies, and only those two acks are sent again, each
    as a confirmed ack of its own."""
    await _stream(js, 8)
    proxy = FaultProxy("127.0.0.1", nats_server.port, protocol="nats")
    await proxy.start()
    nc = await _connect(f"nats://127.0.0.1:{proxy.port}")
    try:
        f = await fetcher.Fetcher(nc, STREAM, DURABLE).start()
        msgs = await f.fetch(64, timeout_s=30.0)
        assert len(msgs) == 8
        per_message = _counting_publishes(nc)
        proxy.drop_next_reply()
        proxy.drop_next_reply()
        confirmed = await ack.Acker(nc).confirm_many(
            msgs, [Recorder()] * 8, timeout_s=0.5, give_up_s=30.0
        )
        assert confirmed == [True] * 8
        assert proxy.stats["dropped_ack_replies"] == 2
        assert per_message == [msgs[0].reply, msgs[1].reply]
        assert await _redelivered_after_ack_wait(f) == []
        await f.stop()
    finally:
        await nc.close()
        await proxy.close()


async def test_a_server_restart_mid_batch_leaves_the_acks_to_the_per_message_retries(
    nats_url: str, nats_server: embedded.NatsServer, js: Any
) -> None:
    """The server goes away after the fetch: the batch's acks are buffered while the
    client reconnects, their replies do not come in time, and every ack takes the
    per-message path, retried through the restart. An ack the server confirmed is
    never redelivered; one given up (with its warning) is."""
    await _stream(js, 10)
    nc = await _connect(nats_url)
    try:
        f = await fetcher.Fetcher(nc, STREAM, DURABLE).start()
        msgs = await f.fetch(64, timeout_s=30.0)
        assert len(msgs) == 10
        # nats-server writes a consumer's delivered state 10 ms after a change, and a
        # stop during that write can lose its tail: the server then ignores the acks
        # of deliveries it no longer knows of (they are given up, and redelivered).
        await asyncio.sleep(0.2)
        await asyncio.to_thread(nats_server.stop)
        await _wait_until(lambda: nc.is_reconnecting, "the client to reconnect")
        loggers = [Recorder() for _ in msgs]
        acking = asyncio.create_task(
            ack.Acker(nc).confirm_many(msgs, loggers, timeout_s=0.5, give_up_s=10.0)
        )
        await _wait_until(
            lambda: all(log.Event.ACK_RETRY in lg.events for lg in loggers),
            "every ack to be retried on its own",
        )
        await asyncio.to_thread(nats_server.start)
        confirmed = await acking
        assert any(confirmed)
        gave_up = [log.Event.ACK_GAVE_UP in lg.events for lg in loggers]
        assert gave_up == [not ok for ok in confirmed]
        await _wait_until(lambda: nc.is_connected, "the client to be back")
        redelivered = await _redelivered_after_ack_wait(f)
        seqs = [m.metadata.sequence.stream for m in msgs]
        assert sorted(redelivered) == [
            seq for seq, ok in zip(seqs, confirmed, strict=True) if not ok
        ]
        await f.stop()
    finally:
        await nc.close()


async def test_an_armed_during_ack_point_is_passed_before_each_ack_of_a_batch(
    nats_url: str, js: Any
) -> None:
    """Armed, ``during_ack`` fires per message: raising at the 5th pass of a batch of 8
    leaves the first 4 acked (sent before it) and the other 4 to be redelivered."""
    await _stream(js, 8)
    nc = await _connect(nats_url)
    try:
        f = await fetcher.Fetcher(nc, STREAM, DURABLE).start()
        msgs = await f.fetch(64, timeout_s=30.0)
        assert len(msgs) == 8
        faults.arm([faults.Rule("during_ack", "raise", nth=5)], seed=1)
        try:
            with pytest.raises(faults.FaultInjected):
                await ack.Acker(nc).confirm_many(
                    msgs, [Recorder()] * 8, timeout_s=10.0, give_up_s=30.0
                )
        finally:
            faults.disarm()
        await nc.flush()
        assert sorted(await _redelivered_after_ack_wait(f)) == [5, 6, 7, 8]
        await f.stop()
    finally:
        await nc.close()


async def test_faults_armed_at_other_points_leave_the_acks_in_one_buffer(
    nats_url: str, js: Any
) -> None:
    """Only a rule at ``during_ack`` needs the per-message path: a chaos worker armed
    elsewhere acks its batches with ``publish_many``, under the faults it suffers."""
    await _stream(js, 8)
    nc = await _connect(nats_url)
    try:
        f = await fetcher.Fetcher(nc, STREAM, DURABLE).start()
        per_message = _counting_publishes(nc)
        msgs = await f.fetch(64, timeout_s=30.0)
        faults.arm([faults.Rule("after_claim", "raise", nth=1000)], seed=1)
        try:
            confirmed = await ack.Acker(nc).confirm_many(
                msgs, [Recorder()] * len(msgs), timeout_s=10.0, give_up_s=30.0
            )
        finally:
            faults.disarm()
        assert confirmed == [True] * 8
        assert per_message == []
        await f.stop()
    finally:
        await nc.close()
