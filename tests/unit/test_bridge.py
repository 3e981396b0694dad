"""eop.pg.bridge: a function in a thread whose SQLAlchemy ``await_`` calls run on the loop."""

from __future__ import annotations

import asyncio
import threading

import pytest
from sqlalchemy.util.concurrency import await_only as await_

from eop.pg import bridge


async def test_each_awaitable_runs_on_the_loop_and_its_result_goes_back_to_the_thread() -> None:
    """The function runs in the caller's thread; the coroutines it hands to SQLAlchemy's
    ``await_`` run on the event loop, one after another, and their results come back."""
    loop = asyncio.get_running_loop()
    ran_on: list[str] = []

    async def on_loop(value: int) -> int:
        ran_on.append(threading.current_thread().name)
        await asyncio.sleep(0)
        return value * 2

    def in_thread(a: int, b: int) -> tuple[str, int]:
        total = await_(on_loop(a)) + await_(on_loop(b))
        return threading.current_thread().name, total

    name, total = await asyncio.to_thread(bridge.call, loop, in_thread, 1, 20)
    assert total == 42
    assert name != threading.current_thread().name
    assert ran_on == [threading.current_thread().name] * 2


async def test_an_awaitables_error_is_raised_where_the_function_awaited_it() -> None:
    """A coroutine that fails on the loop raises in the thread, where ``await_`` was called:
    the function may catch it and go on, or let it out of :func:`bridge.call`."""
    loop = asyncio.get_running_loop()

    async def fails() -> None:
        raise LookupError("on the loop")

    async def fine() -> str:
        return "after"

    def caught() -> str:
        with pytest.raises(LookupError, match="on the loop"):
            await_(fails())
        return await_(fine())

    def uncaught() -> None:
        await_(fails())

    assert await asyncio.to_thread(bridge.call, loop, caught) == "after"
    with pytest.raises(LookupError, match="on the loop"):
        await asyncio.to_thread(bridge.call, loop, uncaught)


async def test_a_function_that_awaits_nothing_just_returns() -> None:
    """No awaitable, no hop to the loop: the function's result, or its error, as it is."""
    loop = asyncio.get_running_loop()

    def boom() -> None:
        raise ValueError("handler")

    assert await asyncio.to_thread(bridge.call, loop, lambda: 7) == 7
    with pytest.raises(ValueError, match="handler"):
        await asyncio.to_thread(bridge.call, loop, boom)
