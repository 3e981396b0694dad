"""A delivery's JetStream metadata, read from its reply subject more cheaply than nats-py.

:class:`Delivered` is the message class of every connection eop opens
(:class:`eop.broker.client.Client`): nats-py's ``Msg`` whose
:attr:`~Delivered.metadata` is parsed by :func:`metadata`, without nats-py's
two frozen dataclasses per delivery, which cost more to build than the rest
of a delivery's preparation on the hot path.
"""

from __future__ import annotations

import datetime
from typing import Any

from nats.aio.msg import Msg


class SequencePair:
    """A delivery's stream and consumer sequences (as nats-py's ``Msg.Metadata.SequencePair``)."""

    __slots__ = ("consumer", "stream")

    def __init__(self, stream: int, consumer: int) -> None:
        self.stream = stream
        self.consumer = consumer

    def __repr__(self) -> str:
        return f"SequencePair(stream={self.stream}, consumer={self.consumer})"


class Metadata:
    """The JetStream metadata of a delivery, read from its reply subject.

    The attributes of nats-py's ``Msg.Metadata``, without its two frozen
    dataclasses: those cost more to build than the rest of a delivery's
    preparation (parsed once per message on the hot path).
    """

    __slots__ = (
        "consumer",
        "domain",
        "num_delivered",
        "num_pending",
        "sequence",
        "stream",
        "timestamp",
    )

    def __init__(
        self,
        stream: str,
        consumer: str,
        sequence: SequencePair,
        num_delivered: int,
        num_pending: int,
        timestamp: datetime.datetime,
        domain: str | None = None,
    ) -> None:
        self.stream = stream
        self.consumer = consumer
        self.sequence = sequence
        self.num_delivered = num_delivered
        self.num_pending = num_pending
        self.timestamp = timestamp
        self.domain = domain

    def __repr__(self) -> str:
        return (
            f"Metadata(stream={self.stream!r}, consumer={self.consumer!r}, "
            f"sequence={self.sequence!r}, num_delivered={self.num_delivered})"
        )


_UTC = datetime.timezone.utc
_V1_TOKENS = 9  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ns>.<pending>


def metadata(reply: str) -> Metadata:
    """The JetStream metadata in a delivery's reply subject.

    Both of the server's formats, as nats-py reads them (the same timestamp
    to the microsecond); ``nats.errors.NotJSMessageError`` if ``reply``
    is not a JetStream ack subject.
    """
    tokens = reply.split(".")
    if len(tokens) == _V1_TOKENS and tokens[0] == "$JS" and tokens[1] == "ACK":
        _, _, stream, consumer, delivered, sseq, cseq, ns, pending = tokens
        domain = None
    else:
        # The rare format with a domain and an account: nats-py's own reading.
        meta = Msg.Metadata._from_reply(reply)
        return Metadata(
            meta.stream,
            meta.consumer,
            SequencePair(meta.sequence.stream, meta.sequence.consumer),
            meta.num_delivered,
            meta.num_pending,
            meta.timestamp,
            meta.domain,
        )
    return Metadata(
        stream,
        consumer,
        SequencePair(int(sseq), int(cseq)),
        int(delivered),
        int(pending),
        datetime.datetime.fromtimestamp(int(ns) / 1_000_000_000.0, _UTC),
        domain,
    )


class Delivered(Msg):
    """nats-py's ``Msg`` with a cheaper :attr:`metadata` (:func:`metadata`), the same once read."""

    @property
    def metadata(self) -> Any:  # Any: a delivered.Metadata in place of nats-py's type
        meta = self._metadata
        if meta is None:
            meta = self._metadata = metadata(self.reply)  # type: ignore[assignment]  # same attributes
        return meta
