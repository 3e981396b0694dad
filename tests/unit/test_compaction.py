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
    deleted: int | None = None
    """Rows each round reports deleted (None: the round did nothing)."""

    async def compact_once(self) -> compaction.Compacted | None:
        self.rounds += 1
        if self.deleted is None:
            return None
        return compaction.Compacted(epoch="e", watermark=1, deleted=self.deleted)


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


async def wait_rounds(c: CountingCompactor, rounds: int) -> None:
    for _ in range(100):
        await asyncio.sleep(0.01)
        if c.rounds >= rounds:
            break


async def test_enough_processed_messages_start_a_round_long_before_the_interval() -> None:
    """The first round comes after a quarter of compaction_after_messages (the process
    count is unknown yet); once a round deleted no more rows than its process handled
    (one process), the next comes after the whole count."""
    c = compactor(compaction_after_messages=100)
    c.deleted = 25
    stopping = asyncio.Event()
    task = asyncio.create_task(c.run_forever(3600, stopping))
    await asyncio.sleep(0.01)
    c.processed(24)
    await asyncio.sleep(0.05)
    assert c.rounds == 0
    c.processed(1)
    await wait_rounds(c, 1)
    assert c.rounds == 1
    # The count starts again from zero after a round, up to the whole batch now.
    c.deleted = 100
    c.processed(99)
    await asyncio.sleep(0.05)
    assert c.rounds == 1
    c.processed(1)
    await wait_rounds(c, 2)
    assert c.rounds == 2
    stopping.set()
    await asyncio.wait_for(task, 5)


def test_a_watermark_that_rose_by_other_processes_messages_brings_the_next_round_forward() -> None:
    """A watermark that rose by twice the messages this process handled since its last
    round (two processes) halves the next count, so the floor runs about one batch ahead
    of the watermark; never below an eighth of the batch; the whole batch when it rose by
    no more than this process's own (one process)."""
    c = compactor(compaction_after_messages=1000)
    c._adapt(own=500, rose=1000)
    assert c._threshold == 500
    c._adapt(own=250, rose=1000)
    assert c._threshold == 250
    c._adapt(own=10, rose=100_000)  # a restart's leftovers
    assert c._threshold == 125
    c._adapt(own=1000, rose=900)
    assert c._threshold == 1000
    c._adapt(own=0, rose=500)
    assert c._threshold == 1000


async def test_a_round_that_found_its_rows_deleted_by_the_other_process_keeps_its_share() -> None:
    """Two processes' rounds falling together: the second finds the rows gone (deleted 0)
    but the watermark rose by both processes' messages, so its next round still comes
    after its share of the batch, not a whole batch of its own (which let the inbox hold
    two batches in the long run)."""
    c = compactor(compaction_after_messages=1000)
    rounds = iter(
        [
            compaction.Compacted(epoch="e", watermark=1000, deleted=1000),
            compaction.Compacted(epoch="e", watermark=2000, deleted=0),
        ]
    )

    async def compact_once() -> compaction.Compacted | None:
        return next(rounds)

    c.compact_once = compact_once  # type: ignore[method-assign]
    await c._round(500)
    assert c._threshold == 500
    await c._round(500)  # its rows were deleted by the other process's round
    assert c._threshold == 500


async def test_a_zero_message_count_compacts_by_interval_only() -> None:
    c = compactor(compaction_after_messages=0)
    c.processed(10**6)
    await run_for(c, 0.3, interval_s=0.1)
    assert 1 <= c.rounds <= 3


async def test_stopping_ends_the_loop_without_a_round() -> None:
    c = compactor()
    await run_for(c, 0.05, interval_s=3600)
    assert c.rounds == 0
