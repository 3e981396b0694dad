"""Which event loop a worker runs on: uvloop when installed and allowed, else asyncio's.

A worker is bound by the CPU of one Python process; uvloop's scheduling and
socket I/O cost less per message than the pure-Python loop (see
BENCHMARKS.md). It is optional: ``pip install eop[fast]``.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from eop import log

T = TypeVar("T")


def uvloop_available() -> bool:
    """Whether uvloop can be imported."""
    try:
        importlib.import_module("uvloop")
    except ImportError:
        return False
    return True


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """Run ``main`` to completion on a new event loop (uvloop if allowed and installed).

    An error the loop reports itself (a task whose exception nobody retrieved,
    a failing callback) is logged as ``loop.error`` with :func:`eop.log.describe_error`,
    not printed by asyncio's default handler with a plain traceback, which
    would show a failed statement's bound values.
    """
    main = _reporting(main)
    if not (use_uvloop and uvloop_available()):
        return asyncio.run(main)
    uvloop: Any = importlib.import_module("uvloop")
    runner: Any = getattr(asyncio, "Runner", None)
    if runner is not None:
        with runner(loop_factory=uvloop.new_event_loop) as running:
            result: T = running.run(main)
            return result
    # Python 3.10 has no asyncio.Runner: a policy, for this run only.
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        return asyncio.run(main)
    finally:
        asyncio.set_event_loop_policy(None)


async def _reporting(main: Coroutine[Any, Any, T]) -> T:
    asyncio.get_running_loop().set_exception_handler(_report)
    return await main


def _report(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    # The context's "future", "task" and "handle" are not logged: their reprs
    # hold the exception's plain text.
    exc = context.get("exception")
    fields: dict[str, Any] = {"what": str(context.get("message", ""))[:200]}
    if isinstance(exc, BaseException):
        fields["error"] = log.bounded_error(exc)
    log.get_logger().error(log.Event.LOOP_ERROR, **fields)
