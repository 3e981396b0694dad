"""eop.pg.bridge: a function in a thread whose SQLAlchemy ``await_`` calls run on the loop."""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings

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

    name, total = await asyncio.to_thread(bridge.Call(loop).run, in_thread, 1, 20)
    assert total == 42
    assert name != threading.current_thread().name
    assert ran_on == [threading.current_thread().name] * 2


async def test_an_awaitables_error_is_raised_where_the_function_awaited_it() -> None:
    """A coroutine that fails on the loop raises in the thread, where ``await_`` was called:
    the function may catch it and go on, or let it out of :meth:`bridge.Call.run`."""
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

    assert await asyncio.to_thread(bridge.Call(loop).run, caught) == "after"
    with pytest.raises(LookupError, match="on the loop"):
        await asyncio.to_thread(bridge.Call(loop).run, uncaught)


async def test_a_function_that_awaits_nothing_just_returns() -> None:
    """No awaitable, no hop to the loop: the function's result, or its error, as it is."""
    loop = asyncio.get_running_loop()

    def boom() -> None:
        raise ValueError("handler")

    assert await asyncio.to_thread(bridge.Call(loop).run, lambda: 7) == 7
    with pytest.raises(ValueError, match="handler"):
        await asyncio.to_thread(bridge.Call(loop).run, boom)


async def test_a_cancelled_call_cancels_the_awaitable_its_thread_waits_on() -> None:
    """:meth:`bridge.Call.cancel` while the thread waits on the loop: the awaitable is
    cancelled there, ``asyncio.CancelledError`` (not an ``Exception``) is raised where the
    function awaited it, and cancel says the thread was waiting."""
    loop = asyncio.get_running_loop()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def in_thread() -> str:
        try:
            await_(forever())
        except Exception:
            return "an Exception"
        except asyncio.CancelledError:
            return "cancelled"
        return "returned"

    call = bridge.Call(loop)
    running = asyncio.ensure_future(asyncio.to_thread(call.run, in_thread))
    await asyncio.wait_for(started.wait(), 10)
    assert call.cancel()
    assert await asyncio.wait_for(running, 10) == "cancelled"
    assert cancelled.is_set()


async def test_a_cancelled_call_refuses_the_awaitables_its_thread_hands_over_later() -> None:
    """Cancelled while its function runs code of its own, a call says so (it cannot stop
    that code), and every awaitable handed over afterwards raises ``CancelledError`` in
    the thread without running on the loop, closed so that none goes unawaited."""
    loop = asyncio.get_running_loop()
    ran: list[str] = []
    go = threading.Event()

    async def statement() -> None:
        ran.append("statement")

    def in_thread() -> int:
        go.wait(10)
        refused = 0
        for _ in range(2):
            try:
                await_(statement())
            except asyncio.CancelledError:
                refused += 1
        return refused

    call = bridge.Call(loop)
    running = asyncio.ensure_future(asyncio.to_thread(call.run, in_thread))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not call.cancel()
        go.set()
        assert await asyncio.wait_for(running, 10) == 2
        gc.collect()  # a coroutine never awaited warns when it is collected
    assert ran == []
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []
