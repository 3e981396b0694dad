"""OpenTelemetry: a span per handled message, trace context carried in message headers.

Optional: with the ``eop[otel]`` extra (``opentelemetry-api``) installed and
the ``tracing`` setting on, the worker opens a CONSUMER span for each
delivery, a child of the publisher's span when the message carries a W3C
``traceparent`` header, and makes it the current span while the handler
runs (so the handler's own spans nest under it). Without the package nothing
here is imported and the worker does not call into this module at all.

Publishers put their trace context into the headers with :func:`inject`::

    await js.publish(subject, data, headers=eop.observe.tracing.inject({"Nats-Msg-Id": key}))

Spans are exported by whatever SDK the application configures
(``opentelemetry-sdk``); with the API alone they are no-ops.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from eop import message
from eop.handler import HandlerSpec
from eop.observe import observer as observe

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.propagators.textmap import Getter
except ImportError:  # the eop[otel] extra is not installed
    AVAILABLE = False
else:
    AVAILABLE = True

if TYPE_CHECKING:
    from eop.types import Delivery

_ERROR_OUTCOMES = frozenset({"dead_lettered", "quarantined"})


def inject(headers: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Add the current trace context (``traceparent``, ``tracestate``) to ``headers``.

    ``headers`` is changed in place and returned (a new dict when None), ready
    for ``js.publish(..., headers=...)``. Without OpenTelemetry installed it is
    returned unchanged.
    """
    carrier: MutableMapping[str, str] = {} if headers is None else headers
    if AVAILABLE:
        propagate.inject(carrier)
    return carrier


if AVAILABLE:

    class _HeaderGetter(Getter[MutableMapping[str, str]]):
        """Reads trace headers whatever case the publisher gave their names."""

        def get(self, carrier: Any, key: str) -> list[str] | None:
            value = carrier.get(key)
            if value is None:
                lowered = key.lower()
                value = next((v for k, v in carrier.items() if k.lower() == lowered), None)
            return None if value is None else [str(value)]

        def keys(self, carrier: Any) -> list[str]:
            return [str(k) for k in carrier]

    _GETTER = _HeaderGetter()


_Key = tuple[str, str, int, int]


def _key(spec: HandlerSpec, delivery: Delivery) -> _Key | None:
    try:
        meta = delivery.metadata
        return (spec.name, str(meta.stream), int(meta.sequence.stream), int(meta.num_delivered))
    except Exception:
        # Not a JetStream message: the protocol dead-letters it; no span to key.
        return None


class Tracing(observe.Observer):
    """Opens, annotates and ends the span of each delivery (needs :data:`AVAILABLE`)."""

    def __init__(self, tracer_provider: Any = None) -> None:
        if not AVAILABLE:
            raise RuntimeError("opentelemetry-api is not installed: pip install 'eop[otel]'")
        self._provider = tracer_provider
        self._tracer = trace.get_tracer("eop", _version(), tracer_provider)
        self._spans: dict[_Key, Any] = {}

    def _recording(self) -> bool:
        """False while no SDK is configured: then spans would be no-ops, so make none.

        opentelemetry-api often arrives as a dependency of something else;
        without an SDK behind it, extracting headers and building attributes
        for a non-recording span would cost ~15 us per message for nothing.
        """
        if self._provider is not None:
            return True
        provider = trace.get_tracer_provider()
        return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))

    def received(self, spec: HandlerSpec, deliveries: Sequence[Delivery]) -> None:
        """Start a CONSUMER span per delivery, parented by the context in its headers."""
        if not self._recording():
            return
        for delivery in deliveries:
            key = _key(spec, delivery)
            if key is None or key in self._spans:
                continue
            headers = delivery.headers or {}
            try:
                parent = propagate.extract(headers, getter=_GETTER) if headers else None
            except Exception:
                # Malformed trace headers must not cost the message: start a new trace.
                parent = None
            self._spans[key] = self._tracer.start_span(
                f"process {spec.subject}",
                context=parent,
                kind=trace.SpanKind.CONSUMER,
                attributes=_attributes(spec, delivery, key, headers),
            )

    def failed(self, spec: HandlerSpec, delivery: Delivery, error: BaseException) -> None:
        """Record the handler's exception on the span and mark it as an error."""
        if not self._spans:
            return
        key = _key(spec, delivery)
        span = self._spans.get(key) if key is not None else None
        if span is not None:
            span.record_exception(error)
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}"))

    def outcome(self, event: observe.Settled) -> None:
        """Set the outcome and end the span."""
        if not self._spans:
            return
        key = _key(event.spec, event.delivery)
        span = self._spans.pop(key, None) if key is not None else None
        if span is None:
            return
        span.set_attribute("eop.outcome", event.outcome.value)
        if event.reason is not None:
            span.set_attribute("eop.dead_letter.reason", event.reason)
        if not event.acked:
            span.set_attribute("eop.ack_given_up", True)
        if event.outcome.value in _ERROR_OUTCOMES:
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"dead-lettered: {event.reason}"))
        span.end()

    def errored(
        self, spec: HandlerSpec, deliveries: Sequence[Delivery], error: BaseException
    ) -> None:
        """eop's own I/O failed: record it on the spans still open."""
        if not self._spans:
            return
        for delivery in deliveries:
            key = _key(spec, delivery)
            span = self._spans.get(key) if key is not None else None
            if span is not None:
                span.record_exception(error)

    def done(self, spec: HandlerSpec, deliveries: Sequence[Delivery]) -> None:
        """End the spans of deliveries that got no outcome (left to a redelivery)."""
        if not self._spans:
            return
        for delivery in deliveries:
            key = _key(spec, delivery)
            span = self._spans.pop(key, None) if key is not None else None
            if span is not None:
                span.set_attribute("eop.outcome", "unsettled")
                span.set_status(
                    trace.Status(trace.StatusCode.ERROR, "no outcome: left for redelivery")
                )
                span.end()

    def handler_started(self, spec: HandlerSpec, arg: Any) -> Any:
        """Make the message's span current while its handler runs (not for batch handlers)."""
        # A typed handler gets its decoded payload, which carries no coordinates.
        if not self._spans or not isinstance(arg, message.Message):
            return None
        msg = arg
        span = self._spans.get((spec.name, msg.stream, msg.seq, msg.num_delivered))
        if span is None:
            return None
        return otel_context.attach(trace.set_span_in_context(span))

    def handler_finished(self, spec: HandlerSpec, token: Any, seconds: float) -> None:
        """Restore the context the handler was called in."""
        if token is not None:
            otel_context.detach(token)

    def watches_handlers(self) -> bool:
        """Only while spans are recorded: a tracer provider must be set before the worker
        starts for its handlers to run in their message's span (and to see its context)."""
        return self._recording()


def _attributes(
    spec: HandlerSpec, delivery: Delivery, key: _Key, headers: Mapping[str, str]
) -> dict[str, Any]:
    _, stream, seq, delivered = key
    attributes: dict[str, Any] = {
        "messaging.system": "nats",
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        # Bytes that were not UTF-8 (escaped by eop.wire) would fail the exporter.
        "messaging.destination.name": message.pg_text(delivery.subject),
        "messaging.destination.subscription.name": spec.durable,
        "messaging.consumer.group.name": spec.durable,
        "messaging.message.body.size": len(delivery.data or b""),
        "eop.handler": spec.name,
        "eop.stream": stream,
        "eop.stream_seq": seq,
        "eop.delivery_count": delivered,
    }
    msg_id = headers.get("Nats-Msg-Id")
    if msg_id:
        attributes["messaging.message.id"] = message.pg_text(str(msg_id))
    return attributes


def _version() -> str:
    # From the installed distribution: the package's __init__ is the public
    # API, above the observers.
    try:
        return importlib.metadata.version("eop")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
