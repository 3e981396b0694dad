"""The regression guard of PostgreSQL's work per message on eop's default path.

A fixed workload (2,000 messages through an ``eop.Writes`` handler at default
settings, drained from a backlog, then compacted away) on a PostgreSQL of the
test's own, counted as ``eop bench --pg-profile`` counts it
(:mod:`eop.tools.bench.pgcount`): statements from the server's log, WAL from
``pg_waldump``, buffer accesses from ``pg_statio_user_tables``. Nothing is
timed, so the machine's load moves none of it; a ceiling crossed is work
added per message (BENCHMARKS.md, "Where PostgreSQL's time goes", tells how
to see where).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import eop
from eop import settings as settings_mod
from eop.pg import migrate
from eop.tools import embedded
from eop.tools.bench import pgcount

from .bed import wait_for

MESSAGES = 2_000
STREAM, SUBJECT, HANDLER = "WORK", "work.done", "work"
DURABLE = f"eop-{HANDLER}"
INSERT = sa.text("INSERT INTO work_effects (seq) VALUES (:s)")

# The ceilings: the figures of the code as committed, plus a margin. Three runs here
# with the batch's queued INSERTs sent as one statement of many rows: 0.120 to 0.160
# statements a message, 388 WAL bytes (full-page images left out), 8.25 to 8.31 buffer
# accesses of the inbox; sent as an executemany (a statement a row), five runs: 1.103
# to 1.107 statements, 388 to 389 WAL bytes. With the inbox keyed by (subscription,
# stream, stream_epoch, stream_seq), four runs: 1.103 to 1.136, 484 to 486 WAL bytes,
# 10.74 to 10.85 buffer accesses. What moves them a little: how many messages each
# fetch brought (32 to 51 batch transactions for the 2,000, whatever the load), the
# clock's statements (the relay, the retry poll: a few a second, no WAL), compaction's
# rounds.
STATEMENTS_CEILING = 0.35
"""Statements per message: each batch's BEGIN, claim (which sets the local timeouts),
INSERT of its rows and COMMIT over its messages (0.048 to 0.077 a message with 32 to 51
batches; a SET LOCAL of its own added 0.016 to 0.026), compaction's
rounds (a raise and a delete, and a look-up in those from the first sequence) and the
clock's polls (about 0.04, more when a loaded CI machine stretches the drain). The
handler's INSERTs sent a statement a row again (an executemany) make it 1.1; the margin
allows batches of 30 messages on average instead of 64, or the clock's polls of a drain
four times as long."""
WAL_CEILING = 410
"""WAL bytes per message, full-page images left out (they follow checkpoints, not the
work): the inbox row's insert, its index entry and its delete, the handler's row, the
batch's COMMIT. About 5 % over the measured figure: a 32-byte column of the inbox row,
or a HOT update per message, crosses it, and the inbox keyed by its three text columns
again (484, 74 bytes over) by far."""
BUFFERS_CEILING = 10.5
"""Buffer accesses (found in memory or read) of the tables and their indexes, per
message: the work of finding rows, which the statements and the WAL do not show. About
5 % over. The inbox keyed by its three text columns again crosses it (10.74 to 10.85,
0.24 over at least), and so do compaction's delete reading each row twice, selecting
ctids then deleting by them (11.57 to 11.68 with that key), and the claim reading the
watermark for every row instead of once (13.6 with that key)."""


def _app(database_url: str, nats_url: str) -> eop.App:
    """Default settings; one ``eop.Writes`` handler writing one row per message."""
    app = eop.App(settings=settings_mod.Settings(database_url=database_url, nats_url=nats_url))
    app.stream(STREAM, subjects=[SUBJECT])

    @app.handler(stream=STREAM, subject=SUBJECT, name=HANDLER)
    async def record(msg: eop.Message, writes: eop.Writes) -> None:
        writes.add(INSERT, {"s": msg.seq})

    return app


async def _pause(nc: Any, paused: bool) -> None:
    body = {"pause_until": "2999-01-01T00:00:00Z"} if paused else {}
    subject = f"$JS.API.CONSUMER.PAUSE.{STREAM}.{DURABLE}"
    reply = json.loads((await nc.request(subject, json.dumps(body).encode(), 5.0)).data)
    assert "error" not in reply, reply


async def _count(engine: Any, query: str) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(sa.text(query))).scalar_one())


async def test_postgres_work_per_message_stays_under_its_ceilings(
    make_postgres_server: Any, nats_url: str
) -> None:
    """2,000 messages through the default eop.Writes path, each taking effect once and the
    inbox compacted to nothing, cost PostgreSQL no more statements, WAL bytes and buffer
    accesses per message than the ceilings above (a failure names what grew)."""
    settings = {**pgcount.SERVER_SETTINGS, "autovacuum": "off"}
    pg: embedded.PostgresServer = make_postgres_server(settings=settings)
    await asyncio.to_thread(migrate.upgrade, pg.url)
    own = create_async_engine(
        pg.url,
        connect_args={"server_settings": {"application_name": pgcount.OWN_APPLICATION}},
        isolation_level="AUTOCOMMIT",
    )
    nc = await nats.connect(nats_url)
    try:
        async with own.connect() as conn:
            await conn.execute(sa.text("CREATE TABLE work_effects (seq bigint NOT NULL)"))
        log = pgcount.StatementLog(pg.data_dir)
        async with eop.Worker(_app(pg.url, nats_url)).running():
            await _pause(nc, True)
            js = nc.jetstream()
            acks = [await js.publish_async(SUBJECT, b"x" * 100) for _ in range(MESSAGES)]
            await asyncio.gather(*acks)
            async with own.connect() as conn:
                await conn.execute(sa.text("VACUUM"))
                await conn.execute(sa.text("CHECKPOINT"))
                before = await pgcount.snapshot(conn)
            offset = log.offset()
            await _pause(nc, False)

            async def done() -> bool:
                effects = await _count(own, "SELECT count(*) FROM work_effects")
                inbox = await _count(own, "SELECT count(*) FROM eop.inbox")
                return effects == MESSAGES and inbox == 0

            # The inbox is emptied by compaction's rounds: the last one a compaction
            # interval (5 s) after the last message.
            await wait_for(done, timeout_s=60, what="every message, then an empty inbox")
        await asyncio.sleep(1.0)  # the exited backends' statistics reach the views
        async with own.connect() as conn:
            after = await pgcount.snapshot(conn)
            statements = log.since(offset)
            wal = pgcount.waldump(embedded.postgres_bin_dir(), pg.data_dir, before.lsn, after.lsn)
            wal.name_relations(await pgcount.relation_names(conn, wal))
    finally:
        await nc.close()
        await own.dispose()
    work = pgcount.table_work(before, after)
    per_statement = statements.total / MESSAGES
    per_wal = (wal.bytes - wal.fpi_bytes) / MESSAGES
    per_buffer = sum(w.heap_blocks + w.index_blocks for w in work.values()) / MESSAGES
    detail = _detail(statements, wal, work)
    assert work["public.work_effects"].inserted == MESSAGES, detail
    assert per_statement <= STATEMENTS_CEILING, f"{per_statement:.4f} statements/msg\n{detail}"
    assert per_wal <= WAL_CEILING, f"{per_wal:.1f} WAL bytes/msg\n{detail}"
    assert per_buffer <= BUFFERS_CEILING, f"{per_buffer:.2f} buffer accesses/msg\n{detail}"


def _detail(
    statements: pgcount.Statements, wal: pgcount.Wal, work: dict[str, pgcount.TableWork]
) -> str:
    """What the counts were made of, per message: for the message of a failing assertion."""
    n = MESSAGES
    lines = [f"statements ({statements.total / n:.4f}/msg):"]
    lines += [f"  {c / n:.4f} {name}" for name, c in sorted(statements.calls.items())]
    lines.append(f"WAL ({wal.bytes / n:.1f} B/msg, {wal.fpi_bytes / n:.1f} of full pages):")
    lines += [f"  {b / n:.1f} B {name}" for name, (_, b) in sorted(wal.by_relation.items())]
    lines.append("tables (rows written, buffer accesses per message):")
    lines += [
        f"  {name}: {w.written / n:.3f} rows, {(w.heap_blocks + w.index_blocks) / n:.2f} buffers"
        for name, w in sorted(work.items())
    ]
    return "\n".join(lines)
