"""The messages in flight: what a failure of eop's own I/O says about them."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from eop import log, testing
from eop.broker.leases import Leases
from eop.handler import HandlerSpec
from eop.message import Message
from eop.observe import observer as observe
from eop.protocol import processor
from eop.runtime import inflight
from eop.runtime.slots import Slots

from .support import FAST, STREAM, delivery, effect_of


def test_a_failed_groups_line_names_its_stream_and_sequences() -> None:
    """`message.failed` gives the stream and the first and last sequence as fetched, as
    `batch.processed` does, so an operator can find the messages it nak'ed."""
    msgs = [delivery(seq=7), delivery(seq=3), delivery(seq=9)]
    assert inflight._coordinates(msgs) == {
        "stream": STREAM,
        "first_seq": 7,
        "last_seq": 9,
        "messages": 3,
    }


def test_a_failed_groups_line_survives_metadata_it_cannot_read() -> None:
    """A delivery whose metadata cannot be read leaves the count only: a failure's line
    must not fail."""

    class Unreadable:
        @property
        def metadata(self) -> Any:
            raise ValueError("not a JetStream reply subject")

    assert inflight._coordinates([Unreadable()]) == {"messages": 1}  # type: ignore[list-item]


async def test_a_contended_batch_gives_each_slot_back_as_its_message_settles() -> None:
    """After a deadlock a batch runs one message at a time: each message's slot and lease
    go back as it settles, for the process's other loops, and the batch's end gives back
    only the rest, so the budget comes out whole (never more than ``concurrency``)."""
    spec = HandlerSpec(
        func=_record, name="orders", stream=STREAM, subject="orders.>", durable="eop-orders"
    )
    store = testing.MemoryStore()
    proc = processor.Processor(
        spec=spec, settings=FAST, store=store, epochs=testing.FakeEpochs({STREAM: "e1"})
    )
    proc.contention.note()
    slots, leases = Slots(8), Leases()
    free_while_running: list[int] = []
    flight = inflight.InFlight(
        FAST,
        slots=slots,
        leases=leases,
        stopping=asyncio.Event(),
        observer=observe.Observer(),
        logger=log.get_logger(),
        count=lambda spec, n: None,
    )
    msgs = [delivery(seq=seq) for seq in (1, 2, 3)]
    assert await slots.take(3) == 3
    now = proc.clock()
    leases.hold(msgs, 30.0, at=now)

    async def watching(msg: Message, session: Any) -> None:
        free_while_running.append(slots.free)
        await _record(msg, session)

    proc.spec = dataclasses.replace(spec, func=watching)
    await flight.process(proc, msgs, received_at=now)
    assert free_while_running == [5, 6, 7]
    assert slots.free == 8
    assert len(leases) == 0
    await leases.close()


async def _record(msg: Message, session: Any) -> None:
    session.add(effect_of(msg))
