"""Just enough of the NATS and PostgreSQL wire protocols to drop one reply.

The fault proxy (:mod:`eop.tools.chaos.proxy`) forwards bytes; to lose "the reply
to the next ack" or "the reply to the next COMMIT" it must find message
boundaries in both directions. These framers split a byte stream into whole
frames, whatever the chunking, and keep any incomplete tail for later.
Nothing here logs a frame: they carry credentials (NATS ``CONNECT``,
PostgreSQL's startup packet) and payloads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import struct

_CRLF = b"\r\n"
# Ops whose line ends with a byte count of the payload that follows.
_NATS_PAYLOAD_OPS = {b"PUB", b"MSG", b"HPUB", b"HMSG"}

SSL_REQUEST_CODE = 80877103
GSSENC_REQUEST_CODE = 80877104
CANCEL_REQUEST_CODE = 80877102


@dataclasses.dataclass(frozen=True)
class Frame:
    """One protocol message: its kind (a NATS op or a PostgreSQL type byte) and bytes."""

    kind: bytes
    raw: bytes
    args: tuple[bytes, ...] = ()
    """NATS: the words of the op line after the op. PostgreSQL: the body."""


class NatsFramer:
    """Splits a NATS client or server byte stream into frames (ops with their payload)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        """Add ``data``; return the frames it completed."""
        self._buffer += data
        frames: list[Frame] = []
        while True:
            end = self._buffer.find(_CRLF)
            if end < 0:
                return frames
            words = bytes(self._buffer[:end]).split()
            op = words[0].upper() if words else b""
            size = end + 2
            if op in _NATS_PAYLOAD_OPS:
                # A malformed line is forwarded as it is: the peer will complain.
                with contextlib.suppress(ValueError):
                    size += int(words[-1]) + 2
            if len(self._buffer) < size:
                return frames
            frames.append(Frame(op, bytes(self._buffer[:size]), tuple(words[1:])))
            del self._buffer[:size]


def nats_ack_reply_subject(frame: Frame) -> bytes | None:
    """The reply subject of a client's JetStream ack (``PUB $JS.ACK.... INBOX N``), if it is one."""
    if frame.kind == b"PUB" and len(frame.args) == 3 and frame.args[0].startswith(b"$JS.ACK."):
        return frame.args[1]
    if frame.kind == b"HPUB" and len(frame.args) == 4 and frame.args[0].startswith(b"$JS.ACK."):
        return frame.args[1]
    return None


def nats_delivery_subject(frame: Frame) -> bytes | None:
    """The subject a server's ``MSG``/``HMSG`` is delivered on, else None."""
    if frame.kind in (b"MSG", b"HMSG") and frame.args:
        return frame.args[0]
    return None


class PgFramer:
    """Splits a PostgreSQL byte stream into messages.

    The client side starts with untyped messages (SSL/GSS requests, the
    startup packet); the server answers an SSL or GSS request with a single
    byte. :attr:`raw_bytes_expected` is how the client side tells the server
    side about those bytes.
    """

    def __init__(self, *, client: bool) -> None:
        self._buffer = bytearray()
        self._client = client
        self._startup = client
        self.raw_bytes_expected = 0
        self.peer: PgFramer | None = None

    def feed(self, data: bytes) -> list[Frame]:
        """Add ``data``; return the messages it completed."""
        self._buffer += data
        frames: list[Frame] = []
        while True:
            frame = self._next()
            if frame is None:
                return frames
            frames.append(frame)

    def _next(self) -> Frame | None:
        buffer = self._buffer
        if self.raw_bytes_expected and buffer:
            self.raw_bytes_expected -= 1
            raw = bytes(buffer[:1])
            del buffer[:1]
            return Frame(b"", raw)
        if self._startup:
            if len(buffer) < 8:
                return None
            (length,) = struct.unpack("!i", buffer[:4])
            if len(buffer) < length:
                return None
            (code,) = struct.unpack("!i", buffer[4:8])
            raw = bytes(buffer[:length])
            del buffer[:length]
            if code in (SSL_REQUEST_CODE, GSSENC_REQUEST_CODE):
                if self.peer is not None:
                    self.peer.raw_bytes_expected += 1
            elif code != CANCEL_REQUEST_CODE:
                self._startup = False
            return Frame(b"", raw)
        if len(buffer) < 5:
            return None
        (length,) = struct.unpack("!i", buffer[1:5])
        if len(buffer) < length + 1:
            return None
        raw = bytes(buffer[: length + 1])
        del buffer[: length + 1]
        return Frame(raw[:1], raw, (raw[5:],))


def pg_is_commit(frame: Frame) -> bool:
    """Whether a client message runs COMMIT (simple query, or a Parse of COMMIT)."""
    if frame.kind == b"Q":
        text = frame.args[0].rstrip(b"\x00")
    elif frame.kind == b"P":
        parts = frame.args[0].split(b"\x00")
        text = parts[1] if len(parts) > 1 else b""
    else:
        return False
    return text.strip().rstrip(b";").strip().upper() in (b"COMMIT", b"COMMIT TRANSACTION", b"END")


def pg_ends_command(frame: Frame) -> bool:
    """Whether a server message completes a command (CommandComplete or ErrorResponse)."""
    return frame.kind in (b"C", b"E")
