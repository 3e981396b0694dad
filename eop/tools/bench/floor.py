"""(m) the leanest exactly-once loop nats-py and asyncpg allow: the floor eop is read against.

(a)'s pull requests and callback (:func:`eop.tools.bench.baselines.lean`) with
(h)'s transaction on asyncpg, and a batch's acks confirmed by one wait. Not a
consumer anyone should run (it neither retries, nor renews leases, nor bounds
its inbox): what any exactly-once design on these clients pays, so that a
target eop misses can be told apart from one no design could meet.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import itertools
import json
import signal
import time
from typing import Any

from eop.tools.bench import baselines

_UTC = datetime.timezone.utc


class _Floor:
    """(m)'s state in one process: the deliveries not yet taken by a batch, the messages
    asked for and not yet come, and each batch's acks waiting for their confirmation."""

    def __init__(self, nc: Any, stream: str, durable: str) -> None:
        self.nc = nc
        self.inbox, self.ackbox = nc.new_inbox(), nc.new_inbox()
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.request = json.dumps({"batch": baselines.LEAN_PULL, "expires": 1_000_000_000}).encode()
        self.queued: collections.deque[str] = collections.deque()
        self.arrived = asyncio.Event()
        self.stop = asyncio.Event()
        self.asked = 0
        self.last_arrival = time.monotonic()
        self.confirming: dict[str, tuple[list[int], asyncio.Future[None]]] = {}
        self.tokens = itertools.count()

    async def top_up(self) -> None:
        """Keep two pull requests' worth asked for or queued, as (a) does."""
        while self.asked + len(self.queued) < 2 * baselines.LEAN_PULL:
            self.asked += baselines.LEAN_PULL
            await self.nc.publish(self.next_subject, self.request, reply=self.inbox)

    async def on_message(self, msg: Any) -> None:
        reply = msg.reply
        if reply:  # a delivery: its reply subject is its ack subject
            self.queued.append(reply)
            self.asked -= 1
            self.last_arrival = time.monotonic()
            self.arrived.set()
        else:  # a status (408: a request expired): what it still had is not coming
            left = (msg.headers or {}).get("Nats-Pending-Messages")
            self.asked -= int(left) if left else baselines.LEAN_PULL
        self.asked = max(self.asked, 0)
        await self.top_up()

    async def on_ack_reply(self, msg: Any) -> None:
        waiting = self.confirming.get(msg.subject.rpartition(".")[2])
        if waiting is not None:
            left, done = waiting
            left[0] -= 1
            if left[0] == 0 and not done.done():
                done.set_result(None)

    async def confirm(self, replies: list[str]) -> None:
        """A plain ``+ACK`` of each delivery with a reply subject of the batch's, then wait
        until the server confirmed them all (what ``ack_sync`` waits for, without its
        request inbox and future per message)."""
        token = str(next(self.tokens))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.confirming[token] = ([len(replies)], done)
        subject = f"{self.ackbox}.{token}"
        try:
            for reply in replies:
                await self.nc.publish(reply, b"+ACK", reply=subject)
            await asyncio.wait_for(done, 5.0)
        finally:
            del self.confirming[token]


def floor_row(durable: str, reply: str) -> tuple[str, int, datetime.datetime]:
    """(m)'s effect row of a delivery: the stream sequence and timestamp its ack subject
    carries (as (a)'s records are read), no message object made."""
    seq, stamp = baselines.ack_position(reply)
    return durable, seq, datetime.datetime.fromtimestamp(stamp, _UTC)


async def floor(nats_url: str, database_url: str, stream: str, durable: str) -> None:
    """(m): the leanest exactly-once loop the clients allow, until SIGTERM.

    (a)'s pull requests and callback, with (h)'s transaction: each of
    :data:`baselines.HAND_IN_FLIGHT` tasks takes the deliveries queued (64 at most),
    reads each one's sequence and timestamp from its reply subject, claims and
    writes them on asyncpg in one transaction, then acks them with one
    confirmation wait for the batch. Nothing else: no retries, no lease
    renewals, no failure handling, no inbox bound. What any exactly-once
    consumer on nats-py and asyncpg has to pay; eop is read against it.
    """
    import nats.errors

    nc, _js, pool = await baselines.hand_connections(nats_url, database_url)
    state = _Floor(nc, stream, durable)

    def stopping() -> None:
        state.stop.set()
        state.arrived.set()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping)
    await nc.subscribe(state.inbox, cb=state.on_message)
    await nc.subscribe(f"{state.ackbox}.*", cb=state.on_ack_reply)

    async def batches() -> None:
        while not state.stop.is_set():
            if not state.queued:
                state.arrived.clear()
                await state.arrived.wait()
                continue
            take = min(baselines.HAND_BATCH, len(state.queued))
            replies = [state.queued.popleft() for _ in range(take)]
            await state.top_up()
            rows = [floor_row(durable, reply) for reply in replies]
            async with pool.acquire() as conn, conn.transaction():
                seqs = [seq for _, seq, _ in rows]
                claimed = {row[0] for row in await conn.fetch(baselines.HAND_CLAIM, stream, seqs)}
                mine = [row for row in rows if row[1] in claimed]
                if mine:
                    await conn.executemany(baselines.HAND_INSERT, mine)
            with contextlib.suppress(nats.errors.TimeoutError, asyncio.TimeoutError):
                await state.confirm(replies)  # unconfirmed: redelivered, then acked as a duplicate

    async def watch() -> None:
        while not state.stop.is_set():
            await asyncio.sleep(0.5)
            if time.monotonic() - state.last_arrival > 2.0:  # nothing for a while: ask afresh
                state.asked = 0
                await state.top_up()

    await state.top_up()
    await asyncio.gather(*(batches() for _ in range(baselines.HAND_IN_FLIGHT)), watch())
    await nc.close()
    await pool.close()
