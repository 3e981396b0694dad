"""Batch preparation: one epoch look-up for a batch that one epoch holds, per message otherwise."""

from __future__ import annotations

import datetime
from typing import Any

from eop import testing
from eop.handler import HandlerSpec
from eop.protocol import batch, processor

from .support import FAST

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
RECREATED = T0 + datetime.timedelta(seconds=10)


class TwoEpochs:
    """A stream recreated at RECREATED: "e1" before, "e2" from then on; counts look-ups."""

    def __init__(self) -> None:
        self.lookups = 0

    async def epoch_of(self, stream: str, stored_at: datetime.datetime | None) -> str | None:
        self.lookups += 1
        assert stored_at is not None
        return "e2" if stored_at >= RECREATED else "e1"

    async def refresh(self, stream: str) -> str:
        return "e2"


async def noop(msg: Any, session: Any) -> None:
    """A handler that does nothing."""


def batch_processor(epochs: TwoEpochs) -> batch.BatchProcessor:
    spec = HandlerSpec(func=noop, name="orders", stream="S", subject="s", durable="eop-orders")
    single = processor.Processor(
        spec=spec, settings=FAST, store=testing.MemoryStore(), epochs=epochs
    )
    return batch.BatchProcessor(single)


def deliveries(*seconds: int) -> list[testing.FakeDelivery]:
    return [
        testing.FakeDelivery.make(seq=i, timestamp=T0 + datetime.timedelta(seconds=s))
        for i, s in enumerate(seconds, 1)
    ]


async def test_a_batch_within_one_epoch_needs_two_lookups_whatever_its_size() -> None:
    epochs = TwoEpochs()
    bp = batch_processor(epochs)
    items, others = await bp._prepare(deliveries(*range(8)), bp.single.clock())
    assert [i.msg.stream_epoch for i in items] == ["e1"] * 8
    assert others == []
    assert epochs.lookups == 2


async def test_a_batch_across_a_recreated_stream_gets_each_messages_own_epoch() -> None:
    epochs = TwoEpochs()
    bp = batch_processor(epochs)
    items, _ = await bp._prepare(deliveries(8, 9, 10, 11), bp.single.clock())
    assert [i.msg.stream_epoch for i in items] == ["e1", "e1", "e2", "e2"]
