"""Fixtures of the unit tests: the protocol run against eop.testing's fakes."""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import structlog

from eop import log, testing
from eop.handler import HandlerSpec
from eop.message import Message
from eop.protocol import processor as processor_mod
from eop.settings import Settings

from .support import FAST, STREAM, Harness, MakeHarness, Step, effect_of


@pytest.fixture
def make_harness() -> MakeHarness:
    """Build a Harness; keywords go to HandlerSpec, plus settings= and lock_timeout_s=."""

    def make(
        *,
        settings: Settings = FAST,
        lock_timeout_s: float | None = None,
        clock: Callable[[], float] | None = None,
        **spec_options: Any,
    ) -> Harness:
        calls: list[Message] = []
        script: list[Step] = []

        async def handler(msg: Message, session: Any) -> None:
            calls.append(msg)
            session.add(effect_of(msg))
            step = script.pop(0) if script else None
            if isinstance(step, BaseException):
                raise step
            if step is not None:
                await step(msg, session)

        options: dict[str, Any] = {
            "name": "orders",
            "stream": STREAM,
            "subject": "orders.>",
            "durable": "eop-orders",
        }
        options.update(spec_options)
        spec = HandlerSpec(func=handler, **options)
        store = testing.MemoryStore(lock_timeout_s=lock_timeout_s)
        epochs = testing.FakeEpochs({STREAM: "e1"})
        extra: dict[str, Any] = {} if clock is None else {"clock": clock}
        proc = processor_mod.Processor(
            spec=spec, settings=settings, store=store, epochs=epochs, **extra
        )
        return Harness(processor=proc, store=store, epochs=epochs, calls=calls, script=script)

    return make


@pytest.fixture
def harness(make_harness: MakeHarness) -> Harness:
    """The default Harness: handler "orders" on stream ORDERS, FAST settings."""
    return make_harness()


@pytest.fixture
def fast_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make asyncio.sleep yield without waiting (for the protocol's fixed retry pauses)."""
    real_sleep = asyncio.sleep

    async def no_wait(delay: float, result: Any = None) -> Any:
        return await real_sleep(0, result)

    monkeypatch.setattr(asyncio, "sleep", no_wait)


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    """Undo any log.configure() a test did (it binds structlog to a captured stream, and
    puts its handler of library records on the root logger)."""
    yield
    structlog.reset_defaults()
    logging.getLogger().removeHandler(log._LIBRARY_RECORDS)
    warnings.showwarning = log.STDLIB_SHOWWARNING
