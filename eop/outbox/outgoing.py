"""A message on its way out: checked before it is stored, so the relay can always send it.

The outbox keeps messages for later publication (:mod:`eop.outbox.table`), and a
message refused later, by a relay, long after the request that wrote it has
returned, helps nobody. What can be checked without the server is checked
here, when the message is added: the subject, the header names and values,
and the size against the configured ``max_payload``.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Mapping

from eop import errors
from eop.message import MSG_ID_HEADER

#: nats-server's own default ``max_payload`` (1 MiB).
DEFAULT_MAX_PAYLOAD = 1024 * 1024

# "NATS/1.0\r\n" ... "\r\n": the header block's framing on the wire.
_HEADER_FRAMING = len(b"NATS/1.0\r\n\r\n")
# RFC 9110 token characters: what nats-server accepts in a header name.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Tokens of a subject one can publish to: no wildcard, no whitespace, none empty.
_SUBJECT_TOKEN = re.compile(r"[^\s.*>]+")


def wire_size(data: bytes, headers: Mapping[str, str] | None = None) -> int:
    """The bytes the server counts against its max_payload: payload plus header block."""
    if not headers:
        return len(data)
    block = sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())
    return len(data) + block + _HEADER_FRAMING


@dataclasses.dataclass(frozen=True)
class Outgoing:
    """A message to publish, checked: build it with :func:`outgoing`."""

    subject: str
    data: bytes
    headers: Mapping[str, str]
    """Without ``Nats-Msg-Id``: that is :attr:`msg_id`."""
    msg_id: str


def outgoing(
    subject: str,
    data: bytes | str,
    *,
    headers: Mapping[str, str] | None = None,
    msg_id: str | None = None,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
) -> Outgoing:
    """Check a message and give it its msg-id; :class:`eop.UnpublishableMessage` if it is bad.

    ``data`` may be text (sent as UTF-8). Without ``msg_id`` (or a
    ``Nats-Msg-Id`` header), a random one is chosen now, once: every later
    send of the message carries the same.
    """
    check_subject(subject)
    body = data.encode() if isinstance(data, str) else bytes(data)
    hdrs = dict(headers or {})
    for name, value in hdrs.items():
        check_header(name, value)
    given = hdrs.pop(MSG_ID_HEADER, None)
    if given is not None and msg_id is not None and given != msg_id:
        raise errors.UnpublishableMessage(
            f"message to {subject}: msg_id {msg_id!r} and header {MSG_ID_HEADER} {given!r} "
            "differ: give one of them"
        )
    chosen = msg_id if msg_id is not None else given
    if chosen is None:
        chosen = uuid.uuid4().hex
    elif not chosen or _has_line_break(chosen):
        raise errors.UnpublishableMessage(
            f"message to {subject}: the msg_id must be non-empty, without line breaks"
        )
    size = wire_size(body, {**hdrs, MSG_ID_HEADER: chosen})
    if size > max_payload:
        raise errors.PayloadTooLarge(
            f"message to {subject} is {size} bytes (payload {len(body)}, headers "
            f"{size - len(body)}), above max_payload of {max_payload} bytes: send a "
            "reference to data stored elsewhere, or raise max_payload in the nats-server "
            "configuration and EOP_OUTBOX_MAX_PAYLOAD with it"
        )
    return Outgoing(subject=subject, data=body, headers=hdrs, msg_id=chosen)


def check_subject(subject: str) -> None:
    """Refuse a subject no message can be published to (empty tokens, wildcards, spaces)."""
    if not isinstance(subject, str) or not all(
        _SUBJECT_TOKEN.fullmatch(token) for token in subject.split(".")
    ):
        raise errors.UnpublishableMessage(
            f"cannot publish to subject {subject!r}: a subject is dot-separated tokens, "
            "none empty, without spaces or the wildcards '*' and '>'"
        )


def check_header(name: str, value: str) -> None:
    """Refuse a header NATS cannot carry: a name outside RFC 9110's token, a line break."""
    if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
        raise errors.UnpublishableMessage(
            f"invalid header name {name!r}: NATS header names are letters, digits and "
            "!#$%&'*+-.^_`|~"
        )
    if not isinstance(value, str) or _has_line_break(value):
        raise errors.UnpublishableMessage(
            f"invalid value of header {name}: a header value is text without line breaks"
        )


def _has_line_break(text: str) -> bool:
    return "\r" in text or "\n" in text
