"""The bench's own child processes (``python -m eop.bench KIND ...``).

(a) is a raw at-least-once loop, (b) exactly-once written plainly; both fetch
as many messages at once as eop's default ``--batch``. (rp) is the leanest
JetStream publisher nats-py allows, the relay's ceiling; (rn) is ``eop
relay`` given an engine without asyncpg, so that it cannot LISTEN and polls.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
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


async def publish(
    nats_url: str, subject: str, count: str, payload_bytes: str, window: str, out: str
) -> None:
    """Publish ``count`` messages with ``publish_async``, ``window`` PubAcks pending at most.

    Each carries a ``Nats-Msg-Id`` of its own, as the relay's do (the stream
    keeps them for its duplicate window); nothing else touches them. Writes
    to ``out`` the time of the first PubAck and of the last, the CPU seconds
    spent from the first publish to the last PubAck, and how many failed.
    """
    import nats

    from eop.message import MSG_ID_HEADER

    nc = await nats.connect(nats_url)
    js = nc.jetstream(publish_async_max_pending=int(window))
    payload = b"x" * int(payload_bytes)
    headers = [{MSG_ID_HEADER: uuid.uuid4().hex} for _ in range(int(count))]
    first_ack: list[float] = []
    futures: list[asyncio.Future[Any]] = []
    cpu_before = _cpu_s()
    for header in headers:
        futures.append(await js.publish_async(subject, payload, headers=header))
        if len(futures) == 1:
            futures[0].add_done_callback(lambda _: first_ack.append(time.time()))
    await js.publish_async_completed()
    end, cpu = time.time(), _cpu_s() - cpu_before
    failed = sum(1 for f in futures if f.cancelled() or f.exception() is not None)
    with open(out, "w") as file:  # noqa: ASYNC230  # once, after the measurement
        json.dump({"first_ack": first_ack[0], "end": end, "cpu_s": cpu, "failed": failed}, file)
    await nc.close()


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


async def polling_relay(nats_url: str, database_url: str) -> int:
    """``eop relay`` on a psycopg engine: it cannot LISTEN, so it looks every ``outbox_poll_s``.

    Otherwise the default settings, as ``eop relay`` without flags.
    """
    import sqlalchemy as sa

    import eop
    from eop import log
    from eop import settings as settings_mod
    from eop.runtime import relaying

    log.configure()
    url = sa.make_url(database_url).set(drivername="postgresql+psycopg")
    app = eop.App(
        engine=create_async_engine(url),
        nats_url=nats_url,
        settings=settings_mod.Settings(),
    )
    return await relaying.run_relay(app)
