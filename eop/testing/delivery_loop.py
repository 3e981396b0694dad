"""The test kit's delivery loop: each test delivery through its handler's processor.

:class:`~eop.testing.app.TestApp` is one: its calls (``deliver``, ``redeliver``,
``retry``...) make the deliveries; this loop runs them as a worker would (an ordered
handler's in its keys' lanes, a fetched batch in one transaction, each bounded in
time), and records what each came to (:class:`~eop.testing.results.Result`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from eop import errors, message
from eop.handler import HandlerSpec
from eop.protocol import misconfiguration
from eop.protocol.batch import BatchProcessor
from eop.protocol.processor import Processor
from eop.testing.backends import Backend
from eop.testing.deliveries import FakeDelivery
from eop.testing.epochs import FakeEpochs
from eop.testing.lanes import Lanes
from eop.testing.results import Recorder, Result, raise_unexpected
from eop.testing.rows import InboxKey, inbox_key
from eop.testing.session import InMemoryOnly
from eop.types import Outcome

if TYPE_CHECKING:
    from eop.app import App
    from eop.outbox.outgoing import Outgoing
    from eop.types import Delivery


class DeliveryLoop:
    """Test deliveries run through each handler's :class:`~eop.protocol.processor.Processor`,
    as a worker runs them: :class:`~eop.testing.app.TestApp`'s loop, under its calls."""

    def __init__(self, app: App, *, raise_errors: bool, timeout_s: float) -> None:
        self.app = app
        """The app the handlers run in (in database mode: on ``database``)."""
        self.raise_errors = raise_errors
        self.timeout_s = timeout_s
        self.epochs = FakeEpochs()
        """The streams' epochs (one per stream unless a test changes them)."""
        self.outbox: list[Outgoing] = []
        """Every outbox message committed by this test's deliveries, in order."""
        self.results: list[Result] = []
        """Every result of this test's deliveries and retries, in order."""
        self._backend: Backend | None = None
        self._recorder = Recorder()
        self._processors: dict[str, Processor] = {}
        self._misconfigured = misconfiguration.Watch(stop=self._stop_deliveries)
        self._seqs: dict[str, int] = {}
        self._messages: dict[InboxKey, message.Message] = {}
        self._naked: list[tuple[HandlerSpec, FakeDelivery]] = []
        self._lanes = Lanes(self._run, self._held)

    async def _start(self, backend: Backend) -> None:
        """Start the inbox's backend and a processor per handler on it."""
        await backend.start()
        self._backend = backend
        for spec in self.app.handlers.values():
            self._processors[spec.name] = Processor(
                spec=spec,
                settings=self.app.settings,
                store=backend.store,
                epochs=self.epochs,
                observer=self._recorder,
                misconfigured=self._misconfigured,
            )

    async def _stop(self) -> None:
        """Let the critical sections end, then close the backend."""
        for proc in self._processors.values():
            await proc.critical.drain()
        if self._backend is not None:
            await self._backend.close()

    def _stop_deliveries(self, error: errors.ConfigurationError) -> None:
        # As the worker stops: whatever waits to be retried is handed back at once.
        for proc in self._processors.values():
            proc.stopping.set()

    def _raise_misconfiguration(self) -> None:
        error = self._misconfigured.error
        if error is None:
            return
        self._misconfigured.reset()
        for proc in self._processors.values():
            proc.stopping = asyncio.Event()
        raise error

    def _ready(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("use TestApp as `async with TestApp(app) as t:`")
        return self._backend

    def _next_seqs(self, stream: str, count: int) -> int:
        first = self._seqs.get(stream, 0) + 1
        self._seqs[stream] = first + count - 1
        return first

    async def _run_batch(self, spec: HandlerSpec, deliveries: list[FakeDelivery]) -> list[Result]:
        proc = self._processors[spec.name]
        # A worker runs an ordered handler's messages one by one, in their keys' lanes.
        if len(deliveries) == 1 or not self.app.settings.batch_transactions or spec.order_by:
            return [await self._deliver(spec, d) for d in deliveries]
        msgs = [await self._message(spec, d) for d in deliveries]
        batch = BatchProcessor(proc)
        await self._bounded(batch.handle_batch(deliveries, proc.clock()), proc, *deliveries)
        # One transaction: its outbox messages are the batch's, not one message's.
        self.outbox += await self._ready().new_outbox()
        return [
            await self._result(spec, d, m, Outcome.LEFT, outbox=False)
            for d, m in zip(deliveries, msgs, strict=True)
        ]

    async def _deliver(self, spec: HandlerSpec, delivery: FakeDelivery) -> Result:
        """Run one delivery; an ordered handler's in its key's lane (:mod:`eop.testing.lanes`)."""
        if spec.order_by is None:
            return await self._run(spec, delivery)
        return await self._lanes.deliver(spec, delivery)

    async def _held(self, spec: HandlerSpec, delivery: FakeDelivery, behind: int) -> Result:
        """The result of a delivery its key's lane holds back behind sequence ``behind``."""
        msg = await self._message(spec, delivery)
        result = Result(handler=spec.name, outcome=None, message=msg, held_behind=behind)
        self.results.append(result)
        return result

    async def _run(self, spec: HandlerSpec, delivery: FakeDelivery) -> Result:
        proc = self._processors[spec.name]
        msg = await self._message(spec, delivery)
        outcome = await self._bounded(proc.handle(delivery, proc.clock()), proc, delivery)
        return await self._result(spec, delivery, msg, outcome)

    async def _message(self, spec: HandlerSpec, delivery: FakeDelivery) -> message.Message:
        epoch = await self.epochs.get(spec.stream)
        msg = message.from_nats(delivery, subscription=spec.name, stream_epoch=epoch)
        self._messages[inbox_key(msg)] = msg
        return msg

    async def _result(
        self,
        spec: HandlerSpec,
        delivery: Delivery,
        msg: message.Message,
        outcome: Outcome,
        *,
        outbox: bool = True,
    ) -> Result:
        settled, error = self._recorder.take(delivery)
        if settled is not None:
            outcome = settled.outcome
        added = await self._ready().new_outbox() if outbox else []
        self.outbox += added
        if isinstance(delivery, FakeDelivery) and delivery.naked:
            self._naked.append((spec, delivery))
        result = Result(
            handler=spec.name,
            outcome=outcome,
            message=msg,
            error=error,
            reason=None if settled is None else settled.reason,
            outbox=tuple(added),
        )
        self.results.append(result)
        return result

    async def _bounded(self, work: Awaitable[Any], proc: Processor, *deliveries: Delivery) -> Any:
        """``work``, or :class:`DeliveryStalled` if it does not end within :attr:`timeout_s`."""
        task = asyncio.ensure_future(work)
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        if done:
            self._raise_misconfiguration()
            return task.result()
        # As a stopping worker does: a transaction waiting to be retried hands its
        # message back at once; a handler still running is cancelled.
        proc.stopping.set()
        done, _ = await asyncio.wait({task}, timeout=5.0)
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        proc.stopping = asyncio.Event()
        what = ", ".join(f"{d.metadata.stream} #{d.metadata.sequence.stream}" for d in deliveries)
        raise errors.DeliveryStalled(
            f"handler {proc.spec.name!r} did not settle {what} within {self.timeout_s:g} s "
            "(raise TestApp(timeout_s=...) if it is slow): the database kept failing, "
            "or the handler hangs; the worker's log lines (transaction.retry) tell which"
        )

    def _check(self, results: Sequence[Result], raise_errors: bool | None) -> None:
        # What the in-memory session cannot do is the test's limit: counted as the
        # handler's failure, it would end as a dead letter no worker would make.
        raise_unexpected([r for r in results if isinstance(r.error, InMemoryOnly)], advice="")
        if self.raise_errors if raise_errors is None else raise_errors:
            raise_unexpected(results)


def delivery_headers(
    headers: Mapping[str, str] | None, msg_id: str | None
) -> dict[str, str] | None:
    """A delivery's headers: those given, with ``msg_id`` as its ``Nats-Msg-Id``."""
    merged = dict(headers or {})
    for name, value in merged.items():
        # NATS headers are text: a test's other value could never arrive.
        if not isinstance(name, str) or not isinstance(value, str):
            raise errors.ConfigurationError(
                f"header {name!r}: {value!r} is not text: NATS headers are strings "
                f"(str({value!r}) if that is what the publisher sends)"
            )
    if msg_id is not None:
        merged["Nats-Msg-Id"] = msg_id
    return merged or None


def next_delivery(msg: message.Message, spec: HandlerSpec) -> FakeDelivery:
    """The next delivery of a stored message."""
    return FakeDelivery.make(
        data=msg.data,
        subject=msg.subject,
        stream=msg.stream,
        seq=msg.seq,
        num_delivered=msg.num_delivered + 1,
        headers=dict(msg.headers) or None,
        consumer=spec.durable,
        timestamp=msg.timestamp or datetime.datetime.now(datetime.timezone.utc),
    )
