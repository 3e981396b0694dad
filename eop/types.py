"""The types the layers of eop share: what became of a delivery, and what a delivery is.

They live below the protocol, the broker and the observers, so each of
those can name them without importing the others.
"""

from __future__ import annotations

import datetime
import enum
from typing import Any, Protocol


class Outcome(enum.Enum):
    """What became of one delivery."""

    PROCESSED = "processed"
    DUPLICATE = "duplicate"
    DEAD_LETTERED = "dead_lettered"
    QUARANTINED = "quarantined"
    RETRY = "retry"
    LEFT = "left_for_redelivery"


class Sequences(Protocol):
    """Where a delivered message sits: its sequence in the stream."""

    @property
    def stream(self) -> int:
        """The message's stream sequence."""


class Metadata(Protocol):
    """The JetStream metadata of a delivery that eop reads (nats-py's ``Msg.Metadata``)."""

    @property
    def stream(self) -> str:
        """The stream the message is in."""

    @property
    def consumer(self) -> str:
        """The consumer that delivered it: the one its ack goes to."""

    @property
    def sequence(self) -> Sequences:
        """Its sequences."""

    @property
    def num_delivered(self) -> int:
        """How many times the server has delivered it, this time included."""

    @property
    def timestamp(self) -> datetime.datetime | None:
        """When the stream stored it."""


class Delivery(Protocol):
    """The parts of a nats-py JetStream ``Msg`` that eop uses."""

    subject: str
    data: bytes
    headers: dict[str, str] | None
    reply: str

    @property
    def metadata(self) -> Metadata:
        """JetStream metadata: stream, sequences, delivery count."""

    async def ack_sync(self, timeout: float = 1.0) -> Any:
        """Ack and wait for the server's confirmation."""

    async def nak(self, delay: float | None = None) -> None:
        """Ask for a redelivery, after ``delay`` seconds."""

    async def term(self) -> None:
        """Tell the server never to redeliver."""

    async def in_progress(self) -> None:
        """Reset the delivery's AckWait timer."""

    @property
    def is_acked(self) -> bool:
        """An ack, nak or term was sent for it (nats-py sets it as it sends one)."""
