"""A small harness for worker tests: an app, an effects table, a worker in a task."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import sqlalchemy as sa
import structlog
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from structlog.testing import capture_logs

import eop
from eop import settings as settings_mod
from eop.ordering import partitions
from eop.pg import models
from eop.pg.sql import inbox as inbox_sql
from eop.protocol import compaction
from eop.runtime.worker import Worker

STREAM = "ORDERS"
SUBJECT = "ORDERS.created"

EFFECTS_DDL = (
    "CREATE TABLE effects (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " handler text NOT NULL, msg_key text NOT NULL, body text NOT NULL)"
)


def bed_settings(database_url: str, nats_url: str, **changes: Any) -> settings_mod.Settings:
    """Settings with short durations, so retries and redeliveries come quickly."""
    base = settings_mod.Settings(
        database_url=database_url,
        nats_url=nats_url,
        ack_wait_s=5.0,
        backoff_base_s=0.05,
        backoff_max_s=0.5,
        lease_margin_s=0.0,
        fetch_timeout_s=0.2,
        lock_timeout_s=2.0,
        shutdown_grace_s=10.0,
        concurrency=4,
        batch=8,
    )
    return dataclasses.replace(base, **changes)


async def create_effects_table(engine: AsyncEngine) -> None:
    """The table test handlers write their effects to (one row per effect)."""
    async with engine.begin() as conn:
        await conn.execute(sa.text(EFFECTS_DDL))


async def record_effect(session: Any, handler: str, msg: eop.Message) -> None:
    """Write one effect row for ``msg`` in the handler's transaction."""
    await session.execute(
        sa.text("INSERT INTO effects (handler, msg_key, body) VALUES (:h, :k, :b)"),
        {"h": handler, "k": msg.idempotency_key, "b": msg.data.decode(errors="replace")},
    )


async def effects_by_body(engine: AsyncEngine) -> dict[str, int]:
    """Effect count per message body."""
    async with engine.connect() as conn:
        rows = await conn.execute(sa.text("SELECT body, count(*) FROM effects GROUP BY body"))
        return {body: int(n) for body, n in rows}


async def scalar(engine: AsyncEngine, query: str, **params: Any) -> Any:
    """One value from a query."""
    async with engine.connect() as conn:
        return (await conn.execute(sa.text(query), params)).scalar()


#: Columns of a row named by its message (:func:`insert_inbox`) that the inbox keeps in
#: its lane's watermark row, or (the subject) not at all.
_NOT_INBOX_COLUMNS = ("stream", "stream_epoch", "subject")


async def insert_inbox(
    conn: AsyncConnection, rows: list[dict[str, Any]], schema: str = "eop"
) -> None:
    """Insert inbox rows written as their message names them (``subscription``, ``stream``,
    ``stream_epoch``, ``stream_seq`` and the inbox's other columns; a ``subject`` is
    dropped): each under the lane of its watermark row, made (at 0) as a claim makes it."""
    t = models.tables(schema)
    epochs: dict[tuple[str, str], set[str]] = {}
    for r in rows:
        epochs.setdefault((r["subscription"], r["stream"]), set()).add(r["stream_epoch"])
    for (subscription, stream), named in epochs.items():
        await conn.execute(*inbox_sql.create_lanes(t, subscription, stream, sorted(named)))
    w = t.watermarks.c
    found = await conn.execute(sa.select(w.subscription, w.stream, w.stream_epoch, w.lane))
    lanes = {(r[0], r[1], r[2]): int(r[3]) for r in found.all()}
    inserted = [
        {
            **{k: v for k, v in r.items() if k not in _NOT_INBOX_COLUMNS},
            "lane": lanes[r["subscription"], r["stream"], r["stream_epoch"]],
        }
        for r in rows
    ]
    await conn.execute(t.inbox.insert(), inserted)


async def count_a_run(app: eop.App, msg: eop.Message) -> None:
    """Count a run of ``msg`` as a redelivery does before it starts (its worker then died
    in it), for the handler its subscription names."""
    async with app.make_store().transaction(app.handlers[msg.subscription]) as tx:
        await tx.count_run(msg)
        await tx.commit()


def compactor_with_floor(
    app: eop.App, handler: str, epochs: Any, floor: int
) -> compaction.Compactor:
    """A compactor of ``handler`` whose consumer's ack floor is ``floor`` and which reads
    the stream from ``epochs`` (a stand-in for :class:`eop.broker.jetstream.StreamEpochs`:
    no NATS)."""

    async def read_floor() -> int:
        return floor

    return compaction.Compactor(
        None,  # type: ignore[arg-type]  # the floor is given: no NATS
        app.make_store(),
        app.handlers[handler],
        epochs,
        floor=read_floor,
    )


async def wait_for(
    predicate: Callable[[], Awaitable[bool]], timeout_s: float = 20.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` until true; fail (not a timing assertion: a liveness bound)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def equals(awaitable: Awaitable[Any], expected: object) -> bool:
    """Whether ``awaitable`` comes to ``expected`` (a :func:`wait_for` predicate's body)."""
    return bool(await awaitable == expected)


async def drained(
    js: Any, durable: str, stream: str = STREAM, *, engine: AsyncEngine | None = None
) -> bool:
    """True when the consumer has nothing pending and nothing awaiting an ack.

    With ``engine``, also no retry waiting in the database: a failed message is
    acked when its retry is parked there (see eop.pg.retries).
    An ordered handler's partitions each have a consumer named after the durable
    (``<durable>-p<partition>-e<epoch>``): all of them count.

    The consumers are read twice, 50 ms apart: a consumer's counts can lag the
    publish's ack (the server signals its consumers after storing the message),
    and a read in that gap shows an idle consumer that the message is about to
    reach. Once, under load, a worker was stopped before its only message ran.
    """
    if not await _consumers_idle(js, durable, stream):
        return False
    await asyncio.sleep(0.05)
    if not await _consumers_idle(js, durable, stream):
        return False
    if engine is None:
        return True
    return int(await scalar(engine, "SELECT count(*) FROM eop.retries WHERE parked")) == 0


async def _consumers_idle(js: Any, durable: str, stream: str) -> bool:
    """Whether ``durable``'s consumers have nothing pending and nothing awaiting an ack."""
    try:
        infos = [
            info
            for info in await js.consumers_info(stream)
            if info.name == durable or partitions.is_consumer_of(durable, info.name or "")
        ]
    except Exception:
        return False
    return bool(infos) and not any(info.num_pending or info.num_ack_pending for info in infos)


@contextlib.asynccontextmanager
async def running(app: eop.App, **kwargs: Any) -> AsyncIterator[Worker]:
    """Run a worker in a task for the body; stop it gracefully after."""
    worker = Worker(app, **kwargs)
    task = asyncio.create_task(worker.run())
    ready = asyncio.ensure_future(worker.ready.wait())
    await asyncio.wait({task, ready}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        task.result()  # raises what stopped the worker
    try:
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(task, timeout=30)


async def publish(js: Any, body: str, *, msg_id: str | None = None, subject: str = SUBJECT) -> Any:
    """Publish ``body``, with a Nats-Msg-Id when given."""
    headers = {"Nats-Msg-Id": msg_id} if msg_id else None
    return await js.publish(subject, body.encode(), headers=headers)


def error_lines(output: str) -> list[str]:
    """A command's last words in ``output`` as ``eop: error:`` lines, whatever the log
    format: a JSON ``command.failed`` line is read back into that text (its error)."""
    found = []
    for line in output.splitlines():
        if line.startswith("eop: error: "):
            found.append(line)
        elif line.startswith("{") and '"command.failed"' in line:
            entry = json.loads(line)
            if entry.get("event") == "command.failed":
                found.append(f"eop: error: {entry['error']}")
    return found


@contextlib.contextmanager
def debug_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """The lines logged inside, at every level: a command run in this process earlier
    (``eop.cli.main --log-level error``) may have left structlog filtering them."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(**saved)
