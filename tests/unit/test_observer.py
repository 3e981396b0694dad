"""Which observers get a handler wrapped (``observe.instrument``): only those that watch
handler calls, since the wrapper costs every message a coroutine and two clock reads."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import trace

from eop.handler import HandlerSpec
from eop.observe import observer as observe
from eop.observe import tracing


async def handler(msg: Any, session: Any) -> None:
    """A handler that does nothing."""


SPEC = HandlerSpec(func=handler, name="h", stream="S", subject="s.>", durable="d")


class Counting(observe.Observer):
    """Counts outcomes only: it does not watch handler calls."""

    def __init__(self) -> None:
        self.outcomes = 0

    def outcome(self, event: observe.Settled) -> None:
        self.outcomes += 1


class Timing(observe.Observer):
    """Times handler calls, as the metrics do."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def handler_finished(self, spec: HandlerSpec, token: Any, seconds: float) -> None:
        self.seconds.append(seconds)


def test_an_observer_that_ignores_handler_calls_leaves_the_handler_unwrapped() -> None:
    """NOOP and an observer overriding neither handler hook: the spec comes back as it was."""
    assert observe.instrument(SPEC, observe.NOOP) is SPEC
    assert observe.instrument(SPEC, Counting()) is SPEC


async def test_an_observer_of_handler_calls_gets_each_call_timed() -> None:
    """Overriding a handler hook is enough to be told of every call, alone or in a fanout."""
    timing = Timing()
    wrapped = observe.instrument(SPEC, observe.combine([Counting(), timing]))
    assert wrapped.func is not handler
    await wrapped.func(object(), object())
    assert len(timing.seconds) == 1


def test_tracing_watches_handler_calls_only_while_spans_are_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without an SDK's tracer provider (the API alone), tracing makes no spans, so the
    handler is not wrapped; with a provider given, it is."""
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)
    assert observe.instrument(SPEC, tracing.Tracing()) is SPEC
    given = tracing.Tracing(tracer_provider=trace.NoOpTracerProvider())
    assert observe.instrument(SPEC, given) is not SPEC
