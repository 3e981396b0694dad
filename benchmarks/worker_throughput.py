"""Throughput of one `eop worker` process on N pre-published messages.

    python benchmarks/worker_throughput.py --messages 10000 [--concurrency 16 --batch 64]

Starts its own nats-server and PostgreSQL (the `embedded` extra), publishes N
100-byte messages, then times one `eop worker` subprocess from its start until
the consumer has nothing pending and nothing awaiting an ack. The handler
inserts one row per message. Prints messages/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nats
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from eop.pg import migrate
from eop.tools import embedded

ROOT = Path(__file__).resolve().parents[1]


APP = "tests.integration.cliapp:app"


async def time_worker(js: Any, env: dict[str, str], extra: Sequence[str] = ()) -> float:
    """Seconds from starting one `eop worker` on APP until its consumer has drained."""
    started = time.perf_counter()
    proc = subprocess.Popen(  # noqa: ASYNC220  # the loop has nothing else to do meanwhile
        [sys.executable, "-m", "eop", "worker", APP, *extra], env=env, cwd=ROOT
    )
    while True:
        await asyncio.sleep(0.1)
        try:
            info = await js.consumer_info("ORDERS", "eop-cli")
        except Exception:
            continue
        if info.num_pending == 0 and info.num_ack_pending == 0:
            break
    elapsed = time.perf_counter() - started
    proc.terminate()
    await asyncio.to_thread(proc.wait)
    return elapsed


async def main(messages: int, extra: list[str]) -> None:
    with embedded.NatsServer() as ns, embedded.PostgresServer() as pg:
        migrate.upgrade(pg.url)
        engine = create_async_engine(pg.url)
        async with engine.begin() as conn:
            await conn.execute(
                sa.text(
                    "CREATE TABLE effects (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
                    " handler text NOT NULL, msg_key text NOT NULL, body text NOT NULL)"
                )
            )
        nc = await nats.connect(ns.url)
        js = nc.jetstream()
        await js.add_stream(name="ORDERS", subjects=["ORDERS.>"])
        payload = b"x" * 100
        for i in range(0, messages, 500):
            await asyncio.gather(
                *(js.publish("ORDERS.created", payload) for _ in range(min(500, messages - i)))
            )
        env = dict(
            os.environ,
            EOP_DATABASE_URL=pg.url,
            EOP_NATS_URL=ns.url,
            EOP_LOG_LEVEL="warning",
            CLIAPP_HANDLER_DELAY_S="0",
        )
        elapsed = await time_worker(js, env, extra)
        async with engine.connect() as conn:
            effects = (await conn.execute(sa.text("SELECT count(*) FROM effects"))).scalar()
        await engine.dispose()
        await nc.close()
        print(
            f"{messages} messages, {effects} effects, {elapsed:.2f} s "
            f"(including worker start-up): {messages / elapsed:,.0f} msg/s  args={extra}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    args, worker_args = parser.parse_known_args()
    asyncio.run(main(args.messages, worker_args))
