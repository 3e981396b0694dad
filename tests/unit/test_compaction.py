"""When compaction rounds run: by interval, and by the count of processed messages."""

from __future__ import annotations

import asyncio
import types
from typing import Any

from eop.handler import HandlerSpec
from eop.protocol import compaction
from eop.settings import Settings


class CountingCompactor(compaction.Compactor):
    """A compactor whose rounds only count (no server, no database)."""

    rounds = 0

    async def compact_once(self) -> compaction.Compacted | None:
        self.rounds += 1
        return None


async def noop(msg: Any, session: Any) -> None:
    """A handler that does nothing."""


def compactor(**settings: Any) -> CountingCompactor:
    store: Any = types.SimpleNamespace(app=types.SimpleNamespace(settings=Settings(**settings)))
    spec = HandlerSpec(func=noop, name="orders", stream="ORDERS", subject="o", durable="eop-o")
    return CountingCompactor(None, store, spec, epochs=None)  # type: ignore[arg-type]


async def run_for(c: CountingCompactor, seconds: float, interval_s: float) -> None:
    stopping = asyncio.Event()
    task = asyncio.create_task(c.run_forever(interval_s, stopping))
    await asyncio.sleep(seconds)
    stopping.set()
    await asyncio.wait_for(task, 5)


async def test_enough_processed_messages_start_a_round_long_before_the_interval() -> None:
    c = compactor(compaction_after_messages=100)
    stopping = asyncio.Event()
    task = asyncio.create_task(c.run_forever(3600, stopping))
    await asyncio.sleep(0.01)
    c.processed(99)
    await asyncio.sleep(0.05)
    assert c.rounds == 0
    c.processed(1)
    for _ in range(100):
        await asyncio.sleep(0.01)
        if c.rounds:
            break
    assert c.rounds == 1
    # The count starts again from zero after a round.
    c.processed(50)
    await asyncio.sleep(0.05)
    assert c.rounds == 1
    stopping.set()
    await asyncio.wait_for(task, 5)


async def test_a_zero_message_count_compacts_by_interval_only() -> None:
    c = compactor(compaction_after_messages=0)
    c.processed(10**6)
    await run_for(c, 0.3, interval_s=0.1)
    assert 1 <= c.rounds <= 3


async def test_stopping_ends_the_loop_without_a_round() -> None:
    c = compactor()
    await run_for(c, 0.05, interval_s=3600)
    assert c.rounds == 0
