"""The NATS side of ordered handlers' partitions (docs/ordering.md).

Each ownership of a partition has a durable consumer of its own, named after
the ownership's epoch. A new owner creates its consumer at the ack floor of
the ones before it (every sequence at or below the floor has its outcome
committed; eop acks only after COMMIT) and deletes them: the messages the
previous owner held unacked come first, in stream order, instead of after
their AckWait, behind later messages of their keys; and a previous owner
that is still alive (frozen, cut off) cannot fetch any more, since its
consumer is gone.

With more than one partition, the stream puts each message's partition in
front of its subject (a subject transform with nats-server's ``partition``
function, set on streams eop creates), and each consumer filters its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import re
from collections.abc import Iterable
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api

from eop import errors
from eop.broker import consumers, floors
from eop.handler import HandlerSpec, parse_order_by
from eop.settings import Settings
from eop.types import Delivery, Metadata, Sequences


def consumer_name(spec: HandlerSpec, partition: int, epoch: int) -> str:
    """The durable consumer of ``partition``'s ownership ``epoch``."""
    return f"{consumer_prefix(spec, partition)}{epoch}"


def consumer_prefix(spec: HandlerSpec, partition: int) -> str:
    """What every consumer of ``partition`` is named with, before its epoch."""
    return f"{spec.durable}-p{partition}-e"


def is_consumer_of(durable: str, name: str) -> bool:
    """Whether ``name`` is a partition consumer (any partition, any epoch) of the ordered
    handler whose durable name is ``durable``."""
    head, sep, tail = name.rpartition("-e")
    if not sep or not tail.isdigit() or not head.startswith(f"{durable}-p"):
        return False
    return head[len(durable) + 2 :].isdigit()


def _fnv1a(key: str) -> int:
    """nats-server's hash for ``partition()``: 32-bit FNV-1a."""
    h = 0x811C9DC5
    for byte in key.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


_PARTITION_DEST = re.compile(r"^\{\{partition\((\d+),(\d+)\)\}\}\.")


def stored_subject(transform: tuple[str, str] | None, subject: str) -> str:
    """The subject a stream with subject transform ``(src, dest)`` stores a message
    published on ``subject`` under.

    Applies the transform eop sets for ordered handlers (:func:`transform`);
    ``subject`` as it is without a transform, when the transform does not match
    it, or when it is not of eop's form.
    """
    if transform is None:
        return subject
    src, dest = transform
    found = _PARTITION_DEST.match(dest)
    if found is None or not consumers.subject_matches(src, subject):
        return subject
    count, wildcard = int(found[1]), int(found[2])
    wildcards = [i for i, token in enumerate(src.split(".")) if token == "*"]
    if not 1 <= wildcard <= len(wildcards):
        return subject
    key = subject.split(".")[wildcards[wildcard - 1]]
    return f"{_fnv1a(key) % count}.{subject}"


def published(spec: HandlerSpec, stored: str) -> tuple[int | None, str]:
    """A stored message's partition and its subject as published (what the handler and
    the inbox's fingerprint see); (None, ``stored``) for a subject not of the handler."""
    if spec.order_by is None:
        return None, stored
    if spec.partitions == 1:
        return 0, stored
    head, _, rest = stored.partition(".")
    if head.isdigit() and rest and consumers.subject_matches(spec.subject, rest):
        return int(head), rest
    return None, stored


def filter_subject(spec: HandlerSpec, partition: int) -> str:
    """The subject filter of ``partition``'s consumer."""
    if spec.partitions == 1:
        return spec.subject
    return f"{partition}.{spec.subject}"


def transform(spec: HandlerSpec) -> tuple[str, str] | None:
    """The stream's subject transform a handler of several partitions needs: (src, dest).

    The key's token must be a ``*`` of the handler's subject (checked when the
    handler is declared), so that every message the handler takes is
    transformed, and its partition is the hash of that token.
    """
    if spec.partitions == 1:
        return None
    _, arg = parse_order_by(spec.order_by or "")
    index = int(arg)
    tokens = spec.subject.split(".")
    dest: list[str] = []
    wildcard = key_wildcard = 0
    for position, token in enumerate(tokens):
        if token == "*":
            wildcard += 1
            dest.append(f"{{{{wildcard({wildcard})}}}}")
            if position == index:
                key_wildcard = wildcard
        else:
            dest.append(token)
    return spec.subject, f"{{{{partition({spec.partitions},{key_wildcard})}}}}." + ".".join(dest)


#: The partition count of a transform's destination made by :func:`transform`.
_PARTITION_COUNT = re.compile(r"\{\{\s*partition\(\s*(\d+)\s*,")


def check_transform(stream: api.StreamInfo, spec: HandlerSpec) -> None:
    """Refuse a stream without the subject transform a handler of several partitions needs."""
    wanted = transform(spec)
    if wanted is None:
        return
    have = stream.config.subject_transform
    if have is not None and (have.src, have.dest) == wanted:
        return
    src, dest = wanted
    counted = _PARTITION_COUNT.match(have.dest or "") if have is not None else None
    if have is not None and have.src == src and counted is not None:
        # The stream spreads the same keys over another count: the handler's count
        # changed, not the stream's shape, and setting the transform is no fix while
        # messages stored under the old count wait in their partitions.
        raise errors.ConfigurationError(
            f"handler {spec.name!r} declares partitions={spec.partitions}, but stream "
            f"{spec.stream!r} spreads its keys over {counted.group(1)} partitions: the count "
            f"is fixed for the stream's life. Keep partitions={counted.group(1)}, or change "
            "it as docs/ordering.md says (drain the handler, stop its workers, delete its "
            "rows from the partitions table, recreate the stream with the new transform)"
        )
    raise errors.ConfigurationError(
        f"handler {spec.name!r} spreads its keys over {spec.partitions} partitions, which needs "
        f"stream {spec.stream!r} to put each message's partition in front of its subject; it "
        f"{'has another subject transform' if have is not None else 'has none'}. Fix: set its "
        f'subject transform to src "{src}", dest "{dest}" (it applies to messages stored '
        "after the change: drain the handler first), let eop create the stream, or declare "
        "partitions=1 (one process at a time runs the handler)"
    )


async def open_consumer(
    js: JetStreamContext,
    spec: HandlerSpec,
    settings: Settings,
    partition: int,
    epoch: int,
    previous: str | None,
) -> Opened:
    """Create the consumer of ``partition``'s ownership ``epoch``.

    It starts above the lowest ack floor of the partition's earlier consumers
    (``previous``, any other of its name left by an owner that died while
    taking the partition, and the handler's own durable from before it was
    partitioned); at the stream's start when there is none.
    """
    name = consumer_name(spec, partition, epoch)
    with contextlib.suppress(nats.js.errors.NotFoundError):
        # Made already by this ownership (its fetches failed, or recording it did): its
        # own floor is where it is, and creating it again with another start would fail.
        await js.consumer_info(spec.stream, name)
        return Opened(name)
    positions = [
        position
        for old in await earlier_consumers(js, spec, partition, epoch, previous)
        if (position := await _position(js, spec.stream, old)) is not None
    ]
    start = min(f for f, _ in positions) + 1 if positions else None
    delivered = max((d for _, d in positions), default=0)
    config = api.ConsumerConfig(
        durable_name=name,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL
        if start is None
        else api.DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start,
        ack_wait=spec.ack_wait_s or settings.ack_wait_s,
        # eop counts attempts itself (as for the handler's durable, eop.broker.jetstream).
        max_deliver=-1,
        max_ack_pending=settings.max_ack_pending,
        filter_subject=filter_subject(spec, partition),
    )
    try:
        await js.add_consumer(spec.stream, config)
    except nats.js.errors.APIError as exc:
        raise errors.ConfigurationError(
            f"cannot create consumer {name!r} on stream {spec.stream!r} for handler "
            f"{spec.name!r}: {exc.description or exc}"
        ) from exc
    return Opened(name, start, None if start is None else (start, delivered))


@dataclasses.dataclass(frozen=True)
class Opened:
    """An ownership's consumer, as :func:`open_consumer` found or made it."""

    name: str
    start: int | None = None
    """Where it starts (None: it existed already, or starts at the stream's start)."""
    redelivers: tuple[int, int] | None = None
    """The sequences it delivers again that earlier consumers delivered (first, last):
    empty when first > last."""


class Redelivery:
    """A delivery of a message that earlier owners' consumers delivered too.

    A new ownership's consumer counts deliveries from 1: this one adds the
    earlier consumers' (one per handover whose range holds the message), so
    that the handler's ``num_delivered`` and the crash-loop bound see them.
    """

    def __init__(self, delivery: Delivery, earlier: int) -> None:
        self._delivery = delivery
        self._earlier = earlier
        self.subject = delivery.subject
        self.data = delivery.data
        self.headers = delivery.headers
        self.reply = delivery.reply

    @property
    def metadata(self) -> Metadata:
        """The delivery's metadata, its count including the earlier deliveries."""
        return _Counted(self._delivery.metadata, self._earlier)

    async def ack_sync(self, timeout: float = 1.0) -> Any:
        """Ack and wait for the server's confirmation."""
        return await self._delivery.ack_sync(timeout)

    async def nak(self, delay: float | None = None) -> None:
        """Ask for a redelivery, after ``delay`` seconds."""
        await self._delivery.nak(delay)

    async def term(self) -> None:
        """Tell the server never to redeliver."""
        await self._delivery.term()

    async def in_progress(self) -> None:
        """Reset the delivery's AckWait timer."""
        await self._delivery.in_progress()

    @property
    def is_acked(self) -> bool:
        """An ack, nak or term was sent for it."""
        return self._delivery.is_acked


async def earlier_consumers(
    js: JetStreamContext, spec: HandlerSpec, partition: int, epoch: int, previous: str | None
) -> list[str]:
    """The consumers of ``partition`` from before ownership ``epoch`` that still exist."""
    prefix = consumer_prefix(spec, partition)
    names = {previous} if previous else set()
    for info in await js.consumers_info(spec.stream):
        name = info.name or ""
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            if int(name[len(prefix) :]) < epoch:
                names.add(name)
        elif name == spec.durable:
            names.add(name)
    return sorted(n for n in names if n)


async def retire(js: JetStreamContext, stream: str, names: list[str]) -> None:
    """Delete earlier owners' consumers (gone already is fine)."""
    for name in names:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_consumer(stream, name)


class _Counted:
    """Metadata whose delivery count adds ``earlier`` deliveries."""

    def __init__(self, meta: Metadata, earlier: int) -> None:
        self._meta = meta
        self._earlier = earlier

    @property
    def stream(self) -> str:
        """The stream that stores the message."""
        return self._meta.stream

    @property
    def consumer(self) -> str:
        """The consumer that delivered it: the one its ack goes to."""
        return self._meta.consumer

    @property
    def sequence(self) -> Sequences:
        """Its sequences."""
        return self._meta.sequence

    @property
    def num_delivered(self) -> int:
        """Deliveries by this consumer and by the earlier owners' consumers."""
        return self._meta.num_delivered + self._earlier

    @property
    def timestamp(self) -> datetime.datetime | None:
        """When the stream stored it."""
        return self._meta.timestamp


async def _position(js: JetStreamContext, stream: str, name: str) -> tuple[int, int] | None:
    """A consumer's ack floor and last delivered sequence; None when it is gone."""
    try:
        info = await js.consumer_info(stream, name)
    except nats.js.errors.NotFoundError:
        return None
    return floors.acked_through(info), int(info.delivered.stream_seq if info.delivered else 0)


async def floor(js: JetStreamContext, stream: str, names: list[str]) -> int | None:
    """The lowest of the consumers' floors: every message they filter at or below it
    was acked; None if one is missing.

    A consumer with nothing pending and nothing unacked has every message it
    filters acked, up to the stream's last sequence read before it was asked:
    an idle partition does not hold the watermark back.
    """
    info = await js.stream_info(stream)
    last = int(info.state.last_seq or 0)
    lowest = []
    for name in names:
        try:
            consumer = await js.consumer_info(stream, name)
        except nats.js.errors.NotFoundError:
            return None
        acked = floors.acked_through(consumer)
        if not consumer.num_pending and not consumer.num_ack_pending:
            acked = max(acked, last)
        lowest.append(acked)
    return min(lowest) if lowest else None


def stream_transforms(specs: Iterable[HandlerSpec]) -> dict[str, tuple[str, str]]:
    """The subject transform each stream needs for its handlers of several partitions.

    A stream has one transform: two such handlers on one stream must want the
    same; and any other handler whose subject the transform would rewrite
    would stop matching its messages, so it is refused too.
    """
    wanted: dict[str, tuple[str, str]] = {}
    owners: dict[str, HandlerSpec] = {}
    for spec in specs:
        t = transform(spec)
        if t is None:
            continue
        if spec.stream in wanted and wanted[spec.stream] != t:
            raise errors.ConfigurationError(
                f"handlers {owners[spec.stream].name!r} and {spec.name!r} both spread their keys "
                f"over partitions of stream {spec.stream!r}, with different subjects, keys or "
                "partition counts: a stream puts one partition in front of its subjects; give "
                "them the same subject, order_by and partitions, or separate streams"
            )
        wanted[spec.stream] = t
        owners[spec.stream] = spec
    for spec in specs:
        partitioned = owners.get(spec.stream)
        if partitioned is None or transform(spec) is not None:
            continue
        if _overlap(spec.subject, partitioned.subject):
            raise errors.ConfigurationError(
                f"handler {spec.name!r} subscribes to {spec.subject} on stream {spec.stream!r}, "
                f"whose subjects {partitioned.subject} carry their partition in front "
                f"(handler {partitioned.name!r}, partitions={partitioned.partitions}): it "
                "would never see them. Give it the same order_by and partitions, or use "
                "another stream"
            )
    return wanted


def _overlap(a: str, b: str) -> bool:
    """Whether some subject matches both filters (token by token)."""
    x, y = a.split("."), b.split(".")
    for i in range(max(len(x), len(y))):
        p = x[i] if i < len(x) else None
        q = y[i] if i < len(y) else None
        if p == ">" or q == ">":
            return p is not None and q is not None
        if p is None or q is None:
            return False
        if p != "*" and q != "*" and p != q:
            return False
    return True


async def handler_consumers(js: JetStreamContext, spec: HandlerSpec) -> list[api.ConsumerInfo]:
    """The consumers a handler's messages wait in: its durable, or (ordered) its
    partitions' (empty when none exists yet)."""
    if spec.order_by is None:
        try:
            return [await js.consumer_info(spec.stream, spec.durable)]
        except nats.js.errors.NotFoundError:
            return []
    return [
        i
        for i in await js.consumers_info(spec.stream)
        if is_consumer_of(spec.durable, i.name or "")
    ]
