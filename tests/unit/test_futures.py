"""Futures nobody awaits end without asyncio's "exception was never retrieved" report."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from eop import futures


async def test_a_failed_future_retrieved_is_not_reported_and_one_left_alone_is() -> None:
    """The report is an error-level line at garbage collection, for a failure already
    handled elsewhere; ``retrieve`` (called directly or as a done callback) takes it,
    and leaves a running or cancelled future as it is."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        taken = loop.create_future()
        taken.set_exception(RuntimeError("handled elsewhere"))
        futures.retrieve(taken)
        called_back = loop.create_future()
        called_back.add_done_callback(futures.retrieve)
        called_back.set_exception(RuntimeError("handled elsewhere"))
        await asyncio.sleep(0)  # the done callback runs
        running = loop.create_future()
        futures.retrieve(running)
        cancelled = loop.create_future()
        cancelled.cancel()
        futures.retrieve(cancelled)
        del taken, called_back
        gc.collect()
        assert reported == []
        left = loop.create_future()
        left.set_exception(RuntimeError("nobody's"))
        del left
        gc.collect()
        assert [type(c.get("exception")) for c in reported] == [RuntimeError]
        assert not running.done()
    finally:
        loop.set_exception_handler(None)
