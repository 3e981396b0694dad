"""Scenario (a): what consumer info shows around an ack, confirmed or not (pure nats-py).

A memory stream holds A and B; a durable pull consumer with explicit acks
fetches one message at a time. A confirmed ack (``Msg.ack_sync``) has been
applied when it returns, so consumer info never shows it pending; a plain
``ack()`` is fire-and-forget, so consumer info read right after it may.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from nats.js.api import AckPolicy, ConsumerConfig, StorageType

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import pytest
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
    from nats.js.api import ConsumerInfo

STREAM = "SCENARIO_A"
CYCLES = 20


async def setup_stream(js: JetStreamContext) -> None:
    await js.add_stream(name=STREAM, subjects=["scenario.a.*"], storage=StorageType.MEMORY)
    await js.publish("scenario.a.A", b"A")
    await js.publish("scenario.a.B", b"B")


async def fetch_first(js: JetStreamContext, durable: str) -> tuple[Msg, ConsumerInfo]:
    """Start a fresh consumer, check the starting counts, fetch A; return A and the info after."""
    config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT)
    psub = await js.pull_subscribe("scenario.a.*", durable=durable, stream=STREAM, config=config)
    info = await js.consumer_info(STREAM, durable)
    assert (info.num_pending, info.num_ack_pending) == (2, 0)
    [msg] = await psub.fetch(1, timeout=2)
    assert msg.data == b"A"
    info = await js.consumer_info(STREAM, durable)
    assert (info.num_pending, info.num_ack_pending) == (1, 1)
    return msg, info


async def test_confirmed_ack_is_visible_in_consumer_info_at_once(js: JetStreamContext) -> None:
    """After ack_sync returns, consumer info reads ack-pending 0, every time."""
    await setup_stream(js)
    for cycle in range(CYCLES):
        durable = f"confirmed_{cycle}"
        msg, _ = await fetch_first(js, durable)
        await msg.ack_sync(timeout=2)
        info = await js.consumer_info(STREAM, durable)
        assert (info.num_pending, info.num_ack_pending) == (1, 0), f"cycle {cycle}"
        assert info.ack_floor is not None
        assert info.ack_floor.stream_seq == 1


async def test_plain_ack_may_still_read_pending_right_after(
    js: JetStreamContext, capsys: pytest.CaptureFixture[str], record_property: Callable[..., None]
) -> None:
    """A plain ack() can lag behind consumer info: count how often; it settles to 0 shortly."""
    await setup_stream(js)
    stale = 0
    for cycle in range(CYCLES):
        durable = f"plain_{cycle}"
        msg, _ = await fetch_first(js, durable)
        await msg.ack()
        info = await js.consumer_info(STREAM, durable)
        stale += info.num_ack_pending == 1
        await wait_until(lambda d=durable: ack_pending(js, d), expected=0)
    record_property("plain_ack_stale_reads", stale)
    with capsys.disabled():
        print(
            f"\n[scenario a] consumer info read ack-pending 1 right after a plain ack() "
            f"in {stale} of {CYCLES} cycles; after ack_sync(): 0 of {CYCLES}"
        )


async def ack_pending(js: JetStreamContext, durable: str) -> int:
    info = await js.consumer_info(STREAM, durable)
    return info.num_ack_pending


async def wait_until(read: Callable[[], Awaitable[int]], *, expected: int) -> None:
    """Poll ``read`` for up to a second until it returns ``expected``."""
    value = await read()
    for _ in range(100):
        if value == expected:
            return
        await asyncio.sleep(0.01)
        value = await read()
    assert value == expected
