"""Instrumentation hooks: what the worker and the protocol tell metrics, health and tracing.

The processor, the batches and the worker call an :class:`Observer` at a few
points of a message's life. The base class does nothing, and the worker uses
its shared :data:`NOOP` instance when metrics and tracing are off, so those
calls cost one method call each. Implementations live in :mod:`eop.observe.metrics`,
:mod:`eop.observe.health` and :mod:`eop.observe.tracing`; :class:`Fanout` combines them.

Hooks must never raise into the protocol and must not block: they run on the
event loop, between a COMMIT and its ack among other places.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from eop.handler import HandlerSpec

if TYPE_CHECKING:
    from eop.types import Delivery, Outcome


@dataclasses.dataclass(slots=True)
class Settled:
    """A delivery was settled: what :meth:`Observer.outcome` is told (observers only read it).

    ``reason`` is the dead letter's reason; for a processed message ``ack_s``
    is the time from COMMIT to the confirmed ack and ``acked`` is False when
    the ack was given up after the COMMIT.
    """

    spec: HandlerSpec
    delivery: Delivery
    outcome: Outcome
    reason: str | None = None
    ack_s: float | None = None
    acked: bool = True


class Observer:
    """Receives the events of message processing; this base class ignores them all."""

    def received(self, spec: HandlerSpec, deliveries: Sequence[Delivery]) -> None:
        """Deliveries of ``spec`` start being processed (one message, or a batch)."""

    def outcome(self, event: Settled) -> None:
        """A delivery was settled (one event per delivery, whatever its outcome)."""

    def failed(self, spec: HandlerSpec, delivery: Delivery, error: BaseException) -> None:
        """The handler raised on this delivery (its outcome follows: retry or dead letter)."""

    def errored(
        self, spec: HandlerSpec, deliveries: Sequence[Delivery], error: BaseException
    ) -> None:
        """eop's own I/O failed beyond its retries while processing these deliveries."""

    def done(self, spec: HandlerSpec, deliveries: Sequence[Delivery]) -> None:
        """The deliveries passed to :meth:`received` are no longer in flight."""

    def handler_started(self, spec: HandlerSpec, arg: Any) -> Any:
        """The handler function is called with ``arg``; returns a token.

        ``arg`` is a Message (a list for batch handlers), or the decoded payload
        of a typed handler.
        """
        return None

    def handler_finished(self, spec: HandlerSpec, token: Any, seconds: float) -> None:
        """The handler call that returned ``token`` ended (returned or raised)."""

    def watches_handlers(self) -> bool:
        """Whether :meth:`handler_started` and :meth:`handler_finished` do anything here: if
        not, :func:`instrument` leaves the handler unwrapped (asked once, as a worker starts).

        True when a subclass overrides either of them.
        """
        cls = type(self)
        return (
            cls.handler_started is not Observer.handler_started
            or cls.handler_finished is not Observer.handler_finished
        )

    def outbox_published(self, rows: int) -> None:
        """The relay published ``rows`` outbox rows (PubAck received, marked)."""

    def outbox_parked(self, rows: int, reason: str) -> None:
        """The relay parked ``rows`` outbox rows for ``reason``."""

    def outbox_backlog(self, pending: int, oldest_s: float, parked: int) -> None:
        """The outbox holds ``pending`` unpublished rows, the oldest ``oldest_s`` old."""

    def partitions_changed(self, spec: HandlerSpec, action: str, owned: int) -> None:
        """This process ``acquired``, ``released`` or ``lost`` a partition of ``spec``'s;
        it owns ``owned`` now."""

    def unacked(self, spec: HandlerSpec, oldest_s: float, stuck: int) -> None:
        """``spec``'s oldest unacknowledged delivery has waited ``oldest_s`` at least (0:
        none waits); ``stuck`` of its consumers have one waiting past the stuck bound."""


NOOP = Observer()
"""The observer of a worker without metrics and tracing."""


class Fanout(Observer):
    """Passes every event to several observers, in order."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)

    def received(self, spec: HandlerSpec, deliveries: Sequence[Delivery]) -> None:
        """Pass :meth:`Observer.received` on."""
        for o in self.observers:
            o.received(spec, deliveries)

    def outcome(self, event: Settled) -> None:
        """Pass :meth:`Observer.outcome` on."""
        for o in self.observers:
            o.outcome(event)

    def failed(self, spec: HandlerSpec, delivery: Delivery, error: BaseException) -> None:
        """Pass :meth:`Observer.failed` on."""
        for o in self.observers:
            o.failed(spec, delivery, error)

    def errored(
        self, spec: HandlerSpec, deliveries: Sequence[Delivery], error: BaseException
    ) -> None:
        """Pass :meth:`Observer.errored` on."""
        for o in self.observers:
            o.errored(spec, deliveries, error)

    def done(self, spec: HandlerSpec, deliveries: Sequence[Delivery]) -> None:
        """Pass :meth:`Observer.done` on."""
        for o in self.observers:
            o.done(spec, deliveries)

    def handler_started(self, spec: HandlerSpec, arg: Any) -> Any:
        """Pass :meth:`Observer.handler_started` on; the token holds each observer's."""
        return [o.handler_started(spec, arg) for o in self.observers]

    def handler_finished(self, spec: HandlerSpec, token: Any, seconds: float) -> None:
        """Pass :meth:`Observer.handler_finished` on, in reverse order (tokens nest)."""
        for o, t in reversed(list(zip(self.observers, token, strict=True))):
            o.handler_finished(spec, t, seconds)

    def watches_handlers(self) -> bool:
        """Whether any of the observers watches handler calls."""
        return any(o.watches_handlers() for o in self.observers)

    def outbox_published(self, rows: int) -> None:
        """Pass :meth:`Observer.outbox_published` on."""
        for o in self.observers:
            o.outbox_published(rows)

    def outbox_parked(self, rows: int, reason: str) -> None:
        """Pass :meth:`Observer.outbox_parked` on."""
        for o in self.observers:
            o.outbox_parked(rows, reason)

    def outbox_backlog(self, pending: int, oldest_s: float, parked: int) -> None:
        """Pass :meth:`Observer.outbox_backlog` on."""
        for o in self.observers:
            o.outbox_backlog(pending, oldest_s, parked)

    def partitions_changed(self, spec: HandlerSpec, action: str, owned: int) -> None:
        """Pass :meth:`Observer.partitions_changed` on."""
        for o in self.observers:
            o.partitions_changed(spec, action, owned)

    def unacked(self, spec: HandlerSpec, oldest_s: float, stuck: int) -> None:
        """Pass :meth:`Observer.unacked` on."""
        for o in self.observers:
            o.unacked(spec, oldest_s, stuck)


def combine(observers: Sequence[Observer]) -> Observer:
    """One observer for ``observers``: :data:`NOOP` for none, itself for one."""
    if not observers:
        return NOOP
    if len(observers) == 1:
        return observers[0]
    return Fanout(observers)


def instrument(spec: HandlerSpec, observer: Observer) -> HandlerSpec:
    """``spec`` with its handler function wrapped to report its calls to ``observer``.

    The wrapper keeps the function's kind (``async def`` or plain ``def``), so
    eop still runs a sync handler in a worker thread; it is not applied at all
    when ``observer`` does not watch handler calls (:meth:`Observer.watches_handlers`,
    :data:`NOOP` among them). Keyword arguments (a typed handler's raw
    message) pass through; the payload binding stays the original function's.
    """
    if not observer.watches_handlers():
        # A wrapper costs a coroutine, two clock reads and two calls a message.
        return spec
    func: Any = spec.func
    if spec.is_async:

        async def observed_async(arg: Any, session: Any, **extra: Any) -> None:
            token = observer.handler_started(spec, arg)
            started = time.perf_counter()
            try:
                await func(arg, session, **extra)
            finally:
                observer.handler_finished(spec, token, time.perf_counter() - started)

        wrapped: Any = observed_async
    else:

        def observed_sync(arg: Any, session: Any, **extra: Any) -> None:
            token = observer.handler_started(spec, arg)
            started = time.perf_counter()
            try:
                func(arg, session, **extra)
            finally:
                observer.handler_finished(spec, token, time.perf_counter() - started)

        wrapped = observed_sync
    wrapped.__wrapped__ = func
    return dataclasses.replace(spec, func=wrapped)
