"""Per-key ordering: messages with the same key are handled in stream order.

A handler declared with ``order_by="subject:2"`` (the third subject token) or
``order_by="header:X-Account"`` gets one lane per key in each worker process:
a key's messages run one after another, in the order the stream holds them,
while different keys run concurrently. When a message is retried (nak), the
later messages of its key wait in their lane (:class:`BlockedKeys`, their
leases kept) until it has an outcome, so they cannot overtake it.

Across worker processes, order holds when one process consumes a key (for
example one worker per consumer, or a consumer per key range); two processes
sharing a consumer each keep their own lanes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from eop import log
from eop.broker import ack
from eop.handler import HandlerSpec, parse_order_by
from eop.settings import Settings
from eop.types import Delivery, Outcome


def key_of(spec: HandlerSpec, msg: Delivery) -> str:
    """The ordering key of a delivery (empty when the token or header is missing)."""
    assert spec.order_by is not None
    kind, arg = parse_order_by(spec.order_by)
    if kind == "subject":
        tokens = str(msg.subject).split(".")
        index = int(arg)
        return tokens[index] if index < len(tokens) else ""
    headers = msg.headers or {}
    return str(headers.get(arg, ""))


class BlockedKeys:
    """Keys held back behind a retried message, until it has an outcome or time passes.

    The later messages of a blocked key wait in their lane (their leases kept
    by heartbeats) instead of being nak'ed, since every redelivery would count
    against their attempts.
    """

    def __init__(self) -> None:
        self._blocked: dict[tuple[str, str], tuple[int, float, asyncio.Event]] = {}

    def blocked_seq(self, handler: str, key: str) -> int | None:
        """The sequence the key waits for, if it is blocked and the block is still fresh."""
        entry = self._blocked.get((handler, key))
        if entry is None:
            return None
        if time.monotonic() > entry[1]:
            # The retried message went to another process, or is gone: stop waiting.
            self._release(handler, key)
            return None
        return entry[0]

    async def wait(
        self, handler: str, key: str, deliveries: Sequence[Delivery], beat_s: float
    ) -> None:
        """Wait until the key is unblocked, keeping the waiting deliveries' leases."""
        logger = log.get_logger(handler=handler)
        async with ack.heartbeats(deliveries, beat_s, [logger] * len(deliveries)):
            while (entry := self._blocked.get((handler, key))) is not None:
                remaining = entry[1] - time.monotonic()
                if remaining <= 0:
                    self._release(handler, key)
                    return
                # Woken at least every beat_s: the entry may have been replaced.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(entry[2].wait(), min(beat_s, remaining))

    def update(self, handler: str, key: str, msg: Delivery, outcome: Outcome, s: Settings) -> None:
        """Block the key behind a retried message; unblock once it is settled."""
        seq = int(msg.metadata.sequence.stream)
        if outcome in (Outcome.RETRY, Outcome.LEFT):
            current = self._blocked.get((handler, key))
            if current is None or seq <= current[0]:
                hold_s = s.backoff_max_s + s.ack_wait_s
                self._blocked[(handler, key)] = (seq, time.monotonic() + hold_s, asyncio.Event())
        elif self.blocked_seq(handler, key) == seq:
            self._release(handler, key)

    def _release(self, handler: str, key: str) -> None:
        entry = self._blocked.pop((handler, key), None)
        if entry is not None:
            entry[2].set()
