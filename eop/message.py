"""The message a handler receives, and what eop derives from it.

:class:`Message` is a plain, immutable view of one JetStream delivery: the
handler never touches the NATS message itself, so it cannot ack it behind
eop's back.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import struct
from collections.abc import Mapping
from typing import Any

from eop import errors, wire
from eop.types import Delivery

MSG_ID_HEADER = "Nats-Msg-Id"


@dataclasses.dataclass(frozen=True)
class Message:
    """One delivery of a JetStream message to a handler subscription."""

    subscription: str
    """The handler's stable logical name (the first part of the inbox key)."""
    subject: str
    data: bytes
    headers: Mapping[str, str]
    stream: str
    stream_epoch: str
    """Identifies one incarnation of the stream: it changes when the stream is recreated."""
    seq: int
    """The stream sequence."""
    num_delivered: int
    """How many times the server has delivered this message (1 on the first delivery)."""
    timestamp: datetime.datetime | None = None
    """When the message was stored in the stream."""

    @property
    def msg_id(self) -> str | None:
        """The publisher's ``Nats-Msg-Id``, if it set one."""
        return self.headers.get(MSG_ID_HEADER)

    @property
    def idempotency_key(self) -> str:
        """A key that is the same for every delivery of this message to this handler.

        Pass it to systems outside the database (payment APIs, e-mail
        services) so that their effect, which eop can only give at least once,
        is applied once.
        """
        return f"{self.subscription}:{self.stream}:{self.stream_epoch}:{self.seq}"

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """A hash of the subject, the payload and the msg-id (computed once per message).

        Two deliveries with the same inbox key but different fingerprints mean
        the stream sequence was reused for another message.
        """
        return fingerprint(self.subject, self.msg_id, self.data)

    def text(self) -> str:
        """The payload decoded as UTF-8; :class:`eop.UndecodableMessage` if it is not."""
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise errors.UndecodableMessage(f"payload is not UTF-8: {exc}") from exc

    def json(self) -> Any:
        """The payload decoded as JSON; :class:`eop.UndecodableMessage` if it is not.

        An undecodable payload will never decode on a retry, so eop
        dead-letters it at once. JSON between systems is UTF-8 (RFC 8259), and
        typed payloads (pydantic) accept nothing else: ``json.loads`` alone
        would also take UTF-16, UTF-32 and a byte-order mark.
        """
        try:
            return json.loads(self.data.decode("utf-8"))
        # ValueError covers UnicodeDecodeError, JSONDecodeError (a byte-order
        # mark among them) and integers past Python's digit limit.
        except (ValueError, RecursionError) as exc:
            raise errors.UndecodableMessage(f"payload is not valid JSON: {exc}") from exc


def from_nats(msg: Delivery, *, subscription: str, stream_epoch: str) -> Message:
    """Build a :class:`Message` from a nats-py JetStream message.

    A message without JetStream metadata cannot be keyed in the inbox:
    :class:`eop.UndecodableMessage`.
    """
    try:
        meta = msg.metadata
    except Exception as exc:  # nats-py raises a bare ValueError/IndexError here
        raise errors.UndecodableMessage(f"not a JetStream message: {exc}") from exc
    raw = msg.headers
    headers: dict[str, str] = {}
    if raw:
        headers = {str(k): str(v) for k, v in raw.items()}
        if any(_unstorable(k) or _unstorable(v) for k, v in headers.items()):
            headers = {wire.storable(k): wire.storable(v) for k, v in headers.items()}
    data = msg.data
    # Filled in directly: a frozen dataclass's __init__ sets each field through
    # object.__setattr__, and the hot path builds one Message per delivery.
    built: Message = _new(Message)
    built.__dict__.update(
        subscription=subscription,
        subject=wire.storable(msg.subject),
        data=data if type(data) is bytes else bytes(data or b""),
        headers=headers,
        stream=meta.stream,
        stream_epoch=stream_epoch,
        seq=int(meta.sequence.stream),
        num_delivered=int(meta.num_delivered),
        timestamp=meta.timestamp,
    )
    return built


_new = object.__new__


def undecodable(msg: Delivery) -> str | None:
    """Why the subject or a header of a nats-py message is not text, or None.

    eop's connections deliver bytes that are not UTF-8 as surrogate escapes
    (see :mod:`eop.wire`); :func:`from_nats` stores them as U+FFFD, so a
    handler would get a subject or header that is not what was published:
    such a message is dead-lettered as undecodable instead.
    """
    return wire.problem(str(msg.subject), msg.headers)


def _unstorable(text: str) -> bool:
    return "\x00" in text or wire.escaped(text)


def fingerprint(subject: str, msg_id: str | None, data: bytes) -> bytes:
    """The SHA-256 of the subject, the msg-id and the payload, each length-prefixed.

    What the inbox stores per message (:attr:`Message.fingerprint`), and what
    ``eop audit`` recomputes from the stream.
    """
    # One buffer, one update: six updates cost a message more than the hashing.
    s, m = subject.encode(), (msg_id or "").encode()
    return hashlib.sha256(
        b"".join((_LENGTH.pack(len(s)), s, _LENGTH.pack(len(m)), m, _LENGTH.pack(len(data)), data))
    ).digest()


_LENGTH = struct.Struct(">Q")
"""A part's length before it: 8 bytes, big-endian."""


def pg_text(text: str) -> str:
    """``text`` as PostgreSQL can store it: text and jsonb refuse NUL and bytes not UTF-8.

    A header, subject or error holding one would make every attempt to
    record the message's outcome fail, so it could never be settled; each
    becomes U+FFFD (see :func:`eop.wire.storable`).
    """
    return wire.storable(text)
