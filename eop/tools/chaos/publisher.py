"""The publisher of a chaos run: every logical message once, some twice, spread over time.

Each logical message is published with its key as ``Nats-Msg-Id``. Some are
published again at once (inside the server's duplicate window: the server
drops them), some again after the window (the server stores them a second
time: eop's msg-id guard must skip them). A publish that fails because NATS is
down is retried with the same id until it gets through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Mapping, Sequence

import nats.errors
from nats.js import JetStreamContext

from eop.tools.chaos.target import Payload

_PUBLISH_ERRORS = (nats.errors.Error, asyncio.TimeoutError, OSError)


@dataclasses.dataclass(frozen=True)
class Send:
    """One publish: which payload, and when (offset from the start of the chaos phase)."""

    at_s: float
    payload: Payload
    late: bool = False
    """A republish after the duplicate window."""


def plan(
    payloads: Sequence[Payload], seed: int, spread_s: float, duplicate_window_s: float
) -> list[Send]:
    """When each payload is published, and which are republished inside or after the window."""
    rng = random.Random(f"eop-chaos-publish:{seed}")
    sends: list[Send] = []
    step = spread_s / max(len(payloads), 1)
    for index, payload in enumerate(payloads):
        at = index * step
        sends.append(Send(at, payload))
        roll = rng.random()
        if roll < 0.10:
            sends.append(Send(at + rng.uniform(0.0, duplicate_window_s * 0.25), payload))
        elif roll < 0.14:
            later = at + duplicate_window_s + rng.uniform(0.5, 2.0)
            sends.append(Send(later, payload, late=True))
    sends.sort(key=lambda s: s.at_s)
    return sends


@dataclasses.dataclass
class Publisher:
    """Publishes a :func:`plan` through a JetStream context, retrying through outages."""

    js: JetStreamContext
    subject: str
    headers: Mapping[str, str]
    """Added to every message (the canary headers)."""
    publishes: int = 0
    duplicates: int = 0
    retries: int = 0

    async def run(self, sends: Sequence[Send], started: float) -> None:
        """Publish each send at its time (``started`` is the phase's ``time.monotonic()``)."""
        for send in sends:
            delay = started + send.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.publish(send.payload)

    async def publish(self, payload: Payload) -> None:
        """Publish ``payload`` with its key as ``Nats-Msg-Id``, until the server has it."""
        headers = {**self.headers, **payload.headers, "Nats-Msg-Id": payload.key}
        wait = 0.05
        while True:
            try:
                ack = await self.js.publish(
                    payload.subject or self.subject, payload.data, headers=headers, timeout=2
                )
            except _PUBLISH_ERRORS:
                # NATS is down or restarting: the same id again is safe.
                self.retries += 1
                await asyncio.sleep(wait)
                wait = min(wait * 2, 1.0)
                continue
            self.publishes += 1
            if ack.duplicate:
                self.duplicates += 1
            return
