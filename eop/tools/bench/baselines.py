"""The consumers eop is measured against: what a user could write instead of eop.

(a) the leanest at-least-once loop nats-py allows: a callback subscription on
an inbox of its own, pull requests of 256 kept two deep, a plain ``+ACK``
published per message, the message's metadata parsed only after the
measurement, on uvloop when installed. No database: it is the client's
ceiling, what eop's worker cost is compared with.

(h) a competent hand-written exactly-once consumer: fetch 64, one transaction
per batch on asyncpg (a multi-row claim, then the handler's INSERT for each
claimed message in one pipelined executemany), COMMIT, then every ``ack_sync``
of the batch at once; as many batches in flight per process as eop's default
``concurrency / batch`` (128 / 64 = 2), each on a subscription and a connection
of its own.

(hb) (h) keeping its inbox bounded, as a user who bounds it would: after every
:data:`HAND_BOUND_EVERY` messages a process settled (eop's default
``compaction_after_messages``), it reads the consumer's ack floor and deletes
the inbox rows above the floor it read the time before and at or below this
one, by key range, in a transaction of its own. JetStream never redelivers a
message at or below the ack floor, so those rows guard nothing; (h)'s inbox
grows without end, as eop's must not.

(m), the leanest exactly-once loop, is in :mod:`eop.tools.bench.floor`.

(b) exactly-once written plainly: per message one transaction through an
SQLAlchemy session (claim, INSERT), then one sequential ``ack_sync``.

(fh) (h) extended as a competent user handles failures without eop, for the
poison flood: the handler of each claimed message runs in the batch's
transaction; if one failed with attempts left (JetStream's ``num_delivered``
below ``max_attempts``), the transaction is rolled back and run again without
it, and it is nak'ed with eop's backoff as the delay; on its last attempt its
dead letter is written in the transaction that claims its inbox row, and it is
acked. Each failure is logged in one line, as eop logs each retry.

Each runs until SIGTERM and then writes, per message it completed, its stream
sequence, its stream timestamp and when it was completed (for (b) and (h) the
effect rows in the database say the same, and are what is read). ``fan_out``
runs N of one of them as child processes, for the rows measured with eop's
process count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from eop.tools.bench import runs

LEAN_PULL = 256
"""Messages per pull request of (a); two requests' worth are kept outstanding."""
HAND_BATCH = 64
"""Messages per fetch (and per transaction) of (h) and (b), as eop's default ``batch``."""
HAND_IN_FLIGHT = 2
"""Batches in flight per process of (h): eop's default ``concurrency / batch``."""
HAND_BOUND_EVERY = 1_000
"""Messages a process of (hb) settles between two deletes of its inbox's rows: eop's
default ``compaction_after_messages``."""

_NAIVE_CLAIM = sa.text(
    "INSERT INTO bench_naive_inbox (stream, seq) VALUES (:st, :s) "
    "ON CONFLICT DO NOTHING RETURNING seq"
)
HAND_CLAIM = (
    "INSERT INTO bench_hand_inbox (stream, seq) SELECT $1, unnest($2::bigint[]) "
    "ON CONFLICT DO NOTHING RETURNING seq"
)
_HAND_BOUND = "DELETE FROM bench_hand_inbox WHERE stream = $1 AND seq > $2 AND seq <= $3"
HAND_INSERT = "INSERT INTO bench_effects (variant, seq, stored_at) VALUES ($1, $2, $3)"
_HAND_DEAD = (
    "INSERT INTO bench_hand_dead (stream, seq, subject, payload, error, traceback, delivered)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7)"
)


def _stop_on_sigterm() -> asyncio.Event:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    return stop


async def hand_connections(nats_url: str, database_url: str) -> tuple[Any, Any, Any]:
    """The hand-written consumers' connections: NATS, its JetStream context, and an asyncpg
    pool of a connection per batch in flight."""
    import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type information
    import nats

    nc = await nats.connect(nats_url)
    dsn = sa.make_url(database_url).set(drivername="postgresql")
    pool = await asyncpg.create_pool(
        dsn.render_as_string(hide_password=False),
        min_size=HAND_IN_FLIGHT,
        max_size=HAND_IN_FLIGHT,
    )
    return nc, nc.jetstream(), pool


async def lean(nats_url: str, stream: str, durable: str, out: str) -> None:
    """(a): consume with plain acks until SIGTERM, as lean as nats-py allows."""
    import nats

    stop = _stop_on_sigterm()
    nc = await nats.connect(nats_url)
    inbox = nc.new_inbox()
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
    request = json.dumps({"batch": LEAN_PULL, "expires": 1_000_000_000}).encode()
    done: list[tuple[str, float]] = []
    asked = [0, time.monotonic()]  # messages asked for and not yet come; last arrival

    async def top_up() -> None:
        while asked[0] < LEAN_PULL:
            asked[0] += LEAN_PULL
            await nc.publish(next_subject, request, reply=inbox)

    async def on_message(msg: Any) -> None:
        reply = msg.reply
        if reply:  # a delivery: its reply subject is its ack subject
            await nc.publish(reply, b"+ACK")
            done.append((reply, time.time()))
            asked[0] -= 1
            asked[1] = time.monotonic()
        else:  # a status (408: a request expired): what it still had is not coming
            left = (msg.headers or {}).get("Nats-Pending-Messages")
            asked[0] -= int(left) if left else LEAN_PULL
        asked[0] = max(asked[0], 0)
        await top_up()

    await nc.subscribe(inbox, cb=on_message)
    await top_up()
    while not stop.is_set():
        await asyncio.sleep(0.5)
        if time.monotonic() - asked[1] > 2.0:  # nothing for a while: ask afresh
            asked[0] = 0
            await top_up()
    await nc.flush()
    _write_records(out, ((seq, stamp, at) for seq, stamp, at in _parsed(done)))
    await nc.close()


def _parsed(done: Sequence[tuple[str, float]]) -> Any:
    """(stream sequence, stream timestamp s, completed at) from each ack subject."""
    for reply, at in done:
        yield (*ack_position(reply), at)


def ack_position(reply: str) -> tuple[int, float]:
    """(stream sequence, stream timestamp s) of a delivery, from its ack subject:
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ns>.<pending>``, or
    with a domain and an account hash after ``$JS.ACK`` (12 tokens)."""
    tokens = reply.split(".")
    shift = 0 if len(tokens) == 9 else 2
    return int(tokens[5 + shift]), int(tokens[7 + shift]) / 1e9


def _write_records(out: str, records: Any) -> None:
    with open(out, "w") as file:
        for seq, stamp, at in records:
            file.write(f"{seq} {stamp} {at}\n")


async def _hand_batches(
    nats_url: str,
    database_url: str,
    stream: str,
    durable: str,
    settle: Callable[[Any, Any, list[Any]], Awaitable[None]],
) -> None:
    """(h)'s, (hb)'s and (fh)'s loop, until SIGTERM: :data:`HAND_IN_FLIGHT` subscriptions,
    each fetching :data:`HAND_BATCH` at a time and handing them to ``settle(js, pool, msgs)``."""
    import nats.errors

    stop = _stop_on_sigterm()
    nc, js, pool = await hand_connections(nats_url, database_url)

    async def batches() -> None:
        sub = await js.pull_subscribe_bind(durable=durable, stream=stream)
        while not stop.is_set():
            try:
                msgs = await sub.fetch(HAND_BATCH, timeout=1.0)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            await settle(js, pool, msgs)

    await asyncio.gather(*(batches() for _ in range(HAND_IN_FLIGHT)))
    await nc.close()
    await pool.close()


async def _hand_settle(pool: Any, stream: str, durable: str, msgs: list[Any]) -> None:
    """(h)'s batch: claim, INSERT the claimed messages' rows, COMMIT, then ack them all."""
    metas = [m.metadata for m in msgs]
    async with pool.acquire() as conn, conn.transaction():
        seqs = [meta.sequence.stream for meta in metas]
        claimed = {row[0] for row in await conn.fetch(HAND_CLAIM, stream, seqs)}
        rows = [
            (durable, meta.sequence.stream, meta.timestamp)
            for meta in metas
            if meta.sequence.stream in claimed
        ]
        if rows:
            await conn.executemany(HAND_INSERT, rows)
    await asyncio.gather(*(m.ack_sync(timeout=5.0) for m in msgs))


async def handwritten(nats_url: str, database_url: str, stream: str, durable: str) -> None:
    """(h): batched exactly-once on asyncpg, until SIGTERM."""

    async def settle(_js: Any, pool: Any, msgs: list[Any]) -> None:
        await _hand_settle(pool, stream, durable, msgs)

    await _hand_batches(nats_url, database_url, stream, durable, settle)


class HandBound:
    """(hb)'s bound on its inbox, in one process: after every :data:`HAND_BOUND_EVERY`
    messages settled, the rows above the ack floor read the time before and at or below
    the one read now go, in a transaction of their own, beside the batches (as eop's
    compaction runs beside its handlers)."""

    def __init__(self, stream: str, durable: str) -> None:
        self.stream, self.durable = stream, durable
        self.since = 0
        self.floor = 0
        self.running: asyncio.Task[None] | None = None

    def settled(self, js: Any, pool: Any, count: int) -> None:
        """Count ``count`` messages settled; start a delete when enough were, and none runs."""
        self.since += count
        if self.since >= HAND_BOUND_EVERY and (self.running is None or self.running.done()):
            self.since = 0
            self.running = asyncio.ensure_future(self.delete_below_floor(js, pool))

    async def delete_below_floor(self, js: Any, pool: Any) -> None:
        """Delete the inbox's rows up to the consumer's ack floor, from the last floor on."""
        info = await js.consumer_info(self.stream, self.durable)
        floor = int(info.ack_floor.stream_seq) if info.ack_floor else 0
        if floor > self.floor:
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute(_HAND_BOUND, self.stream, self.floor, floor)
            self.floor = floor


async def handwritten_bounded(nats_url: str, database_url: str, stream: str, durable: str) -> None:
    """(hb): (h) keeping its inbox bounded (:class:`HandBound`), until SIGTERM."""
    bound = HandBound(stream, durable)

    async def settle(js: Any, pool: Any, msgs: list[Any]) -> None:
        await _hand_settle(pool, stream, durable, msgs)
        bound.settled(js, pool, len(msgs))

    await _hand_batches(nats_url, database_url, stream, durable, settle)


def nak_delay_s(delivered: int, base_s: float, max_s: float) -> float:
    """(fh)'s delay before the next delivery after the ``delivered``-th failed: ``base_s``
    doubled per earlier delivery, capped at ``max_s`` (eop's backoff, written out)."""
    return float(min(base_s * 2 ** min(max(delivered - 1, 0), 30), max_s))


class _Rollback(Exception):
    """A handler failed with attempts left: the batch's transaction must not commit."""


def _handle(msg: Any, meta: Any, variant: str) -> tuple[str, int, Any]:
    """(fh)'s handler: a poison message raises, any other gives its effect row."""
    if msg.data.startswith(runs.POISON):
        raise RuntimeError("poison message")
    return variant, meta.sequence.stream, meta.timestamp


async def _flood_transaction(
    conn: Any, stream: str, variant: str, msgs: list[Any], max_attempts: int
) -> list[Any]:
    """Claim ``msgs``, run their handlers, write the effects and the dead letters, COMMIT;
    the messages that failed with attempts left, which nothing of was committed.

    A failure with attempts left rolls the transaction back (the handler may have
    written before it raised) and the others are run again without it.
    """
    failed: list[Any] = []
    while msgs:
        rows: list[tuple[str, int, Any]] = []
        dead: list[tuple[Any, ...]] = []
        retry: list[Any] = []
        try:
            async with conn.transaction():
                seqs = [m.metadata.sequence.stream for m in msgs]
                claimed = {row[0] for row in await conn.fetch(HAND_CLAIM, stream, seqs)}
                for msg in msgs:
                    meta = msg.metadata
                    if meta.sequence.stream not in claimed:
                        continue  # a duplicate: settled before
                    try:
                        rows.append(_handle(msg, meta, variant))
                    except Exception as exc:
                        logging.warning(
                            "handler failed: seq %d, delivery %d: %r",
                            meta.sequence.stream,
                            meta.num_delivered,
                            exc,
                        )
                        if meta.num_delivered < max_attempts:
                            retry.append(msg)
                            continue
                        seq, trace = meta.sequence.stream, "".join(traceback.format_exception(exc))
                        error, delivered = repr(exc), meta.num_delivered
                        dead.append((stream, seq, msg.subject, msg.data, error, trace, delivered))
                if retry:
                    failed += retry
                    raise _Rollback
                if rows:
                    await conn.executemany(HAND_INSERT, rows)
                if dead:
                    await conn.executemany(_HAND_DEAD, dead)
            return failed
        except _Rollback:
            retried = {id(m) for m in retry}
            msgs = [m for m in msgs if id(m) not in retried]
    return failed


async def handwritten_flood(
    nats_url: str,
    database_url: str,
    stream: str,
    durable: str,
    max_attempts: str,
    backoff_base_s: str,
    backoff_max_s: str,
) -> None:
    """(fh): (h) handling failures as a competent user would without eop, until SIGTERM."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s")
    attempts, base_s, max_s = int(max_attempts), float(backoff_base_s), float(backoff_max_s)

    async def settle(_js: Any, pool: Any, msgs: list[Any]) -> None:
        async with pool.acquire() as conn:
            failed = await _flood_transaction(conn, stream, durable, msgs, attempts)
        unsettled = {id(m) for m in failed}
        settled = [m for m in msgs if id(m) not in unsettled]
        naks = [m.nak(nak_delay_s(m.metadata.num_delivered, base_s, max_s)) for m in failed]
        await asyncio.gather(*(m.ack_sync(timeout=5.0) for m in settled), *naks)

    await _hand_batches(nats_url, database_url, stream, durable, settle)


async def naive_loop(nats_url: str, database_url: str, stream: str, durable: str) -> None:
    """(b): the naive exactly-once loop, until SIGTERM."""
    import nats
    import nats.errors

    stop = _stop_on_sigterm()
    nc = await nats.connect(nats_url)
    sub = await nc.jetstream().pull_subscribe_bind(durable=durable, stream=stream)
    engine = create_async_engine(database_url, pool_size=1)
    while not stop.is_set():
        try:
            msgs = await sub.fetch(HAND_BATCH, timeout=1.0)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            continue
        await naive(engine, stream, durable, msgs)
    await nc.close()
    await engine.dispose()


async def naive(engine: AsyncEngine, stream: str, variant: str, msgs: list[Any]) -> None:
    """Exactly-once written plainly: per message one transaction, then one ``ack_sync``."""
    for msg in msgs:
        meta = msg.metadata
        seq = meta.sequence.stream
        # A session, as eop hands its handlers: the same INSERT through the same API.
        async with AsyncSession(engine) as session, session.begin():
            claimed = await session.execute(_NAIVE_CLAIM, {"st": stream, "s": seq})
            if claimed.first() is not None:
                await session.execute(runs.INSERT, {"v": variant, "s": seq, "t": meta.timestamp})
        await msg.ack_sync(timeout=5.0)


def fan_out(count: int, argv: Sequence[str]) -> int:
    """Run ``count`` copies of the child ``argv`` (``KIND ...``), SIGTERM passed on to each.

    A copy's output file, if it has one (the last argument of (a)), gets the
    copy's number as a suffix.
    """
    children = []
    for i in range(count):
        args = [*argv[:-1], f"{argv[-1]}.{i}"] if argv[0] == "a" else list(argv)
        children.append(subprocess.Popen([sys.executable, "-m", "eop.tools.bench", *args]))

    def pass_on(signum: int, _frame: object) -> None:
        for child in children:
            if child.poll() is None:
                os.kill(child.pid, signum)

    signal.signal(signal.SIGTERM, pass_on)
    return max(child.wait() for child in children)
