"""Reading a stream's epochs ahead of the batch that needs them (StreamEpochs.read_ahead)."""

from __future__ import annotations

import asyncio
import datetime
import gc
import json
import types

from eop.broker import jetstream

_CREATED = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


def _stamp(at: datetime.datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.%f000Z")


class _Server:
    """A client whose STREAM.INFO reports epoch ``e1`` at the server time ``now``, after
    ``gate`` opens; counts the readings."""

    def __init__(self) -> None:
        self.now = _CREATED + datetime.timedelta(hours=1)
        self.asked = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def request(self, subject: str, payload: bytes, timeout: float) -> object:
        self.asked += 1
        await self.gate.wait()
        info = {
            "created": _stamp(_CREATED),
            "ts": _stamp(self.now),
            "config": {"metadata": {jetstream.EPOCH_METADATA_KEY: "e1"}},
            "state": {"first_seq": 1},
        }
        return types.SimpleNamespace(data=json.dumps(info).encode())


async def _settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_reading_started_ahead_serves_the_batch_that_needs_it() -> None:
    """A message newer than the last reading needs a new one: read_ahead starts it at
    once, and the batch's own epoch_of waits for that reading instead of asking again."""
    server = _Server()
    epochs = jetstream.StreamEpochs(server)  # type: ignore[arg-type]  # a fake client
    await epochs.refresh("ORDERS")
    assert server.asked == 1
    stored = server.now + datetime.timedelta(seconds=1)
    server.now += datetime.timedelta(seconds=2)
    server.gate.clear()
    epochs.read_ahead("ORDERS", stored)
    await _settled()
    assert server.asked == 2
    epochs.read_ahead("ORDERS", stored)  # a reading is under way: nothing more
    waiting = asyncio.ensure_future(epochs.epoch_of("ORDERS", stored))
    await _settled()
    assert not waiting.done()
    server.gate.set()
    assert await waiting == "e1"
    assert server.asked == 2


async def test_nothing_is_read_ahead_for_a_message_the_last_reading_covers() -> None:
    """A message stored before the last reading (a backlog) or on a stream never read
    starts no reading."""
    server = _Server()
    epochs = jetstream.StreamEpochs(server)  # type: ignore[arg-type]  # a fake client
    epochs.read_ahead("ORDERS", server.now)
    await _settled()
    assert server.asked == 0
    await epochs.refresh("ORDERS")
    epochs.read_ahead("ORDERS", server.now - datetime.timedelta(seconds=1))
    epochs.read_ahead("ORDERS", None)
    await _settled()
    assert server.asked == 1
    assert await epochs.epoch_of("ORDERS", server.now) == "e1"
    assert server.asked == 1


async def test_a_failed_reading_ahead_is_left_to_the_batch() -> None:
    """A reading ahead that fails raises nowhere (no unretrieved task error): the
    batch's epoch_of asks again and reports what it gets."""

    class _Failing(_Server):
        async def request(self, subject: str, payload: bytes, timeout: float) -> object:
            if self.asked == 1:
                self.asked += 1
                raise jetstream.errors.ConfigurationError("stream gone")
            return await super().request(subject, payload, timeout)

    unretrieved: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, c: unretrieved.append(c))
    server = _Failing()
    epochs = jetstream.StreamEpochs(server)  # type: ignore[arg-type]  # a fake client
    await epochs.refresh("ORDERS")
    stored = server.now + datetime.timedelta(seconds=1)
    server.now += datetime.timedelta(seconds=2)
    epochs.read_ahead("ORDERS", stored)
    await _settled()
    assert server.asked == 2
    gc.collect()
    assert unretrieved == []
    assert await epochs.epoch_of("ORDERS", stored) == "e1"
    assert server.asked == 3


async def test_the_current_epoch_has_existed_since_its_creation_by_the_servers_clock() -> None:
    """``current_for`` is the server's time at the last reading minus the current epoch's
    creation (never the worker's clock); None for a stream never read, or when the epoch
    named is not the newest one read: compaction's sweep of earlier epochs waits on it."""
    server = _Server()
    epochs = jetstream.StreamEpochs(server)  # type: ignore[arg-type]  # a fake client
    assert epochs.current_for("ORDERS", "e1") is None
    await epochs.refresh("ORDERS")
    assert epochs.current_for("ORDERS", "e1") == datetime.timedelta(hours=1)
    server.now += datetime.timedelta(minutes=5)
    await epochs.refresh("ORDERS")
    assert epochs.current_for("ORDERS", "e1") == datetime.timedelta(hours=1, minutes=5)
    assert epochs.current_for("ORDERS", "e0") is None


async def test_a_settlements_reading_is_shared_while_fresh_and_bounded_in_time() -> None:
    """``read_within`` asks the server only when the last reading is older than asked, and
    one reading serves the callers meanwhile; a server that does not answer in time is
    unknown (None), a stream that is gone is False (eop.broker.fence)."""
    server = _Server()
    epochs = jetstream.StreamEpochs(server)  # type: ignore[arg-type]  # a fake client
    assert await epochs.read_within("ORDERS", 60.0, 1.0) is True
    assert await epochs.read_within("ORDERS", 60.0, 1.0) is True
    assert server.asked == 1
    epochs._read_at["ORDERS"] -= 120.0  # the last reading is two minutes old now
    together = [epochs.read_within("ORDERS", 60.0, 1.0) for _ in range(3)]
    assert await asyncio.gather(*together) == [True, True, True]
    assert server.asked == 2  # one reading for the three
    server.gate.clear()
    assert await epochs.read_within("ORDERS", 0.0, 0.05) is None
    server.gate.set()

    class Gone(_Server):
        async def request(self, subject: str, payload: bytes, timeout: float) -> object:
            return types.SimpleNamespace(data=b'{"error": {"description": "stream not found"}}')

    gone = jetstream.StreamEpochs(Gone())  # type: ignore[arg-type]
    assert await gone.read_within("ORDERS", 60.0, 1.0) is False
    assert epochs.of_current("ORDERS", _CREATED) is True
    assert epochs.of_current("ORDERS", _CREATED - datetime.timedelta(microseconds=1)) is False
