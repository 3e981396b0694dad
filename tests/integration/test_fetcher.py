"""eop.broker.fetcher.Fetcher against a real JetStream pull consumer."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from eop.broker import fetcher

STREAM, DURABLE = "FETCHED", "fetcher"


async def _consumer(js: Any) -> None:
    await js.add_stream(name=STREAM, subjects=["fetched.>"])
    await js.add_consumer(
        STREAM, ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT)
    )


async def _publish(js: Any, count: int, first: int = 0) -> None:
    for i in range(first, first + count):
        await js.publish("fetched.x", f"m{i}".encode())


async def test_a_fetch_returns_what_is_there_in_order_and_the_rest_comes_next(
    nc: Any, js: Any
) -> None:
    """Every message once, in stream order, in batches of at most the size asked for;
    a partial batch is returned when the server says it has no more (no timeout)."""
    await _consumer(js)
    await _publish(js, 100)
    f = await fetcher.Fetcher(nc, STREAM, DURABLE).start()
    sizes, bodies = [], []
    for _ in range(2):
        # A generous bound: a fetch that waited for a full batch would hit it.
        msgs = await asyncio.wait_for(f.fetch(64, timeout_s=30.0), 10.0)
        sizes.append(len(msgs))
        bodies += [m.data.decode() for m in msgs]
        for m in msgs:
            await m.ack()
    assert sizes == [64, 36]
    assert bodies == [f"m{i}" for i in range(100)]
    assert {m.metadata.sequence.stream for m in msgs} == set(range(65, 101))
    await f.stop()


async def test_a_fetch_on_a_quiet_stream_returns_the_first_message_that_comes(
    nc: Any, js: Any
) -> None:
    """With nothing there, the fetch waits (lingering request) and returns as soon as one
    message arrives instead of waiting for its batch to fill; with nothing, it times out.
    It says when it starts to linger (the caller gives back the room kept for a batch),
    and a fetch that finds messages at once never does."""
    await _consumer(js)
    f = await fetcher.Fetcher(nc, STREAM, DURABLE).start()
    lingered: list[int] = []
    with pytest.raises(nats.errors.TimeoutError):
        await f.fetch(64, timeout_s=0.3, lingering=lambda: lingered.append(1))
    assert lingered == [1]

    async def later() -> None:
        await asyncio.sleep(0.2)
        await _publish(js, 1)

    publisher = asyncio.create_task(later())
    msgs = await asyncio.wait_for(f.fetch(64, timeout_s=30.0), 10.0)
    await publisher
    assert [m.data for m in msgs] == [b"m0"]
    await _publish(js, 3, first=1)
    found = await f.fetch(64, timeout_s=30.0, lingering=lambda: lingered.append(2))
    assert [m.data for m in found] == [b"m1", b"m2", b"m3"]
    assert lingered == [1]
    await f.stop()


async def test_a_fetch_from_a_deleted_consumer_raises_an_api_error(nc: Any, js: Any) -> None:
    """The worker's recovery (re-provisioning the consumer) needs an error, not a timeout."""
    await _consumer(js)
    f = await fetcher.Fetcher(nc, STREAM, DURABLE).start()
    await js.delete_consumer(STREAM, DURABLE)
    with pytest.raises(nats.js.errors.APIError):
        await f.fetch(8, timeout_s=2.0)
    await f.stop()


async def test_a_fetch_never_returns_more_than_its_batch_and_keeps_late_messages(
    nc: Any, js: Any
) -> None:
    """Messages beyond the batch (a timed-out request's late delivery) are kept for the
    next fetch, not added to the current one: the worker's slots count on the bound."""
    await _consumer(js)
    f = await fetcher.Fetcher(nc, STREAM, DURABLE).start()
    await _publish(js, 8)
    # A fetch for 3, and at the same moment a request for 5 under a reply subject
    # of the fetcher's that no fetch waits on (as a timed-out request's would be).
    fetching = asyncio.create_task(f.fetch(3, timeout_s=30.0))
    await nc.publish(
        f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{DURABLE}",
        b'{"batch": 5, "expires": 5000000000}',
        reply=f._prefix + "0",
    )
    first = await asyncio.wait_for(fetching, 10.0)
    assert len(first) <= 3
    seen = list(first)
    while len(seen) < 8:
        seen += await asyncio.wait_for(f.fetch(3, timeout_s=5.0), 10.0)
    assert sorted(m.data for m in seen) == sorted(f"m{i}".encode() for i in range(8))
    await f.stop()
