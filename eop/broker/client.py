"""eop's NATS client: input that is not UTF-8 survived, a read loop that must not end.

NATS subjects and header lines are bytes. The server stores and delivers
them as they were published, UTF-8 or not: a raw protocol frame
(``PUB orders.<0xff> 5``) is enough to put such a message in a stream.
nats-py decodes subjects as strict UTF-8 inside its read loop, so one such
delivery raised there and ended the loop; the connection still said it was
connected, nothing more was read, and every worker the message was
redelivered to stalled the same way.

:class:`Client` (the base of every connection eop opens) decodes what is not
UTF-8 losslessly instead, with :func:`eop.wire.decode`, so the message
reaches eop's protocol, which dead-letters it with the :func:`eop.wire.problem`
found in it. Should the read loop end for another reason while the
connection says it is connected, :class:`Client` logs it and reconnects, as
for a lost connection.

The hot path's part of the client is here too: its messages are
:class:`~eop.broker.delivered.Delivered`, whose JetStream metadata is read
more cheaply than nats-py reads it; :meth:`Client.subscribe_direct` and
:meth:`Client.subscribe_replies` hand messages (or just a reply's subject and
status) over inside the read loop, without nats-py's queue and task hop per
message, and :meth:`Client.publish_many` writes a batch of requests (a
batch's acks) as one command buffer.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from typing import Any

import nats.aio.client
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from eop import log, wire
from eop.broker.delivered import Delivered

# What nats-py refuses in a subject it publishes to: whitespace would end the
# subject's field of the PUB command, CRLF the command itself.
_UNSAFE_SUBJECT = re.compile(r"[ \t\r\n]")


def _is_utf8(raw: bytes) -> bool:
    if raw.isascii():
        return True
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


#: A direct subscription's handler: called in the read loop, must not block or raise.
OnMessage = Callable[[Msg], None]
#: A reply subscription's handler: the subject and the raw header block (or None).
OnReply = Callable[[bytes, "bytes | None"], None]

_STATUS_OFFSET = len(wire.HEADER_LINE)


def status_of(headers: bytes | None) -> bytes | None:
    """The inline status code of a raw header block (``NATS/1.0 503``: b"503"), or None."""
    if not headers:
        return None
    line = headers[_STATUS_OFFSET : headers.find(b"\r\n")].strip()
    return line[:3] or None


class ReadLoopEnded(nats.errors.Error):
    """nats-py's read loop ended while the connection was up: nothing more would be read."""

    def __str__(self) -> str:
        return "nats: the client stopped reading from a connection it still held"


class Client(nats.aio.client.Client):
    """nats-py's client, surviving protocol input that is not UTF-8 (see the module's text).

    Hooks into nats-py's internals, each pinned by the tests (a nats-py
    upgrade that moves them fails there, not in production):
    ``_build_message`` and ``_process_headers`` decode what nats-py cannot,
    ``_read_loop`` is watched for ending while connected, ``_process_msg``
    serves the direct subscriptions, ``msg_class`` builds
    :class:`~eop.broker.delivered.Delivered`; :meth:`publish_many` appends to
    the pending buffer with ``_send_command`` and wakes the flusher with
    ``_flush_pending``, as ``publish`` does.
    """

    eop_closing = False
    """Set once the owner closes or drains the connection: nats-py did not give up on it."""

    msg_class = Delivered

    _eop_recovery: asyncio.Task[None] | None = None

    async def close(self) -> None:
        self.eop_closing = True
        await super().close()

    async def drain(self) -> None:
        self.eop_closing = True
        await super().drain()

    def _build_message(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: Any
    ) -> Any:
        try:
            return super()._build_message(sid, subject, reply, data, headers)
        except UnicodeDecodeError:
            # Rare: the cost of the fallback is paid by bad messages only.
            msg = super()._build_message(sid, b"", b"", data, headers)
            msg.subject, msg.reply = wire.decode(subject), wire.decode(reply)
            return msg

    async def _process_headers(self, headers: bytes | None) -> dict[str, str] | None:
        if headers and not _is_utf8(headers):
            # nats-py would put U+FFFD in place of bad bytes in a value (not
            # telling it from a real one), drop a bad name, and raise in an
            # inline status line.
            return wire.parse_headers(bytes(headers))
        result: dict[str, str] | None = await super()._process_headers(headers)
        return result

    async def subscribe_direct(self, subject: str, on_message: OnMessage) -> Subscription:
        """Subscribe with ``on_message`` called for each message inside the read loop.

        No queue, no task hop per message (nats-py's callbacks run in a task of
        the subscription's, each message passed through an ``asyncio.Queue``).
        The subscription is nats-py's own otherwise: it is subscribed again on
        a reconnect and ends with ``unsubscribe()``.
        """
        sub = await self.subscribe(subject)
        sub._eop_direct = on_message  # type: ignore[attr-defined]  # read in _process_msg
        return sub

    async def subscribe_replies(self, subject: str, on_reply: OnReply) -> Subscription:
        """Like :meth:`subscribe_direct`, but ``on_reply`` gets the subject and the raw
        header block only: no message object at all (for replies whose body says nothing)."""
        sub = await self.subscribe(subject)
        sub._eop_reply = on_reply  # type: ignore[attr-defined]  # read in _process_msg
        return sub

    async def publish_many(
        self, subjects: Sequence[str], payload: bytes, replies: Sequence[str]
    ) -> None:
        """Publish ``payload`` to each of ``subjects``, with the reply subject of the same
        index, as one command appended to nats-py's pending buffer.

        What ``publish`` checks for each message is checked once for all, with
        the same errors, and a refusal sends none of them: an empty subject or
        reply, or one holding whitespace or CRLF (always checked, whatever
        ``skip_subject_validation`` says), ``BadSubjectError``; a closed or
        draining connection, ``ConnectionClosedError`` or
        ``ConnectionDrainingError``; while reconnecting, the whole batch is
        buffered if it fits in the pending buffer, else
        ``OutboundBufferLimitError``. The flusher is woken as ``publish`` wakes it.
        """
        count = len(subjects)
        if count != len(replies):
            raise ValueError("publish_many: one reply subject per subject")
        if count == 0:
            return
        if (
            not (all(subjects) and all(replies))
            or _UNSAFE_SUBJECT.search("".join(subjects))
            or _UNSAFE_SUBJECT.search("".join(replies))
        ):
            raise nats.errors.BadSubjectError
        if self.is_closed:
            raise nats.errors.ConnectionClosedError
        if self.is_draining_pubs:
            raise nats.errors.ConnectionDrainingError
        size = len(payload)
        if size > self._max_payload:
            raise nats.errors.MaxPayloadError
        # One encode for the batch: the subjects and replies hold no LF (checked
        # above), so LF can stand for the end of each PUB line, its payload and
        # the start of the next one.
        separator = f" {size}\r\n".encode() + payload + b"\r\nPUB "
        lines = "\n".join([f"{s} {r}" for s, r in zip(subjects, replies, strict=True)])
        command = b"PUB " + lines.encode().replace(b"\n", separator) + separator[:-4]
        if not self.is_connected and (
            self._max_pending_size <= 0
            or self._pending_data_size + len(command) > self._max_pending_size
        ):
            raise nats.errors.OutboundBufferLimitError
        self.stats["out_msgs"] += count
        self.stats["out_bytes"] += size * count
        await self._send_command(command)
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        sub = self._subs.get(sid)
        on_reply = getattr(sub, "_eop_reply", None)
        if on_reply is not None:
            self.stats["in_msgs"] += 1
            self.stats["in_bytes"] += len(data)
            on_reply(subject, headers)
            return
        on_message = getattr(sub, "_eop_direct", None)
        if on_message is not None:
            self.stats["in_msgs"] += 1
            self.stats["in_bytes"] += len(data)
            # Most deliveries have no headers: no coroutine (nor nats-py's) for them.
            hdr = await self._process_headers(headers) if headers else None
            on_message(self._build_message(sid, subject, reply, data, hdr))
            return
        await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]

    async def _read_loop(self) -> None:
        try:
            await super()._read_loop()
        finally:
            # nats-py ends the loop itself when it reconnects or closes (the
            # status says so by then); any other end leaves a connection that
            # looks up and reads nothing.
            if self.is_connected and not self.eop_closing:
                self._reader_ended()

    def _reader_ended(self) -> None:
        log.get_logger().error(log.Event.NATS_READER_ENDED)
        # From a task of its own: reconnecting cancels the reading task, this one.
        self._eop_recovery = asyncio.get_running_loop().create_task(
            self._process_op_err(ReadLoopEnded())
        )


def reading(nc: NATS) -> bool:
    """False when the connection says it is connected but its read loop has ended."""
    task = getattr(nc, "_reading_task", None)
    return not (nc.is_connected and task is not None and task.done())
