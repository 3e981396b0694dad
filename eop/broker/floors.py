"""A consumer's ack floor, as NATS tells it, and the message waiting just above it.

Read raw (``CONSUMER.INFO``), so that the consumer's creation time is parsed
the one way every reader of :mod:`eop.pg.floors` compares it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import api

from eop.broker import consumers, jetstream

#: Go's zero time: what the server sends for "never".
_NEVER = "0001-"


@dataclasses.dataclass(frozen=True)
class Floor:
    """A consumer's ack floor and what it has delivered, at one reading."""

    consumer: str
    created: datetime.datetime | None
    floor: int
    """Every message it filters at or below this stream sequence was acked."""
    delivered: int
    """The highest stream sequence it delivered."""
    ack_pending: int
    ack_wait_s: float
    filters: tuple[str, ...]

    @property
    def waiting(self) -> bool:
        """Whether a delivery above the floor is unacknowledged."""
        return self.ack_pending > 0 and self.delivered > self.floor


def ack_floor(acked: int, start_seq: int | None) -> int:
    """A consumer's ack floor: ``acked`` (its ``ack_floor.stream_seq``), at least just below
    ``start_seq``, the sequence it was created to start at (None: the stream's start).

    Nothing below its start is the consumer's to ack. A single server reports such a
    consumer's floor as ``start_seq - 1`` before its first ack, but a replicated one
    reports 0: read as it is, an ordered handler's next owner of the partition started
    at the stream's first message (every message of the stream delivered again, to be
    skipped one by one), and the watermark waited for that consumer's first ack.
    """
    return max(acked, start_seq - 1) if start_seq else acked


def start_seq(config: Mapping[str, Any]) -> int | None:
    """The sequence a consumer (its raw ``config``) was created to start at, or None."""
    if config.get("deliver_policy") != "by_start_sequence":
        return None
    return int(config.get("opt_start_seq") or 0) or None


def acked_through(info: api.ConsumerInfo) -> int:
    """The ack floor (:func:`ack_floor`) of a consumer as nats-py's ``consumer_info`` gives it."""
    acked = int(info.ack_floor.stream_seq if info.ack_floor else 0)
    config = info.config
    by_start = config.deliver_policy == api.DeliverPolicy.BY_START_SEQUENCE
    return ack_floor(acked, config.opt_start_seq if by_start else None)


def from_info(name: str, info: Mapping[str, Any]) -> Floor:
    """A consumer's floor from its raw ``CONSUMER.INFO`` reply."""
    config = info.get("config", {})
    created = info.get("created")
    return Floor(
        consumer=name,
        created=None
        if not created or str(created).startswith(_NEVER)
        else jetstream.parse_time(str(created)),
        floor=ack_floor(int(info.get("ack_floor", {}).get("stream_seq", 0)), start_seq(config)),
        delivered=int(info.get("delivered", {}).get("stream_seq", 0)),
        ack_pending=int(info.get("num_ack_pending", 0)),
        ack_wait_s=int(config.get("ack_wait") or 30_000_000_000) / 1e9,
        filters=consumers.consumer_filters(
            config.get("filter_subjects"), config.get("filter_subject")
        ),
    )


async def read(nc: NATS, stream: str, name: str) -> Floor | None:
    """``name``'s floor now; None when the consumer does not exist.

    Raises :class:`eop.NatsUnavailable` when NATS does not answer.
    """
    info = await jetstream.api_request(
        nc, f"CONSUMER.INFO.{stream}.{name}", what=f"cannot read consumer {name!r}"
    )
    if "error" in info:
        return None
    return from_info(name, info)


async def first_above(nc: NATS, stream: str, filters: Sequence[str], floor: int) -> int | None:
    """The stream sequence of the first message above ``floor`` under ``filters`` (the
    one a floor that does not move waits on); None when there is none, or NATS does not
    tell."""
    js = nc.jetstream()
    found = []
    for subject in filters or (">",):
        with contextlib.suppress(nats.js.errors.NotFoundError, *jetstream.NATS_ERRORS):
            msg = await js.get_msg(stream, seq=floor + 1, subject=subject, next=True)
            if msg.seq is not None:
                found.append(int(msg.seq))
    return min(found, default=None)
