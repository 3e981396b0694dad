"""Per-key ordering: messages with the same key are handled in stream order.

A handler declared with ``order_by="subject:2"`` (the third subject token) or
``order_by="header:X-Account"`` gets one lane per key in the process that
owns the key's partition: a key's messages run one after another, in the
order the stream holds them, while different keys run concurrently. When a
message is retried (nak), the later messages of its key wait in their lane
(:class:`BlockedKeys`, their leases kept) until it has an outcome, so they
cannot overtake it.

Across processes and machines, each partition has one owner at a time, and
a new owner starts from the partition's ack floor
(:mod:`eop.ordering.share`, :mod:`eop.ordering.partitions`); docs/ordering.md
has the guarantee and why it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable

from eop import log
from eop.handler import HandlerSpec, parse_order_by
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
    """Keys held back behind a retried message, until it has an outcome.

    The later messages of a blocked key wait in their lane (their leases kept
    by the lane's heartbeats) instead of being nak'ed, since every redelivery would count
    against their attempts. They wait for as long as it takes: the retried
    message comes back to this process's consumer of the key's partition,
    unless the process loses the partition (then they are left for its new
    owner, whose consumer starts below them) or the stream no longer holds the
    message (checked every ``hold_s``).
    """

    def __init__(self) -> None:
        self._blocked: dict[tuple[str, str], tuple[int, asyncio.Event]] = {}

    def blocked_seq(self, handler: str, key: str) -> int | None:
        """The sequence the key waits for, if it is blocked."""
        entry = self._blocked.get((handler, key))
        return None if entry is None else entry[0]

    async def wait(
        self,
        handler: str,
        key: str,
        waiting: int,
        *,
        lost: asyncio.Event,
        stored: Callable[[int], Awaitable[bool]],
        hold_s: float,
        poll_s: float = 1.0,
    ) -> bool:
        """Wait until the key is unblocked (the caller keeps the ``waiting`` messages'
        leases); False if the partition was lost meanwhile (they are left)."""
        logger = log.get_logger(handler=handler)
        check_at = time.monotonic() + hold_s
        while (entry := self._blocked.get((handler, key))) is not None:
            if lost.is_set():
                return False
            if time.monotonic() >= check_at:
                check_at = time.monotonic() + hold_s
                if not await stored(entry[0]):
                    # Deleted from the stream (limits, a purge): it will never come back.
                    self._release(handler, key)
                    break
                logger.info(log.Event.PARTITION_KEY_HELD, seq=entry[0], waiting=waiting)
            # Woken at least every poll_s: the entry may have been replaced, or the
            # partition lost.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(entry[1].wait(), poll_s)
        return not lost.is_set()

    def update(self, handler: str, key: str, msg: Delivery, outcome: Outcome) -> None:
        """Block the key behind a retried message; unblock once it is settled."""
        seq = int(msg.metadata.sequence.stream)
        if outcome in (Outcome.RETRY, Outcome.LEFT):
            current = self._blocked.get((handler, key))
            if current is None or seq <= current[0]:
                self._blocked[(handler, key)] = (seq, asyncio.Event())
        elif self.blocked_seq(handler, key) == seq:
            self._release(handler, key)

    def forget(self, handler: str, keys: Iterable[str]) -> None:
        """Drop the blocks of a partition this process no longer owns."""
        for key in keys:
            self._release(handler, key)

    def _release(self, handler: str, key: str) -> None:
        entry = self._blocked.pop((handler, key), None)
        if entry is not None:
            entry[1].set()
