"""The relay's seam to where outbox rows go: a :class:`Publisher`, and its receipt per row.

The relay (:mod:`eop.outbox.relay`) keeps everything that makes the outbox
exactly once: the lease, the order, the marks, the refusals counted and the
subjects held back. A publisher only sends a batch of rows and says, row by
row, what became of each (:class:`Fate`). JetStream's is
:mod:`eop.outbox.jetstream_publisher`; another target is one module with a
class of this shape, handed to the relay where it is built
(:mod:`eop.outbox.process` for ``eop relay``, :mod:`eop.runtime.worker` for a
worker's relay).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Protocol

#: Why an outbox row was parked (not published until ``eop outbox retry``).
PARK_NO_STREAM = "no_stream"
PARK_TOO_LARGE = "too_large"
PARK_BAD_HEADER = "bad_header"
PARK_REFUSED = "refused"


@dataclasses.dataclass(frozen=True)
class Row:
    """An outbox row as the relay reads it to publish it."""

    id: int
    msg_id: str
    """Sent with every publish of the row. JetStream keeps one copy per msg-id (within its
    duplicate window); a target that cannot gets a second copy of a row the relay sent
    again after a stop between the publish and its mark."""
    subject: str
    headers: Mapping[str, str]
    """Sent with :attr:`msg_id` as ``Nats-Msg-Id``, in place of any among them."""
    payload: bytes
    attempts: int


class Fate(enum.Enum):
    """What became of one row of a batch, and so what the relay does with it."""

    PUBLISHED = "published"
    """Stored by the target (a copy it already held, by msg-id, too): marked published."""
    PARKED = "parked"
    """Never publishable as it is (too large, a header the target rejects): parked now."""
    REFUSED = "refused"
    """Refused, maybe for a while (no stream holds the subject, a full stream): an attempt
    counted and the subject held back; parked at ``outbox_max_attempts``."""
    HELD = "held"
    """Refused, but the target does not confirm it (no responders while JetStream
    restarts): the subject held back, nothing counted."""
    UNSENT = "unsent"
    """Not sent, the target not connected: the round fails and is tried again."""
    UNANSWERED = "unanswered"
    """Sent but not confirmed in time (or a server error, a dropped connection): the
    round fails and is tried again, and the new send carries the same msg-id."""


@dataclasses.dataclass(frozen=True)
class Receipt:
    """What became of one row: its :class:`Fate`, and what the relay records of it."""

    fate: Fate
    reason: str = ""
    """Why it is parked or refused (a ``PARK_*`` reason)."""
    error: str = ""
    """The target's words, kept in the row's ``last_error``."""
    stream: str = ""
    """Where a published row is: its stream and sequence, kept in the row."""
    seq: int = 0

    @classmethod
    def published(cls, stream: str, seq: int) -> Receipt:
        """Stored at ``seq`` of ``stream``."""
        return cls(Fate.PUBLISHED, stream=stream, seq=seq)

    @classmethod
    def parked(cls, reason: str, error: str) -> Receipt:
        """Never publishable as it is."""
        return cls(Fate.PARKED, reason, error)

    @classmethod
    def refused(cls, reason: str, error: str) -> Receipt:
        """Refused, to be counted."""
        return cls(Fate.REFUSED, reason, error)


#: The receipts without details.
HELD = Receipt(Fate.HELD)
UNSENT = Receipt(Fate.UNSENT)
UNANSWERED = Receipt(Fate.UNANSWERED)


class Publisher(Protocol):
    """Where the relay sends outbox rows (JetStream's: :mod:`eop.outbox.jetstream_publisher`)."""

    target: str
    """What the relay's log lines and errors call the target (``"NATS"``)."""

    async def publish(self, rows: Sequence[Row]) -> list[Receipt]:
        """Send ``rows``, each with its msg-id, and wait for the target to take them (as
        long as its timeout); a receipt per row, in the order of ``rows``.

        An exception fails the whole round (none of the rows is marked), which the
        relay tries again with backoff: only for what no receipt describes.
        """
