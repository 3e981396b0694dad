"""A fake JetStream delivery: it records acks, naks, terms and heartbeats."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from typing import Literal

import nats.errors

from eop.testing.failures import ErrorSpec, Failures

Operation = Literal["ack_sync", "nak", "term", "in_progress"]

DEFAULT_TIMESTAMP = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)


@dataclasses.dataclass(frozen=True)
class SequencePair:
    """The consumer and stream sequences of a delivery (as in nats-py)."""

    consumer: int
    stream: int


@dataclasses.dataclass(frozen=True)
class FakeMetadata:
    """The JetStream metadata of a :class:`FakeDelivery`, shaped like nats-py's."""

    sequence: SequencePair
    num_delivered: int
    stream: str
    consumer: str
    timestamp: datetime.datetime
    num_pending: int = 0
    domain: str | None = None


class FakeDelivery:
    """An in-memory JetStream delivery implementing :class:`eop.types.Delivery`.

    It settles like nats-py's ``Msg``: once an ack, nak or term went through,
    any further one raises ``nats.errors.MsgAlreadyAckdError``. What happened
    is recorded in :attr:`acked`, :attr:`naked` (with :attr:`nak_delay`),
    :attr:`termed` and :attr:`in_progress_calls`; :meth:`fail_acks` makes the
    next ``ack_sync`` calls raise (a lost ack reply is a
    ``nats.errors.TimeoutError``, the default).
    """

    def __init__(
        self,
        *,
        subject: str,
        data: bytes,
        stream: str,
        seq: int,
        num_delivered: int = 1,
        headers: dict[str, str] | None = None,
        consumer: str = "eop-test",
        consumer_seq: int | None = None,
        timestamp: datetime.datetime = DEFAULT_TIMESTAMP,
    ) -> None:
        cseq = seq if consumer_seq is None else consumer_seq
        self.subject = subject
        self.data = data
        self.headers = headers
        # The reply subject nats-py parses the metadata from.
        nanos = int(timestamp.timestamp() * 1_000_000_000)
        self.reply = f"$JS.ACK.{stream}.{consumer}.{num_delivered}.{seq}.{cseq}.{nanos}.0"
        self._metadata = FakeMetadata(
            sequence=SequencePair(consumer=cseq, stream=seq),
            num_delivered=num_delivered,
            stream=stream,
            consumer=consumer,
            timestamp=timestamp,
        )
        self.acked = False
        """An ``ack_sync`` went through."""
        self.naked = False
        """A ``nak`` went through."""
        self.nak_delay: float | None = None
        """The delay of the nak that went through."""
        self.termed = False
        """A ``term`` went through."""
        self.ack_attempts = 0
        """``ack_sync`` calls, failed ones included."""
        self.in_progress_calls = 0
        """``in_progress`` calls (heartbeats)."""
        self._failures = Failures("ack_sync", "nak", "term", "in_progress")
        self._progress = asyncio.Event()

    @classmethod
    def make(
        cls,
        data: bytes = b"{}",
        subject: str = "s",
        stream: str = "S",
        seq: int = 1,
        num_delivered: int = 1,
        headers: dict[str, str] | None = None,
        *,
        consumer: str = "eop-test",
        consumer_seq: int | None = None,
        timestamp: datetime.datetime = DEFAULT_TIMESTAMP,
    ) -> FakeDelivery:
        """A delivery of ``data`` on ``subject``, stored in ``stream`` at ``seq``."""
        return cls(
            subject=subject,
            data=data,
            stream=stream,
            seq=seq,
            num_delivered=num_delivered,
            headers=headers,
            consumer=consumer,
            consumer_seq=consumer_seq,
            timestamp=timestamp,
        )

    @property
    def metadata(self) -> FakeMetadata:
        """JetStream metadata: stream, sequences, delivery count, timestamp, consumer."""
        return self._metadata

    @property
    def is_acked(self) -> bool:
        """As nats-py's ``Msg.is_acked``: an ack, nak or term went through (any further one
        raises). :attr:`acked`, :attr:`naked` and :attr:`termed` tell which."""
        return self.acked or self.naked or self.termed

    def redeliver(self) -> FakeDelivery:
        """The next delivery of the same stored message (``num_delivered`` + 1)."""
        meta = self._metadata
        return FakeDelivery(
            subject=self.subject,
            data=self.data,
            stream=meta.stream,
            seq=meta.sequence.stream,
            num_delivered=meta.num_delivered + 1,
            headers=None if self.headers is None else dict(self.headers),
            consumer=meta.consumer,
            consumer_seq=meta.sequence.consumer + 1,
            timestamp=meta.timestamp,
        )

    def fail_acks(
        self, times: int = 1, error: ErrorSpec = nats.errors.TimeoutError
    ) -> FakeDelivery:
        """Make the next ``times`` ``ack_sync`` calls raise ``error`` (default: a lost reply)."""
        return self.fail("ack_sync", times, error)

    def fail(
        self, operation: Operation, times: int = 1, error: ErrorSpec = nats.errors.TimeoutError
    ) -> FakeDelivery:
        """Make the next ``times`` calls of ``operation`` raise ``error``."""
        self._failures.add(operation, times, error)
        return self

    def _check_unsettled(self) -> None:
        if self.is_acked:
            raise nats.errors.MsgAlreadyAckdError(self)

    async def ack_sync(self, timeout: float = 1.0) -> FakeDelivery:
        """Ack and "wait" for the server's confirmation."""
        self.ack_attempts += 1
        self._check_unsettled()
        self._failures.raise_next("ack_sync")
        self.acked = True
        return self

    async def ack(self) -> None:
        """Ack without waiting for a confirmation."""
        self._check_unsettled()
        self._failures.raise_next("ack_sync")
        self.acked = True

    async def nak(self, delay: float | None = None) -> None:
        """Ask for a redelivery after ``delay`` seconds."""
        self._check_unsettled()
        self._failures.raise_next("nak")
        self.naked = True
        self.nak_delay = delay

    async def term(self) -> None:
        """Tell the server never to redeliver."""
        self._check_unsettled()
        self._failures.raise_next("term")
        self.termed = True

    async def in_progress(self) -> None:
        """Reset the AckWait timer (may be called any number of times)."""
        self._failures.raise_next("in_progress")
        self.in_progress_calls += 1
        self._progress.set()

    async def wait_for_in_progress(self, count: int = 1) -> None:
        """Wait until ``in_progress`` has been called ``count`` times in all."""
        while self.in_progress_calls < count:
            self._progress.clear()
            await self._progress.wait()

    def __repr__(self) -> str:
        meta = self._metadata
        return (
            f"<FakeDelivery {meta.stream}#{meta.sequence.stream} subject={self.subject!r} "
            f"delivered={meta.num_delivered}>"
        )
