"""Reading sequence ranges of a JetStream stream, for the ``jetstream`` data source.

A range is read through a short-lived consumer of its own: ephemeral, no
acks, in memory, starting at the range's first sequence
(``DeliverPolicy.BY_START_SEQUENCE``), deleted when the read ends and
removed by the server after ``inactive_threshold`` should the reading
process die first. Reading the same range again gives the same rows, which
is what Spark's replays and task retries need.

A range the stream no longer fully holds is an error, never a short read:
before the read (its first sequence is below the stream's first), and after
it, when retention overtook the reader (see :class:`_Coverage`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import threading
from collections.abc import AsyncGenerator, Awaitable, Iterator
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api

from eop import errors as eop_errors
from eop import message, nats_access
from eop.broker import connection, jetstream
from eop.contrib.spark import errors
from eop.contrib.spark.offsets import SeqRange, StreamState, check_available, check_epoch

T = TypeVar("T")

#: One row of the data source, in the order of :data:`SCHEMA`.
Row = tuple[str, int, str, "str | None", dict[str, str], bytes, "datetime.datetime | None", str]

SCHEMA = (
    "stream string, seq long, subject string, msg_id string, headers map<string,string>, "
    "data binary, timestamp timestamp, epoch string"
)

FETCH_BATCH = 512
FETCH_TIMEOUT_S = 5.0
FETCH_TRIES = 3
CONSUMER_INACTIVE_S = 120.0
"""How long the server keeps a reading consumer whose reader vanished (died mid-read)."""


async def connect(access: nats_access.NatsAccess) -> Any:
    """A NATS connection for reading; :class:`eop.NatsUnavailable` when there is none.

    Quiet, unlike the workers' (:func:`eop.broker.jetstream.connect`): readers open
    and close connections all the time, and a lost one fails the read.
    """
    return await connection.connect_nats(
        access, name="eop-spark-jetstream", max_reconnect_attempts=2
    )


async def stream_state(nc: NATS, stream: str) -> StreamState:
    """The stream's epoch (as the workers compute it) and the sequences it holds.

    The epoch is read before and after the state, so the two belong to the
    same incarnation of the stream.
    """
    epochs = jetstream.StreamEpochs(nc)
    js = nc.jetstream()
    for _ in range(3):
        epoch = await epochs.refresh(stream)
        try:
            info = await js.stream_info(stream)
        except nats.js.errors.NotFoundError:
            raise eop_errors.ConfigurationError(f"stream {stream!r} does not exist") from None
        if await epochs.refresh(stream) == epoch:
            state = info.state
            return StreamState(stream, epoch, int(state.first_seq), int(state.last_seq))
    raise errors.StreamRecreated(f"stream {stream!r} keeps being recreated while eop reads it")


async def read_range(nc: NATS, seqs: SeqRange) -> AsyncGenerator[list[Row], None]:
    """The rows of ``seqs`` in sequence order, in batches; see the module docstring."""
    if seqs.start >= seqs.end:
        return
    js = nc.jetstream()
    consumer = await js.add_consumer(
        seqs.stream,
        api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=seqs.start,
            ack_policy=api.AckPolicy.NONE,
            filter_subject=seqs.subject,
            inactive_threshold=CONSUMER_INACTIVE_S,
            mem_storage=True,
            num_replicas=1,
        ),
    )
    sub = None
    try:
        # Checked after the consumer exists: had the stream been recreated
        # since, the consumer would belong to the new one and fail this check;
        # had it been recreated after, the consumer would be gone with it.
        state = await stream_state(nc, seqs.stream)
        check_epoch(seqs.epoch, state)
        check_available(seqs.stream, seqs.start, seqs.end, state)
        sub = await js.pull_subscribe_bind(consumer=consumer.name, stream=seqs.stream)
        coverage = _Coverage(seqs.start)
        pending = consumer.num_pending or 0
        while pending > 0 and coverage.cursor < seqs.end:
            want = min(FETCH_BATCH, seqs.end - coverage.cursor, pending)
            rows: list[Row] = []
            msgs = await _fetch(js, sub, consumer.name, want, seqs)
            if not msgs:
                break
            for msg in msgs:
                meta = msg.metadata
                seq = int(meta.sequence.stream)
                if seq >= seqs.end:
                    pending = 0
                    break
                pending = int(meta.num_pending)
                coverage.saw(seq)
                rows.append(_row(msg, seq, meta, seqs.epoch))
            if rows:
                yield rows
        if coverage.first_unseen < seqs.end:
            coverage.check(seqs, await stream_state(nc, seqs.stream))
    finally:
        await _cleanup(js, sub, seqs.stream, consumer.name)


@dataclasses.dataclass
class _Coverage:
    """Which sequences of a range were delivered, to tell a gap from a loss after the read.

    Retention removes the oldest messages first. A message of the range that
    was removed before the consumer reached it is a sequence that was not
    delivered and is now below the stream's first sequence. So the read is
    complete if the first sequence not delivered (a deleted message, a
    subject outside the filter, or a loss) is still at or above the stream's
    first sequence. When retention reaches into the range during the read,
    that cannot be told apart and the read fails rather than risk a short one.
    """

    first_unseen: int
    cursor: int = 0
    _gap: bool = False

    def __post_init__(self) -> None:
        self.cursor = self.first_unseen

    def saw(self, seq: int) -> None:
        """Record the delivery of ``seq`` (deliveries come in sequence order)."""
        if not self._gap:
            if seq == self.first_unseen:
                self.first_unseen += 1
            else:
                self._gap = True
        self.cursor = seq + 1

    def check(self, seqs: SeqRange, state: StreamState) -> None:
        """Fail if what was not delivered may have been removed while the range was read."""
        check_epoch(seqs.epoch, state)
        if state.earliest > self.first_unseen:
            raise errors.RangeUnavailable(
                f"stream {seqs.stream!r}: retention removed messages from sequences "
                f"{seqs.start}..{seqs.end - 1} while they were being read (its first sequence "
                f"is now {state.earliest}): start at a later sequence"
            )


async def _fetch(
    js: JetStreamContext, sub: Any, consumer: str, want: int, seqs: SeqRange
) -> list[Any]:
    """Up to ``want`` messages; none when the consumer turns out to have nothing left."""
    for _ in range(FETCH_TRIES):
        try:
            return list(await sub.fetch(want, timeout=FETCH_TIMEOUT_S))
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            # The messages counted as pending may have been deleted since.
            info = await js.consumer_info(seqs.stream, consumer)
            if int(info.num_pending) == 0:
                return []
    raise eop_errors.NatsUnavailable(
        f"reading stream {seqs.stream!r} sequences {seqs.start}..{seqs.end - 1} stalled: "
        f"no message for {FETCH_TRIES * FETCH_TIMEOUT_S:.0f} s although some are pending"
    )


def _row(msg: Any, seq: int, meta: Any, epoch: str) -> Row:
    # The same conversion as eop.message.from_nats, so fingerprints match the workers'.
    headers = {str(k): str(v) for k, v in (msg.headers or {}).items()}
    return (
        meta.stream,
        seq,
        msg.subject,
        headers.get(message.MSG_ID_HEADER),
        headers,
        bytes(msg.data or b""),
        meta.timestamp,
        epoch,
    )


async def _cleanup(js: JetStreamContext, sub: Any, stream: str, consumer: str) -> None:
    # Best effort: a consumer left behind is removed by the server once inactive.
    with contextlib.suppress(nats.errors.Error, OSError, asyncio.TimeoutError):
        await js.delete_consumer(stream, consumer)
    if sub is not None:
        with contextlib.suppress(nats.errors.Error, OSError, asyncio.TimeoutError):
            await sub.unsubscribe()


def iterate(access: nats_access.NatsAccess, seqs: SeqRange) -> Iterator[list[Row]]:
    """:func:`read_range` for synchronous callers (a Spark task), on a private event loop."""
    loop = asyncio.new_event_loop()
    try:
        nc = loop.run_until_complete(connect(access))
        try:
            batches = read_range(nc, seqs)
            try:
                while True:
                    try:
                        yield loop.run_until_complete(batches.__anext__())
                    except StopAsyncIteration:
                        break
            finally:
                # Also when Spark stops early (a LIMIT): the consumer is deleted.
                loop.run_until_complete(batches.aclose())
        finally:
            loop.run_until_complete(nc.close())
    finally:
        loop.close()


def state_once(access: nats_access.NatsAccess, stream: str) -> StreamState:
    """:func:`stream_state` over a connection of its own, for one-off planning."""

    async def probe() -> StreamState:
        nc = await connect(access)
        try:
            return await stream_state(nc, stream)
        finally:
            await nc.close()

    return asyncio.run(probe())


class StateProbe:
    """Reads stream states over one connection kept for a streaming query's life.

    Spark asks for the latest offset at every trigger; the connection lives on
    an event loop in a daemon thread so that it keeps answering the server's
    pings between those calls.
    """

    def __init__(self, access: nats_access.NatsAccess) -> None:
        self._access = access
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nc: Any = None

    def state(self, stream: str) -> StreamState:
        """The stream's current state."""
        return self._call(self._state(stream))

    async def _state(self, stream: str) -> StreamState:
        if self._nc is None:
            self._nc = await connect(self._access)
        return await stream_state(self._nc, stream)

    def _call(self, coro: Awaitable[T]) -> T:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(
                target=self._loop.run_forever, name="eop-spark-nats", daemon=True
            ).start()
        return asyncio.run_coroutine_threadsafe(_as_coroutine(coro), self._loop).result()

    def close(self) -> None:
        """Close the connection and stop the loop."""
        if self._loop is None:
            return
        if self._nc is not None:
            with contextlib.suppress(Exception):
                self._call(self._nc.close())
            self._nc = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop = None


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable
