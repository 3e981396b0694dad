"""Futures whose end nobody awaits: their errors taken, so that asyncio does not report
them as never retrieved (an error-level "exception was never retrieved" line at garbage
collection, for a failure that was already handled or belongs to nobody)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any


def retrieve(future: asyncio.Future[Any] | concurrent.futures.Future[Any]) -> None:
    """Take a finished ``future``'s error, if any; a done callback as it is."""
    if future.done() and not future.cancelled():
        future.exception()
