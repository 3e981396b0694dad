"""The stream side of the audit: the stream's and the consumer's state, and the walk.

The walk goes over a handler consumer's range of the stream with a
throwaway ordered consumer; single messages are fetched by sequence where a
recorded outcome needs its message's fingerprint.

An ordered handler has a consumer per partition instead of its durable
(:mod:`eop.ordering.partitions`): the walk takes all their filters, and each
message's partition says whose ack floor it stands under. With several
partitions the stream stores each subject behind its partition
(``3.ledger.acc1.step``) while the handler, and so the inbox's fingerprint,
saw it as published (``ledger.acc1.step``): the walk takes the partition
off before it fingerprints a message.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api

from eop import errors, message
from eop.broker import consumers, floors, jetstream
from eop.handler import HandlerSpec
from eop.ordering import partitions

_GETS_IN_FLIGHT = 64


@dataclasses.dataclass(frozen=True)
class Walked:
    """A message of the stream as the walk saw it."""

    seq: int
    subject: str
    msg_id: str | None
    stored_at: datetime.datetime | None = None
    fingerprint: bytes | None = None
    """Known when the walk carried payloads or the message was fetched to verify a row."""
    partition: int | None = None
    """An ordered handler's partition of the message (None for another handler)."""


@dataclasses.dataclass(frozen=True)
class Consumer:
    """The handler's durable consumer, read before the database."""

    exists: bool
    filters: tuple[str, ...]
    ack_floor: int = 0
    ack_floor_at: datetime.datetime | None = None
    """When the server last acted on an ack: it moves with every ack, not only the
    floor's (so no stuck delivery is timed by it)."""
    delivered: int = 0
    """The highest stream sequence delivered: every message above it is undelivered."""
    pending: int = 0
    """Messages the consumer has yet to deliver (its ``num_pending``)."""
    ack_pending: int = 0
    redelivered: int = 0
    max_ack_pending: int = 0
    ack_wait_s: float = 30.0
    created_at: datetime.datetime | None = None
    start_seq: int = 1
    deliver_policy: str = "all"
    name: str = ""


@dataclasses.dataclass(frozen=True)
class Stream:
    """The stream's incarnation and state."""

    name: str
    epoch: str
    first_seq: int
    last_seq: int
    now: datetime.datetime
    interior_removal: bool
    """Retention itself removes messages from the middle (interest, work queue, per subject)."""


def fingerprint(subject: str, headers: Mapping[str, str] | None, data: bytes | None) -> bytes:
    """The fingerprint eop stores for a message (see :attr:`eop.Message.fingerprint`).

    Of the subject and msg-id as the worker stored them (:func:`eop.message.pg_text`).
    """
    msg_id = (headers or {}).get(message.MSG_ID_HEADER)
    msg_id = None if msg_id is None else message.pg_text(str(msg_id))
    return message.fingerprint(message.pg_text(subject), msg_id, bytes(data or b""))


def stream_from_info(name: str, info: Mapping[str, Any]) -> Stream:
    """The stream's state from its raw ``STREAM.INFO``."""
    state, config = info.get("state", {}), info.get("config", {})
    return Stream(
        name=name,
        epoch=jetstream.epoch_from_info(info),
        first_seq=int(state.get("first_seq", 0)),
        last_seq=int(state.get("last_seq", 0)),
        now=jetstream.parse_time(info["ts"])
        if "ts" in info
        else datetime.datetime.now(datetime.timezone.utc),
        interior_removal=config.get("retention", "limits") != "limits"
        or int(config.get("max_msgs_per_subject") or -1) > 0,
    )


def consumer_from_info(info: Mapping[str, Any], notes: list[str]) -> Consumer:
    """The consumer's state from its raw ``CONSUMER.INFO``.

    What limits the audit (a deliver policy that skips messages) goes to ``notes``.
    """
    config = info.get("config", {})
    filters = consumers.consumer_filters(
        config.get("filter_subjects"), config.get("filter_subject")
    )
    floor, delivered = info.get("ack_floor", {}), info.get("delivered", {})
    policy = str(config.get("deliver_policy", "all"))
    start = floors.start_seq(config) or 1
    if policy not in ("all", "by_start_sequence"):
        notes.append(
            f"the consumer's deliver policy is {policy!r}: messages before its first delivery "
            "were never meant for it and would show as acked without an outcome; "
            "pass --from-seq to start after them"
        )
    return Consumer(
        exists=True,
        filters=filters,
        ack_floor=floors.ack_floor(int(floor.get("stream_seq", 0)), start),
        ack_floor_at=_time(floor.get("last_active")),
        delivered=int(delivered.get("stream_seq", 0)),
        pending=int(info.get("num_pending", 0)),
        ack_pending=int(info.get("num_ack_pending", 0)),
        redelivered=int(info.get("num_redelivered", 0)),
        max_ack_pending=int(config.get("max_ack_pending") or 0),
        ack_wait_s=int(config.get("ack_wait") or 30_000_000_000) / 1e9,
        created_at=_time(info.get("created")),
        start_seq=start,
        deliver_policy=policy,
        name=str(info.get("name", "")),
    )


def _time(text: str | None) -> datetime.datetime | None:
    # The server sends Go's zero time for "never" (an ack floor never active).
    if not text or text.startswith("0001-"):
        return None
    return jetstream.parse_time(text)


@contextlib.contextmanager
def _nats_edge(what: str) -> Iterator[None]:
    try:
        yield
    except jetstream.NATS_ERRORS as exc:
        raise errors.NatsUnavailable(f"{what}: {type(exc).__name__} {exc}".strip()) from exc


class Walker:
    """Reads one handler's stream and consumer, and walks the consumer's messages."""

    def __init__(self, nc: NATS, spec: HandlerSpec) -> None:
        self.nc, self.js, self.spec = nc, nc.jetstream(), spec
        self.truncated = False
        """Set when a walk stopped at its ``limit`` before the end of its range."""

    async def stream(self) -> Stream:
        """The stream's state now."""
        info = await jetstream.raw_stream_info(self.nc, self.spec.stream)
        return stream_from_info(self.spec.stream, info)

    async def consumer(self, notes: list[str]) -> Consumer:
        """The handler's durable consumer now; why the audit is limited goes to ``notes``."""
        return await self._consumer(self.spec.durable, self.spec.subject, notes)

    async def partition_consumers(
        self, names: Mapping[int, str | None], notes: list[str]
    ) -> dict[int, Consumer]:
        """An ordered handler's consumer of each partition (``names``, as the database
        records them), now; a partition without one has no ack floor."""
        found = {}
        for partition in range(self.spec.partitions):
            name = names.get(partition)
            subject = partitions.filter_subject(self.spec, partition)
            if name is None:
                notes.append(
                    f"partition {partition} has no consumer yet (never owned): no ack floor, "
                    "so nothing of it can be shown acked without an outcome"
                )
                found[partition] = Consumer(exists=False, filters=(subject,))
                continue
            consumer = await self._consumer(name, subject, notes)
            # Each ownership's consumer starts at the floor of the ones before it: the
            # messages below were the earlier owners', acked all the same.
            found[partition] = dataclasses.replace(consumer, start_seq=1)
        return found

    async def _consumer(self, durable: str, subject: str, notes: list[str]) -> Consumer:
        stream = self.spec.stream
        info: dict[str, Any] = await jetstream.api_request(
            self.nc,
            f"CONSUMER.INFO.{stream}.{durable}",
            what=f"cannot read consumer {durable!r} of stream {stream!r}",
        )
        if "error" in info:
            notes.append(
                f"consumer {durable!r} not found ({info['error'].get('description')}): "
                "no ack floor, so nothing can be shown acked without an outcome"
            )
            return Consumer(exists=False, filters=(subject,))
        return consumer_from_info(info, notes)

    async def walk(
        self,
        start: int,
        end: int,
        filters: Iterable[str],
        *,
        headers_only: bool,
        batch: int,
        limit: int | None,
    ) -> AsyncGenerator[list[Walked], None]:
        """The messages from ``start`` to ``end`` under ``filters``, in batches.

        An ordered, unacknowledged consumer with the durable's filters: the
        server skips deleted messages and other subjects for us. Without
        ``headers_only`` each message carries its fingerprint.
        """
        if start > end:
            return
        name = f"eop-audit-{uuid.uuid4().hex[:12]}"
        subjects = list(filters)
        config = api.ConsumerConfig(
            name=name,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            ack_policy=api.AckPolicy.NONE,
            headers_only=headers_only or None,
            mem_storage=True,
            # The server removes it by itself should the audit die.
            inactive_threshold=60.0,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
            filter_subjects=subjects if len(subjects) > 1 else None,
        )
        stream = self.spec.stream
        with _nats_edge("cannot create the audit's consumer"):
            info = await self.js.add_consumer(stream, config)
        try:
            if info.num_pending == 0:
                return
            psub = await self.js.pull_subscribe_bind(consumer=name, stream=stream)
            try:
                async for walked in self._fetch(psub, end, headers_only, batch, limit):
                    yield walked
            finally:
                with contextlib.suppress(*jetstream.NATS_ERRORS):
                    await psub.unsubscribe()
        finally:
            with contextlib.suppress(*jetstream.NATS_ERRORS):
                await self.js.delete_consumer(stream, name)

    async def _fetch(
        self, psub: Any, end: int, headers_only: bool, size: int, limit: int | None
    ) -> AsyncIterator[list[Walked]]:
        remaining = limit
        while remaining is None or remaining > 0:
            want = size if remaining is None else min(size, remaining)
            try:
                with _nats_edge("the audit's fetch failed"):
                    msgs = await psub.fetch(want, timeout=5)
            except errors.NatsUnavailable as exc:
                if isinstance(exc.__cause__, (nats.errors.TimeoutError, asyncio.TimeoutError)):
                    return
                raise
            batch, done = _batch(self.spec, msgs, end, headers_only)
            if batch:
                yield batch
            if done or not msgs:
                return
            if remaining is not None:
                remaining -= len(batch)
        self.truncated = True

    async def get_many(self, seqs: Iterable[int]) -> dict[int, Walked | None]:
        """The stream's messages at ``seqs`` (None where it holds none), fetched concurrently."""
        gate = asyncio.Semaphore(_GETS_IN_FLIGHT)

        async def get(seq: int) -> tuple[int, Walked | None]:
            async with gate:
                try:
                    with _nats_edge(f"cannot read sequence {seq}"):
                        raw = await self.js.get_msg(self.spec.stream, seq)
                except errors.NatsUnavailable as exc:
                    if isinstance(exc.__cause__, nats.js.errors.NotFoundError):
                        return seq, None
                    raise
            headers = raw.headers or {}
            partition, subject = partitions.published(self.spec, str(raw.subject))
            subject = message.pg_text(subject)
            return seq, Walked(
                seq=seq,
                subject=subject,
                msg_id=headers.get(message.MSG_ID_HEADER),
                fingerprint=fingerprint(subject, headers, raw.data),
                partition=partition,
            )

        return dict(await asyncio.gather(*(get(seq) for seq in sorted(set(seqs)))))


def combined(parts: Mapping[int, Consumer]) -> Consumer:
    """An ordered handler's partition consumers as one, for the report: every filter,
    the lowest ack floor, the highest delivered sequence, the counts summed."""
    cs = list(parts.values())
    return Consumer(
        exists=all(c.exists for c in cs),
        filters=tuple(dict.fromkeys(f for c in cs for f in c.filters)),
        ack_floor=min((c.ack_floor for c in cs), default=0),
        delivered=max((c.delivered for c in cs), default=0),
        pending=sum(c.pending for c in cs),
        ack_pending=sum(c.ack_pending for c in cs),
        redelivered=sum(c.redelivered for c in cs),
        max_ack_pending=max((c.max_ack_pending for c in cs), default=0),
        ack_wait_s=max((c.ack_wait_s for c in cs), default=30.0),
    )


def _batch(
    spec: HandlerSpec, msgs: list[Any], end: int, headers_only: bool
) -> tuple[list[Walked], bool]:
    """The fetched messages up to ``end``, and whether the walk is done."""
    batch: list[Walked] = []
    for m in msgs:
        meta = m.metadata
        seq = int(meta.sequence.stream)
        if seq > end:
            return batch, True
        headers = m.headers or {}
        partition, subject = partitions.published(spec, m.subject)
        batch.append(
            Walked(
                seq=seq,
                subject=message.pg_text(subject),
                msg_id=headers.get(message.MSG_ID_HEADER),
                stored_at=meta.timestamp,
                fingerprint=None if headers_only else fingerprint(subject, headers, m.data),
                partition=partition,
            )
        )
        if seq >= end or meta.num_pending == 0:
            return batch, True
    return batch, False
