"""One OpenTelemetry SDK for the test session, exporting spans to memory.

The global tracer provider can be set once per process, so every test that
checks spans shares this one and clears its exporter first.
"""

from __future__ import annotations

import functools

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@functools.cache
def _exporter() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def memory_exporter() -> InMemorySpanExporter:
    """The session's in-memory span exporter, emptied."""
    exporter = _exporter()
    exporter.clear()
    return exporter
