"""Reading sequence ranges of a real stream, as the jetstream source's tasks do (no Spark)."""

from __future__ import annotations

from typing import Any

import pytest
from nats.js import api

from eop.contrib.spark import errors, offsets, reader
from eop.contrib.spark.offsets import SeqRange
from eop.message import Message, from_nats

pytestmark = pytest.mark.integration

STREAM = "ORDERS"


async def make_stream(js: Any, count: int, **config: Any) -> None:
    """ORDERS with ``count`` messages, every third on ORDERS.cancelled, the rest ORDERS.created."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"], **config)
    for i in range(1, count + 1):
        subject = "ORDERS.cancelled" if i % 3 == 0 else "ORDERS.created"
        headers = {"Nats-Msg-Id": f"id-{i}", "X-Tenant": "t1"} if i % 2 else None
        await js.publish(subject, f"m{i}".encode(), headers=headers)


async def read_all(nc: Any, seqs: SeqRange) -> list[reader.Row]:
    """Every row of a range."""
    return [row async for batch in reader.read_range(nc, seqs) for row in batch]


async def consumers(js: Any) -> int:
    """Consumers of the stream (the reader's are temporary)."""
    return int((await js.stream_info(STREAM)).state.consumer_count)


async def test_a_range_reads_every_stored_message_of_its_subject_once_in_order(
    nc: Any, js: Any
) -> None:
    """Deleted messages are gaps, other subjects are filtered; the consumer is deleted after."""
    await make_stream(js, 20)
    await js.delete_msg(STREAM, 5)
    state = await reader.stream_state(nc, STREAM)
    rows = await read_all(nc, SeqRange(STREAM, state.epoch, "ORDERS.created", 2, 15))
    expected = [s for s in range(2, 15) if s % 3 and s != 5]
    assert [row[1] for row in rows] == expected
    assert await consumers(js) == 0
    raw = await js.get_msg(STREAM, 7)
    row = next(r for r in rows if r[1] == 7)
    assert row[2:6] == (raw.subject, "id-7", dict(raw.headers), raw.data)
    assert row[7] == state.epoch


async def test_the_fingerprint_of_a_row_is_the_workers_fingerprint(nc: Any, js: Any) -> None:
    """Rows carry subject, msg-id and payload exactly as eop.message.from_nats builds them."""
    await make_stream(js, 3)
    state = await reader.stream_state(nc, STREAM)
    (row,) = await read_all(nc, SeqRange(STREAM, state.epoch, None, 1, 2))
    sub = await js.pull_subscribe("ORDERS.created", durable="check")
    (delivered,) = await sub.fetch(1)
    worker_view = from_nats(delivered, subscription="h", stream_epoch=state.epoch)
    spark_view = Message("h", row[2], row[5], row[4], row[0], row[7], row[1], 1)
    assert spark_view.fingerprint == worker_view.fingerprint


async def test_an_empty_range_and_a_range_past_the_end_read_nothing(nc: Any, js: Any) -> None:
    """No rows, and no consumer left behind."""
    await make_stream(js, 3)
    state = await reader.stream_state(nc, STREAM)
    assert await read_all(nc, SeqRange(STREAM, state.epoch, None, 2, 2)) == []
    assert await read_all(nc, SeqRange(STREAM, state.epoch, None, 4, 9)) == []
    assert await consumers(js) == 0


async def test_a_range_that_retention_removed_fails_instead_of_reading_less(
    nc: Any, js: Any
) -> None:
    """max_msgs dropped the oldest messages: reading them is an error, not a short read."""
    await make_stream(js, 10, max_msgs=4)
    state = await reader.stream_state(nc, STREAM)
    assert state.earliest == 7
    with pytest.raises(errors.RangeUnavailable, match=r"no longer holds sequences 5\.\.6"):
        await read_all(nc, SeqRange(STREAM, state.epoch, None, 5, 9))
    assert [r[1] for r in await read_all(nc, SeqRange(STREAM, state.epoch, None, 7, 11))] == [
        7,
        8,
        9,
        10,
    ]
    assert await consumers(js) == 0


async def test_a_recreated_stream_is_not_read_with_old_offsets(nc: Any, js: Any) -> None:
    """The epoch changes with the stream: old ranges name other messages now."""
    await make_stream(js, 3)
    old = await reader.stream_state(nc, STREAM)
    await js.delete_stream(STREAM)
    await make_stream(js, 3)
    with pytest.raises(errors.StreamRecreated):
        await read_all(nc, SeqRange(STREAM, old.epoch, None, 1, 3))


async def test_a_read_stopped_early_deletes_its_consumer(nc: Any, js: Any) -> None:
    """Spark may stop reading a partition (a LIMIT): the consumer goes all the same."""
    await make_stream(js, 10)
    state = await reader.stream_state(nc, STREAM)
    batches = reader.read_range(nc, SeqRange(STREAM, state.epoch, None, 1, 11))
    await batches.__anext__()
    assert await consumers(js) == 1
    await batches.aclose()
    assert await consumers(js) == 0


async def test_the_stream_state_tells_the_epoch_and_the_stored_sequences(nc: Any, js: Any) -> None:
    """An empty stream holds nothing from 1; a purge moves the first sequence past the last."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"], storage=api.StorageType.MEMORY)
    empty = await reader.stream_state(nc, STREAM)
    assert (empty.earliest, empty.next_seq) == (1, 1)
    for _ in range(3):
        await js.publish("ORDERS.created", b"x")
    await js.purge_stream(STREAM)
    purged = await reader.stream_state(nc, STREAM)
    assert (purged.earliest, purged.next_seq) == (4, 4)
    assert offsets.batch_bounds(offsets.SourceOptions(STREAM), purged) == (4, 4)
