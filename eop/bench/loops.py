"""The consumers of runs (a) and (b), each in its own process (``python -m eop.bench``).

(a) is a raw at-least-once loop, (b) exactly-once written plainly; both fetch
as many messages at once as eop's default ``--batch``.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from eop.bench import runs

_NAIVE_CLAIM = sa.text(
    "INSERT INTO bench_naive_inbox (stream, seq) VALUES (:st, :s) "
    "ON CONFLICT DO NOTHING RETURNING seq"
)
_FETCH_BATCH = 64  # (a) and (b) fetch as many as eop's default --batch


async def consume(
    kind: str, nats_url: str, db_url: str, stream: str, durable: str, out: str
) -> None:
    """Consume until SIGTERM: (a) with plain acks, (b) in the naive exactly-once loop."""
    import nats
    import nats.errors

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    nc = await nats.connect(nats_url)
    sub = await nc.jetstream().pull_subscribe_bind(durable=durable, stream=stream)
    engine = create_async_engine(db_url, pool_size=1)
    done: list[tuple[Any, float]] = []
    while not stop.is_set():
        try:
            msgs = await sub.fetch(_FETCH_BATCH, timeout=1.0)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            continue
        if kind == "a":
            for msg in msgs:
                await msg.ack()
                done.append((msg, time.time()))
        else:
            await naive(engine, stream, msgs)
    await nc.flush()
    with open(out, "w") as file:  # noqa: ASYNC230  # once, after the measurement
        for msg, at in done:
            meta = msg.metadata  # parsed only now, to keep (a) as lean as it can be
            file.write(f"{meta.sequence.stream} {meta.timestamp.timestamp()} {at}\n")
    await nc.close()
    await engine.dispose()


async def naive(engine: AsyncEngine, stream: str, msgs: list[Any]) -> None:
    """Exactly-once written plainly: per message one transaction, then one ``ack_sync``."""
    for msg in msgs:
        meta = msg.metadata
        seq = meta.sequence.stream
        # A session, as eop hands its handlers: the same INSERT through the same API.
        async with AsyncSession(engine) as session, session.begin():
            claimed = await session.execute(_NAIVE_CLAIM, {"st": stream, "s": seq})
            if claimed.first() is not None:
                await session.execute(
                    runs.INSERT, {"v": "bench-naive", "s": seq, "t": meta.timestamp}
                )
        await msg.ack_sync(timeout=5.0)
