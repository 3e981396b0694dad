"""OpenTelemetry: one span per delivery, parented by the publisher's traceparent; inject()."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

import eop
from eop import wire
from eop.observe import observer as observe
from eop.observe import tracing
from eop.types import Outcome

from ..otel import memory_exporter
from .support import STREAM, SUBJECT, Harness, MakeHarness, delivery

ROOT = Path(__file__).resolve().parents[2]


def traced(harness: Harness) -> tracing.Tracing:
    """Put a Tracing observer on the harness's processor (as the worker does)."""
    tracer = tracing.Tracing()
    harness.processor.observer = tracer
    harness.processor.spec = observe.instrument(harness.spec, tracer)
    return tracer


async def handle(harness: Harness, tracer: tracing.Tracing, d: Any) -> Outcome:
    """What the worker does around the protocol: received, handle, done."""
    tracer.received(harness.spec, [d])
    try:
        return await harness.handle(d)
    finally:
        tracer.done(harness.spec, [d])


def publish_headers() -> tuple[dict[str, str], Any]:
    """Headers injected inside a publisher's span, and that span's context."""
    with trace.get_tracer("publisher").start_as_current_span("publish") as span:
        headers = tracing.inject({"Nats-Msg-Id": "m-1"})
        return dict(headers), span.get_span_context()


def test_inject_adds_traceparent_in_place_and_returns_the_headers() -> None:
    """inject() writes the current context as a W3C traceparent into the given dict."""
    memory_exporter()
    headers, ctx = publish_headers()
    assert headers["Nats-Msg-Id"] == "m-1"
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert version == "00"
    assert int(flags, 16) & 1  # sampled
    assert (int(trace_id, 16), int(span_id, 16)) == (ctx.trace_id, ctx.span_id)
    given: dict[str, str] = {}
    assert tracing.inject(given) is given
    assert isinstance(tracing.inject(), dict)


async def test_span_is_a_child_of_the_publisher_with_messaging_attributes(
    harness: Harness,
) -> None:
    """A delivery with a traceparent: one CONSUMER span, the publisher's child, with coordinates."""
    exporter = memory_exporter()
    tracer = traced(harness)
    headers, parent = publish_headers()
    exporter.clear()
    assert await handle(harness, tracer, delivery(seq=7, headers=headers)) is Outcome.PROCESSED
    [span] = exporter.get_finished_spans()
    assert span.kind is SpanKind.CONSUMER
    assert span.name == "process orders.>"
    assert span.parent is not None
    assert (span.context.trace_id, span.parent.span_id) == (parent.trace_id, parent.span_id)
    attrs = dict(span.attributes or {})
    assert attrs["messaging.system"] == "nats"
    assert attrs["messaging.destination.name"] == SUBJECT
    assert attrs["messaging.message.id"] == "m-1"
    assert attrs["eop.handler"] == "orders"
    assert attrs["eop.stream"] == STREAM
    assert attrs["eop.stream_seq"] == 7
    assert attrs["eop.delivery_count"] == 1
    assert attrs["eop.outcome"] == "processed"
    assert span.status.status_code is StatusCode.UNSET


async def test_the_message_span_is_current_inside_the_handler(
    make_harness: MakeHarness,
) -> None:
    """Spans the handler opens nest under the message's span."""
    exporter = memory_exporter()
    harness = make_harness()
    tracer = traced(harness)

    async def inner(msg: eop.Message, session: Any) -> None:
        with trace.get_tracer("app").start_as_current_span("write"):
            pass

    harness.then(inner)
    await handle(harness, tracer, delivery())
    inner_span, message_span = exporter.get_finished_spans()
    assert inner_span.parent is not None
    assert inner_span.parent.span_id == message_span.context.span_id


async def test_without_traceparent_the_span_starts_a_trace(harness: Harness) -> None:
    """No trace headers: a root span."""
    exporter = memory_exporter()
    tracer = traced(harness)
    await handle(harness, tracer, delivery())
    [span] = exporter.get_finished_spans()
    assert span.parent is None


async def test_malformed_traceparent_starts_a_new_trace_and_the_message_is_processed(
    harness: Harness,
) -> None:
    """A garbage traceparent never costs the message."""
    exporter = memory_exporter()
    tracer = traced(harness)
    d = delivery(headers={"traceparent": "00-zz-\u00e9-01", "tracestate": "=,=,"})
    assert await handle(harness, tracer, d) is Outcome.PROCESSED
    [span] = exporter.get_finished_spans()
    assert span.parent is None


async def test_handler_failure_marks_the_span_as_error_with_the_exception(
    harness: Harness,
) -> None:
    """A failing handler: ERROR status, an exception event, outcome retry."""
    exporter = memory_exporter()
    tracer = traced(harness)
    harness.then(RuntimeError("boom"))
    assert await handle(harness, tracer, delivery()) is Outcome.RETRY
    [span] = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes or {})["eop.outcome"] == "retry"
    [event] = span.events
    assert event.name == "exception"
    assert dict(event.attributes or {})["exception.type"] == "RuntimeError"


async def test_dead_letter_marks_the_span_as_error_with_its_reason(harness: Harness) -> None:
    """An undecodable payload: dead-lettered, ERROR status, the reason as an attribute."""
    exporter = memory_exporter()
    tracer = traced(harness)
    harness.then(eop.UndecodableMessage("not json"))
    assert await handle(harness, tracer, delivery()) is Outcome.DEAD_LETTERED
    [span] = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    attrs = dict(span.attributes or {})
    assert (attrs["eop.outcome"], attrs["eop.dead_letter.reason"]) == (
        "dead_lettered",
        "undecodable",
    )


async def test_a_subject_and_msg_id_not_utf8_become_valid_text_attributes(
    harness: Harness,
) -> None:
    """Escaped bad bytes (see eop.wire) would fail the exporter: U+FFFD in their place."""
    exporter = memory_exporter()
    tracer = traced(harness)
    d = delivery(subject=wire.decode(b"orders.\xff"), headers={"Nats-Msg-Id": wire.decode(b"\xfe")})
    assert await handle(harness, tracer, d) is Outcome.DEAD_LETTERED
    [span] = exporter.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert attrs["messaging.destination.name"] == "orders.\ufffd"
    assert attrs["messaging.message.id"] == "\ufffd"


async def test_a_delivery_without_outcome_ends_its_span_when_done(harness: Harness) -> None:
    """The worker's done() ends the span of a delivery the protocol left unsettled."""
    exporter = memory_exporter()
    tracer = tracing.Tracing()
    d = delivery()
    tracer.received(harness.spec, [d])
    tracer.errored(harness.spec, [d], OSError("database gone"))
    tracer.done(harness.spec, [d])
    [span] = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes or {})["eop.outcome"] == "unsettled"


def test_without_opentelemetry_nothing_is_traced_and_inject_is_a_no_op() -> None:
    """opentelemetry absent: eop imports, inject() returns the headers as given, NOOP observer."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["opentelemetry"] = None  # as if the package were not installed
        import eop
        from eop import settings
        from eop.observe import observer as observe, tracing
        from eop.runtime import telemetry

        class W:
            settings = settings.Settings(tracing=True)
            specs = []

        assert tracing.AVAILABLE is False
        assert tracing.inject({"a": "b"}) == {"a": "b"}
        assert telemetry.Telemetry(W()).observer is observe.NOOP
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert out.stdout.strip() == "ok", out.stderr
