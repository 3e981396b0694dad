"""The leases of the deliveries a process holds, renewed until each is settled.

A delivery's lease is the server's AckWait: once it runs out, the server hands
the message to another consumer and counts one more delivery, and past
``max_deliveries`` deliveries eop dead-letters the message as a crash loop.
So a message a live worker holds must never run out of lease, whatever it
waits for: its lane (the earlier messages of its key), a lock another
transaction holds, its batch's neighbours run one at a time, a transaction
retried through an outage, a pooled connection or a thread.

This module is the one place where leases are renewed. The worker holds every
delivery from the moment it is fetched to the moment it is settled (acked,
nak'ed, terminated or left); the protocol holds it again around the parts it
may run without a worker (a test kit's processor). One task per process sends
``in_progress()`` for each held delivery whose lease was last renewed a third
of its AckWait ago, and :meth:`Leases.renewed_at` tells the processor how much
lease a delivery has left before it starts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterable

from eop import log
from eop.types import Delivery

_SHARE = 3
"""A lease is renewed once a 1/_SHARE of it has passed: two renewals may fail in a row
(a NATS reconnect) before it runs out."""

_RETRY_S = 1.0
"""After a failed renewal, the next try: soon, but not in a loop while NATS is away."""

_MIN_SLEEP_S = 0.01

_EARLY = 0.25
"""A round also renews what falls due within this share of its renewal interval:
deliveries fetched one after another then fall into a few cohorts, renewed together,
rather than waking the task for each (every wake scans every held delivery)."""


@dataclasses.dataclass
class _Held:
    delivery: Delivery
    renew_every_s: float
    renewed_at: float
    held_since: float
    due_at: float
    count: int = 1


class Leases:
    """Every delivery this process holds, each renewed until it is released.

    :meth:`hold` and :meth:`release` count: a delivery held twice (by the
    worker since its fetch, and by the processor around a transaction) is
    renewed until both released it, and renewed once per round all the same.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[int, _Held] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._next_at: float | None = None
        """When the renewing task wakes next by itself (None: it is not asleep)."""
        self._failing = False
        self._logger = log.get_logger()

    def __len__(self) -> int:
        return len(self._held)

    def hold(
        self, deliveries: Iterable[Delivery], ack_wait_s: float, *, at: float | None = None
    ) -> None:
        """Keep the leases of ``deliveries`` (last renewed ``at``, on the clock; now by
        default) until they are released."""
        renewed_at = self._clock() if at is None else at
        every_s = ack_wait_s / _SHARE
        added = False
        for delivery in deliveries:
            held = self._held.get(id(delivery))
            if held is not None and held.delivery is delivery:
                held.count += 1
            else:
                self._held[id(delivery)] = _Held(
                    delivery, every_s, renewed_at, renewed_at, renewed_at + every_s
                )
                added = True
        # Wake the task only when this lease falls due before it would wake anyway (a
        # shorter AckWait, an old ``at``): a wake per hold would scan every held
        # delivery per fetched message.
        if added and (self._next_at is None or renewed_at + every_s < self._next_at):
            self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._renew())

    def release(self, deliveries: Iterable[Delivery]) -> None:
        """One holder of each of ``deliveries`` is done with it (unknown ones are ignored)."""
        for delivery in deliveries:
            held = self._held.get(id(delivery))
            if held is None or held.delivery is not delivery:
                continue
            held.count -= 1
            if held.count <= 0:
                del self._held[id(delivery)]

    @contextlib.asynccontextmanager
    async def keep(self, deliveries: Iterable[Delivery], ack_wait_s: float) -> AsyncIterator[None]:
        """Hold ``deliveries`` for the body."""
        kept = list(deliveries)
        self.hold(kept, ack_wait_s)
        try:
            yield
        finally:
            self.release(kept)

    def renewed_at(self, delivery: Delivery, default: float) -> float:
        """When ``delivery``'s lease was last renewed (``default`` if it is not held)."""
        held = self._held.get(id(delivery))
        if held is None or held.delivery is not delivery:
            return default
        return max(held.renewed_at, default)

    def oldest_s(self) -> float:
        """How long the longest-held delivery has been held, renewals included (0 if
        none): a delivery held for many AckWaits waits for something that does not come."""
        since = min((h.held_since for h in self._held.values()), default=None)
        return 0.0 if since is None else self._clock() - since

    async def close(self) -> None:
        """Stop renewing (the process is stopping; what it holds is handed back)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _renew(self) -> None:
        try:
            while self._held:
                now = self._clock()
                due = [h for h in self._held.values() if h.due_at <= now + _EARLY * h.renew_every_s]
                settled = [h for h in due if h.delivery.is_acked]
                if settled:
                    # Nak'ed (or acked, termed) while still held, as a retried message
                    # of a batch whose others still run: an in_progress() now would
                    # reset the server's redelivery timer to a whole AckWait, not the
                    # nak's delay. Its holders' releases then find nothing.
                    for held in settled:
                        del self._held[id(held.delivery)]
                    due = [h for h in due if not h.delivery.is_acked]
                if due:
                    await self._send(due, now)
                next_at = min((h.due_at for h in self._held.values()), default=None)
                if next_at is None:
                    return
                # Woken by the clock or by a hold due sooner (a shorter AckWait); a timer
                # rather than wait_for, which would be one more task per round.
                self._wake.clear()
                self._next_at = next_at
                timer = asyncio.get_running_loop().call_later(
                    max(next_at - self._clock(), _MIN_SLEEP_S), self._wake.set
                )
                try:
                    await self._wake.wait()
                finally:
                    timer.cancel()
                    self._next_at = None
        finally:
            self._next_at = None

    async def _send(self, due: list[_Held], asked_at: float) -> None:
        results = await asyncio.gather(
            *(h.delivery.in_progress() for h in due), return_exceptions=True
        )
        failed: list[BaseException] = []
        for held, result in zip(due, results, strict=True):
            if result is None:
                held.renewed_at = max(held.renewed_at, asked_at)
                held.due_at = held.renewed_at + held.renew_every_s
            elif isinstance(result, asyncio.CancelledError):
                raise result
            else:
                held.due_at = asked_at + min(_RETRY_S, held.renew_every_s)
                failed.append(result)
        if failed:
            # One warning per streak of failed rounds, not one per delivery or per
            # round: during an outage a worker may hold hundreds, retried each second.
            level = self._logger.debug if self._failing else self._logger.warning
            level(
                log.Event.HEARTBEAT_FAILED,
                deliveries=len(failed),
                error=log.brief_error(failed[0]),
            )
        self._failing = bool(failed)
