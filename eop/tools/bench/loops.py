"""The relay runs' child processes (``python -m eop.tools.bench KIND ...``).

(rp) is the leanest JetStream publisher nats-py allows, the relay's ceiling;
(rn) is ``eop relay`` given an engine without asyncpg, so that it cannot LISTEN
and polls. The consumers eop is measured against are in :mod:`eop.tools.bench.baselines`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine


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

    import eop
    from eop import log
    from eop import settings as settings_mod
    from eop.outbox import process

    log.configure()
    url = sa.make_url(database_url).set(drivername="postgresql+psycopg")
    app = eop.App(
        engine=create_async_engine(url),
        nats_url=nats_url,
        settings=settings_mod.Settings(),
    )
    return await process.run_relay(app)
