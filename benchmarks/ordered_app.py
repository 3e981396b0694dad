"""The app of ``benchmarks/ordered_scaling.py``: an I/O-bound ordered handler.

Each message sleeps 5 ms in its handler (a call to another service, say);
keys are the subject's token 1. ``BENCH_STREAM`` and ``BENCH_PARTITIONS``
come from the environment, so that each run has a stream of its own;
``BENCH_UNORDERED=1`` declares the same handler without ``order_by`` (the
baseline: what the same work costs when order does not matter).
"""

from __future__ import annotations

import asyncio
import os

from sqlalchemy.ext.asyncio import AsyncSession

import eop

STREAM = os.environ.get("BENCH_STREAM", "ORDERED")

app = eop.App()
app.stream(STREAM, subjects=[f"{STREAM.lower()}.>"])


_UNORDERED = os.environ.get("BENCH_UNORDERED") == "1"


@app.handler(
    stream=STREAM,
    subject=f"{STREAM.lower()}.*.step",
    name=f"io-{STREAM.lower()}",
    order_by=None if _UNORDERED else "subject:1",
    partitions=1 if _UNORDERED else int(os.environ.get("BENCH_PARTITIONS", "16")),
)
async def io_bound(msg: eop.Message, session: AsyncSession) -> None:
    """Wait 5 ms, as a handler calling another service would."""
    await asyncio.sleep(0.005)
