"""Settling only the deliveries of a stream's current incarnation.

nats-server applies an ack, nak or term to the consumer its reply subject names,
at the stream sequence it names, and checks nothing else (not the delivery's
consumer sequence). When a stream is deleted and recreated, and its durable
consumer with it under the same name, a settlement of a delivery of the old
incarnation sent late (its handler ran through the recreation, or its ack was
resent after timeouts) reaches the new incarnation's message at the same
sequence: an ack or a term of a message another run may still be processing,
which a crash or a stop then loses for good (docs/design.md, 'The hazards').
So a delivery is settled only when a reading of its stream asked for at most
:data:`FENCE_S` before shows it stored since the stream's current creation
(:class:`eop.broker.jetstream.StreamEpochs`); a reading is shared by every
settlement in that time, so a drained backlog pays one every
:data:`FENCE_S` at most, not one a batch.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Protocol

from eop.types import Delivery

FENCE_S = 0.1
"""How old the reading a settlement relies on may be: the stream would have to be
deleted and recreated, and the new incarnation's message at the same sequence
delivered, within it."""

READ_TIMEOUT_S = 1.0
"""How long a settlement waits for its reading (``ack_timeout_s``'s default): one that
does not come is tried again as an unanswered ack is."""


class Readings(Protocol):
    """The stream readings a fence relies on (:class:`eop.broker.jetstream.StreamEpochs`)."""

    async def read_within(self, stream: str, within_s: float, timeout_s: float) -> bool | None:
        """Make sure the last reading of ``stream`` was asked for at most ``within_s`` ago
        (waiting ``timeout_s`` at most): True then, False if the stream is gone, None if the
        server cannot be asked."""

    def of_current(self, stream: str, stored_at: datetime.datetime | None) -> bool:
        """Whether a message stored at ``stored_at`` is of the stream's incarnation at the
        last reading."""


class Fence:
    """Tells which deliveries may be settled with the server (see the module docstring)."""

    def __init__(self, readings: Readings, within_s: float = FENCE_S) -> None:
        self.readings = readings
        self.within_s = within_s

    async def verdicts(self, deliveries: Sequence[Delivery]) -> list[bool | None]:
        """Per delivery: True, of its stream's current incarnation by a fresh reading;
        False, of an earlier one, or its stream is gone (settling it would reach another
        message, or nothing); None, unknown for now (the server cannot be asked).

        A delivery with no reply subject (a parked retry's) sends nothing: True.
        """
        fresh: dict[str, bool | None] = {}
        found: list[bool | None] = []
        for delivery in deliveries:
            if not getattr(delivery, "reply", None):
                found.append(True)
                continue
            meta = delivery.metadata
            stream = meta.stream
            if stream not in fresh:
                fresh[stream] = await self.readings.read_within(
                    stream, self.within_s, READ_TIMEOUT_S
                )
            read = fresh[stream]
            found.append(read and self.readings.of_current(stream, meta.timestamp))
        return found

    async def verdict(self, delivery: Delivery) -> bool | None:
        """:meth:`verdicts` of one delivery."""
        return (await self.verdicts([delivery]))[0]
