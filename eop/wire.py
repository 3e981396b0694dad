"""Bytes off the NATS wire as text: what is not UTF-8, kept, named and made storable.

NATS subjects and header lines are bytes, and the server delivers them as
they were published, UTF-8 or not. :func:`decode` turns them into text
losslessly: each byte that is not part of a UTF-8 character becomes a
surrogate escape (U+DC80 to U+DCFF, as :func:`os.fsdecode` does).
:func:`parse_headers` reads a header block that is not UTF-8 that way.
Such a message reaches eop's protocol, which dead-letters it with the
:func:`problem` found in it; :func:`storable` turns its text into text
PostgreSQL can store and JSON can carry.

The client that decodes them so inside nats-py's read loop is
:class:`eop.broker.client.Client`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from nats.js import api

#: The first line of a NATS header block, before its inline status (``NATS/1.0 503``).
HEADER_LINE = b"NATS/1.0"
# Surrogate escapes are what `decode` makes of bytes that are not UTF-8; other
# surrogates cannot come out of a UTF-8 decoder, but are no more storable.
_SURROGATE = re.compile("[\ud800-\udfff]")


def decode(raw: bytes) -> str:
    """``raw`` as UTF-8, each byte that is not part of a character as a surrogate escape.

    Lossless: ``text.encode("utf-8", "surrogateescape")`` gives ``raw`` back.
    """
    return raw.decode("utf-8", "surrogateescape")


def escaped(text: str) -> bool:
    """Whether ``text`` carries bytes that were not UTF-8 (as surrogate escapes)."""
    return not text.isascii() and _SURROGATE.search(text) is not None


def storable(text: str) -> str:
    """``text`` as PostgreSQL can store it: text refuses NUL and anything that is not UTF-8.

    Each escaped byte becomes U+FFFD, as the JetStream API's JSON shows it
    (so the fingerprint ``eop audit`` recomputes from it is the same), and
    so does NUL; valid text is returned as it is.
    """
    if escaped(text):
        text = _SURROGATE.sub("\ufffd", text)
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def problem(subject: str, headers: Mapping[str, str] | None) -> str | None:
    """What keeps a delivered message from being text, or None.

    Names the part (the subject, a header and which), the first bad byte
    and its offset, never the content.
    """
    if escaped(subject):
        return f"subject is not valid UTF-8 ({_first_bad_byte(subject)})"
    for name, value in (headers or {}).items():
        if escaped(name):
            return f"a header name is not valid UTF-8 ({_first_bad_byte(name)})"
        if escaped(value):
            return f"header {name} is not valid UTF-8 ({_first_bad_byte(value)})"
    return None


def _first_bad_byte(text: str) -> str:
    found = _SURROGATE.search(text)
    assert found is not None
    offset = len(text[: found.start()].encode("utf-8", "surrogateescape"))
    byte = found.group().encode("utf-8", "surrogateescape")
    return f"byte 0x{byte.hex()} at offset {offset}"


def parse_headers(block: bytes) -> dict[str, str] | None:
    """A header block that is not UTF-8, every byte kept (see :func:`decode`).

    The same shape as nats-py's parse: an inline status (``NATS/1.0 503
    description``) under ``Status`` and ``Description``, then one entry per
    ``Name: value`` line; names holding whitespace are skipped, as nats-py
    skips them.
    """
    first, *lines = block.split(b"\r\n")
    parsed: dict[str, str] = {}
    status = first[len(HEADER_LINE) :].strip() if first.startswith(HEADER_LINE) else b""
    if status:
        code, _, description = status.partition(b" ")
        if code.isdigit():
            parsed[api.Header.STATUS.value] = code.decode()
        if description.strip():
            parsed[api.Header.DESCRIPTION.value] = decode(description.strip())
    for line in lines:
        name, sep, value = line.partition(b":")
        key = decode(name.strip())
        if sep and key and not any(c.isspace() for c in key):
            parsed[key] = decode(value.strip())
    return parsed or None
