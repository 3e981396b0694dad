"""The head messages of an ordered handler's lanes, settled together.

Each lane of an ordered handler (:mod:`eop.ordering.lanes`) runs its key's
messages one at a time: it hands its next message to :meth:`Heads.handle`
and waits for that message's outcome before it hands the following one.
A message handed in while no transaction of the handler runs starts at
once, alone. While some run, the messages handed in wait here: each
transaction that ends starts the next with all of them (up to ``batch``), a
transaction of :class:`eop.protocol.batch.BatchProcessor`: one multi-row
claim before any handler runs, each handler in turn, one COMMIT, the acks
confirmed together. More start beside the running ones, up to the
process's connections, for each group of waiting messages (:data:`GROUP`),
or once the first has waited :data:`LINGER_S` (2 ms), so that a slow
handler holds no other key back; the waiting are spread over them. A lane
that spent most of its time in BEGIN, the claim, COMMIT and an ack of its
own now shares them with the other lanes: under load, an ordered message
costs the worker and PostgreSQL a fraction of its own transaction's work,
while a lone message still starts without waiting.

The per-key order holds as before: a batch holds at most one message per key
(a lane has one message here at a time), and a lane learns its message's
outcome only once that outcome committed (or the message was left, nak'ed or
parked, which blocks the key). A failing handler is isolated as in any batch
(:mod:`eop.protocol.batch`): its message is settled alone, the others commit.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from eop.protocol import batch
from eop.protocol.processor import Processor
from eop.types import Delivery, Outcome

#: How long a message handed in beside running transactions waits for one to end
#: before it takes a free connection anyway: gathering must not hold a key back
#: behind another key's slow handler for longer than this.
LINGER_S = 0.002

#: Waiting messages that open another transaction beside running ones (fewer wait for
#: one to end, or the linger): a transaction shared by several keys costs PostgreSQL and
#: the worker about what one message's own does, while each transaction runs its
#: handlers one after another; groups this small keep most connections busy.
GROUP = 4


@dataclasses.dataclass(eq=False)
class _Waiting:
    delivery: Delivery
    received_at: float
    outcome: asyncio.Future[Outcome]


class Heads:
    """Runs the messages an ordered handler's lanes hand in, together when they queue.

    ``transactions`` is how many batches may run at once (the process's
    connections: more would only wait for one), ``most`` the largest batch,
    ``spawn`` starts a batch's task where the worker waits for it at a stop.
    With ``together`` False (``batch_transactions``), each message runs alone.
    """

    def __init__(
        self,
        proc: Processor,
        *,
        transactions: int,
        most: int,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[Any]],
        together: bool = True,
    ) -> None:
        self._proc = proc
        self._transactions = max(1, transactions)
        self._most = max(1, most)
        self._spawn = spawn
        self._together = together
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._group = GROUP
        self._running = 0
        self._timer: asyncio.TimerHandle | None = None
        self._stop_watch: asyncio.Task[None] | None = None

    async def handle(self, delivery: Delivery, received_at: float) -> Outcome:
        """Process ``delivery`` (fetched, or its lease last renewed, at ``received_at``);
        returns once its outcome committed, or it was left, nak'ed or dead-lettered."""
        if self._proc.stopping.is_set():
            # The worker stops: what has not started is handed back, not run through
            # the stop's grace one batch after another.
            return await self._proc.hand_back(delivery)
        if not self._together or delivery.metadata.num_delivered > 1:
            # A redelivery forgets the failures counted for it (the per-message protocol
            # does that); they are rare.
            return await self._alone(delivery, received_at)
        if not self._waiting and self._running == 0:
            # Nothing runs and nobody waits: alone, in the lane's own task, at once.
            self._running += 1
            try:
                return await self._alone(delivery, received_at)
            finally:
                self._running -= 1
                self._start(anyway=1)
        loop = asyncio.get_running_loop()
        waiting = _Waiting(delivery, received_at, loop.create_future())
        self._waiting.append(waiting)
        if self._stop_watch is None:
            self._stop_watch = asyncio.create_task(self._hand_back_at_stop())
        self._start(anyway=0)
        if self._waiting and self._timer is None:
            self._timer = loop.call_later(LINGER_S, self._lingered)
        try:
            return await waiting.outcome
        except asyncio.CancelledError:
            # Not taken yet: it never runs. Taken: its batch goes on (its own task).
            if waiting in self._waiting:
                self._waiting.remove(waiting)
            raise

    async def _alone(self, delivery: Delivery, received_at: float) -> Outcome:
        outcome = await self._proc.handle(delivery, received_at)
        batch.log_settled(self._proc.spec.name, [delivery], [outcome])
        return outcome

    def _lingered(self) -> None:
        """The first waiting message waited :data:`LINGER_S`: start it, and every one
        waiting with it, on a free connection."""
        self._timer = None
        self._start(anyway=1)

    def _start(self, *, anyway: int) -> None:
        """Start the waiting messages' transactions, spread over the free connections:
        ``anyway`` (in place of one that ended, or after the linger), when none runs, or
        when a group (:attr:`_group`) waits, as many transactions as the waiting fill with
        a group each, at least one."""
        if self._proc.stopping.is_set() and self._waiting:
            taken = list(self._waiting)
            self._waiting.clear()
            self._spawn(self._hand_back(taken))
            return
        free = self._transactions - self._running
        waiting = len(self._waiting)
        if not waiting or free <= 0:
            return
        if not (anyway or self._running == 0 or waiting >= self._group):
            return
        # Spread rather than all in one: a transaction's handlers run one after another,
        # and the lanes of one batch come back together; taken whole, they would keep
        # riding one transaction and the handler's concurrency would shrink to a few.
        batches = max(1, min(free, waiting // self._group))
        size = min(-(-waiting // batches), self._most)
        for _ in range(batches):
            if not self._waiting:
                break
            taken = [self._waiting.popleft() for _ in range(min(size, len(self._waiting)))]
            self._running += 1
            self._spawn(self._run(taken))

    async def _hand_back_at_stop(self) -> None:
        """When the worker stops, hand the waiting messages back at once, not once a
        running transaction ends (under contention, one lock timeout or more)."""
        await self._proc.stopping.wait()
        self._start(anyway=0)

    async def _hand_back(self, taken: Sequence[_Waiting]) -> None:
        """The worker stops: the waiting messages are handed back unrun, their lanes told."""
        for waiting in taken:
            try:
                outcome = await self._proc.hand_back(waiting.delivery)
            except BaseException:
                waiting.outcome.cancel()
                raise
            if not waiting.outcome.done():
                waiting.outcome.set_result(outcome)

    async def _run(self, taken: Sequence[_Waiting]) -> None:
        try:
            received_at = min(w.received_at for w in taken)
            results = await batch.BatchProcessor(self._proc).settle_each(
                [w.delivery for w in taken], received_at
            )
        except BaseException:
            # Cancelled at a stop: the lanes waiting for it end too.
            for waiting in taken:
                waiting.outcome.cancel()
            raise
        finally:
            self._running -= 1
            self._start(anyway=1)
        batch.log_settled(
            self._proc.spec.name,
            [w.delivery for w in taken],
            [r for r in results if isinstance(r, Outcome)],
        )
        for waiting, result in zip(taken, results, strict=True):
            if waiting.outcome.done():
                continue
            if isinstance(result, Outcome):
                waiting.outcome.set_result(result)
            else:
                waiting.outcome.set_exception(result)
