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

T = TypeVar("T")


def uvloop_available() -> bool:
    """Whether uvloop can be imported."""
    try:
        importlib.import_module("uvloop")
    except ImportError:
        return False
    return True


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """Run ``main`` to completion on a new event loop (uvloop if allowed and installed)."""
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
