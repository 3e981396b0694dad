"""The rows a :class:`~eop.testing.store.MemoryStore` keeps: inbox rows and dead letters."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from eop import redaction

if TYPE_CHECKING:
    from eop.message import Message
    from eop.pg.contract import DeadLetter

InboxKey = tuple[str, str, str, int]
"""``(subscription, stream, stream_epoch, stream_seq)``."""


def inbox_key(message: Message) -> InboxKey:
    """The inbox key of a message."""
    return (message.subscription, message.stream, message.stream_epoch, message.seq)


@dataclasses.dataclass(frozen=True)
class _MessageRow:
    """The columns an inbox row and a dead letter share: which message, under which msg-id."""

    subscription: str
    stream: str
    stream_epoch: str
    stream_seq: int
    fingerprint: bytes
    msg_id: str | None
    subject: str

    @property
    def key(self) -> InboxKey:
        """The inbox key of the row."""
        return (self.subscription, self.stream, self.stream_epoch, self.stream_seq)


def _message_columns(message: Message, msg_id: str | None) -> dict[str, Any]:
    return {
        "subscription": message.subscription,
        "stream": message.stream,
        "stream_epoch": message.stream_epoch,
        "stream_seq": message.seq,
        "fingerprint": message.fingerprint,
        "msg_id": msg_id,
        "subject": message.subject,
    }


@dataclasses.dataclass(frozen=True)
class InboxRow(_MessageRow):
    """A committed (or pending) inbox row."""

    outcome: str
    delivery_count: int

    @classmethod
    def of(cls, message: Message, outcome: str, msg_id: str | None) -> InboxRow:
        """The row a claim of ``message`` inserts (``msg_id`` None without the guard)."""
        return cls(
            **_message_columns(message, msg_id),
            outcome=outcome,
            delivery_count=message.num_delivered,
        )


@dataclasses.dataclass(frozen=True)
class DeadLetterRow(_MessageRow):
    """A dead letter, as the real store writes it (headers without secrets)."""

    headers: dict[str, str]
    payload: bytes
    reason: str
    error: str
    traceback: str | None
    delivery_count: int

    @classmethod
    def of(cls, message: Message, dead: DeadLetter) -> DeadLetterRow:
        """The dead letter recorded for ``message``."""
        return cls(
            **_message_columns(message, message.msg_id),
            headers=redaction.redact_headers(message.headers),
            payload=message.data,
            reason=dead.reason,
            error=dead.error,
            traceback=dead.traceback,
            delivery_count=message.num_delivered,
        )

    @property
    def unique_key(self) -> tuple[str, str, str, int, bytes]:
        """What makes a dead letter unique: its message's key and fingerprint."""
        return (*self.key, self.fingerprint)
