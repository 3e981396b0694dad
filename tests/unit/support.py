"""Shared helpers of the unit tests: tiny settings, a scripted handler harness."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from eop import testing
from eop.handler import HandlerSpec
from eop.message import Message
from eop.protocol import processor as processor_mod
from eop.settings import Settings

# Small enough that the unit suite runs in seconds; never asserted on.
FAST = Settings(
    max_attempts=3,
    backoff_base_s=0.01,
    backoff_max_s=1.0,
    ack_timeout_s=0.05,
    ack_give_up_s=0.2,
    tx_retries=2,
    lease_margin_s=0.5,
    ack_wait_s=30.0,
)

STREAM = "ORDERS"
SUBJECT = "orders.new"

# What a scripted handler does on one call, after adding its effect to the
# session: nothing (None), raise an exception, or await a coroutine function.
Step = BaseException | Callable[[Message, Any], Awaitable[None]] | None


@dataclasses.dataclass
class Harness:
    """A Processor wired to a MemoryStore and FakeEpochs, with a scripted handler."""

    processor: processor_mod.Processor
    store: testing.MemoryStore
    epochs: testing.FakeEpochs
    calls: list[Message]
    script: list[Step]

    @property
    def spec(self) -> HandlerSpec:
        return self.processor.spec

    async def handle(
        self, delivery: testing.FakeDelivery, received_at: float | None = None
    ) -> processor_mod.Outcome:
        """Process ``delivery`` as if it had just been fetched."""
        now = self.processor.clock() if received_at is None else received_at
        return await self.processor.handle(delivery, now)

    def failed_before(self, delivery: testing.FakeDelivery, failures: int) -> None:
        """Record ``failures`` earlier handler failures of ``delivery``'s message."""
        key = (self.spec.name, STREAM, "e1", delivery.metadata.sequence.stream)
        self.store.attempts[key] = failures

    def ran_before(self, delivery: testing.FakeDelivery, runs: int) -> None:
        """Record ``runs`` earlier runs of ``delivery``'s message that had no outcome."""
        key = (self.spec.name, STREAM, "e1", delivery.metadata.sequence.stream)
        self.store.runs[key] = runs

    def then(self, *steps: Step) -> Harness:
        """Script the next handler calls."""
        self.script.extend(steps)
        return self


def effect_of(msg: Message) -> tuple[str, int, bytes]:
    """What the scripted handler adds to its session."""
    return ("effect", msg.seq, msg.data)


MakeHarness = Callable[..., Harness]


def delivery(
    data: bytes = b'{"id": 1}',
    *,
    seq: int = 1,
    num_delivered: int = 1,
    headers: dict[str, str] | None = None,
    subject: str = SUBJECT,
) -> testing.FakeDelivery:
    """A FakeDelivery on the default stream and subject."""
    return testing.FakeDelivery.make(
        data=data,
        subject=subject,
        stream=STREAM,
        seq=seq,
        num_delivered=num_delivered,
        headers=headers,
    )


def events(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    """The captured log entries of one event."""
    return [entry for entry in logs if entry["event"] == event]
