"""Long and odd Nats-Msg-Ids, and a claim the inbox refuses, against real servers."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop

from .bed import (
    STREAM,
    bed_settings,
    create_effects_table,
    drained,
    effects_by_body,
    publish,
    record_effect,
    running,
    scalar,
    wait_for,
)

# Random characters do not compress: a btree index on the raw msg-id cannot hold
# this one (its row limit is about 2.7 kB).
LONG_ID = secrets.token_urlsafe(3750)
ODD_ID = "nul\x00 ünï ☃ \t x"


def make_app(database_url: str, nats_url: str, **changes: Any) -> eop.App:
    """An app that fetches everything published before it starts in one batch."""
    changes.setdefault("batch", 64)
    changes.setdefault("concurrency", 64)
    return eop.App(settings=bed_settings(database_url, nats_url, **changes))


def recording_handler(app: eop.App, name: str) -> None:
    """A handler that writes one effect row per message it processes."""

    @app.handler(stream=STREAM, subject="ORDERS.created", name=name)
    async def handle(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, name, msg)


async def dead_letters(engine: AsyncEngine) -> list[tuple[str, str, str]]:
    """(subject body, reason, error) of every dead letter."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            sa.text("SELECT convert_from(payload, 'UTF8'), reason, error FROM eop.dead_letters")
        )
        return [(str(b), str(r), str(e)) for b, r, e in rows]


async def still_processes(app_js: Any, engine: AsyncEngine, durable: str) -> None:
    """The worker keeps running: a message published now takes effect."""
    await publish(app_js, "after", msg_id="after-1")
    await wait_for(lambda: drained(app_js, durable), what="the message published after")
    assert (await effects_by_body(engine)).get("after") == 1


async def test_long_and_odd_msg_ids_do_not_block_their_batch(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A 5,000-character and a NUL/non-ASCII/whitespace msg-id in one batch with 60 others.

    The inbox indexes a digest of the msg-id, so every message of the batch is
    claimed in the one multi-row statement: each takes effect once, none is
    dead-lettered, and the worker goes on.
    """
    await create_effects_table(engine)
    app = make_app(database_url, nats_url)
    recording_handler(app, "ids")
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    good = [f"g{i}" for i in range(60)]
    for i, body in enumerate(good):
        await publish(js, body, msg_id=f"id-{i}" if i % 2 else None)
    await publish(js, "long", msg_id=LONG_ID)
    await publish(js, "odd", msg_id=ODD_ID)
    async with running(app):
        await wait_for(lambda: drained(js, "eop-ids"), what="the batch")
        await still_processes(js, engine, "eop-ids")
    assert await effects_by_body(engine) == dict.fromkeys([*good, "long", "odd", "after"], 1)
    assert await dead_letters(engine) == []
    stored = await scalar(engine, "SELECT length(msg_id) FROM eop.inbox WHERE stream_seq = 61")
    assert stored == len(LONG_ID)
    odd = await scalar(engine, "SELECT msg_id FROM eop.inbox WHERE stream_seq = 62")
    assert odd == ODD_ID.replace("\x00", "\ufffd")  # PostgreSQL text holds no NUL


async def test_republished_long_msg_id_after_the_duplicate_window_is_skipped(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Past the server's duplicate window, the inbox still catches a long msg-id's republish."""
    await create_effects_table(engine)
    app = make_app(database_url, nats_url)
    app.stream(STREAM, subjects=["ORDERS.>"], duplicate_window_s=0.5)
    recording_handler(app, "republish")
    async with running(app):
        first = await publish(js, "long-1", msg_id=LONG_ID)
        await wait_for(lambda: drained(js, "eop-republish"), what="the first copy")
        await asyncio.sleep(1.0)  # past the duplicate window: the server has forgotten the id
        second = await publish(js, "long-1", msg_id=LONG_ID)
        assert not second.duplicate
        assert second.seq == first.seq + 1
        await wait_for(lambda: drained(js, "eop-republish"), what="the republished copy")
    assert await effects_by_body(engine) == {"long-1": 1}
    claimed = await scalar(
        engine, "SELECT count(*) FROM eop.inbox WHERE stream_seq = :seq", seq=second.seq
    )
    assert claimed == 0  # skipped by msg-id, never claimed
    assert await dead_letters(engine) == []


REFUSE_DDL = (
    """
    CREATE FUNCTION eop.refuse_msg_id() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.msg_id = 'refused' THEN
            RAISE EXCEPTION 'this msg-id cannot be stored' USING ERRCODE = '22023';
        END IF;
        RETURN NEW;
    END $$
    """,
    "CREATE TRIGGER refuse_msg_id BEFORE INSERT ON eop.inbox"
    " FOR EACH ROW EXECUTE FUNCTION eop.refuse_msg_id()",
)


async def test_a_claim_refused_for_one_message_is_that_messages_alone(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The inbox refuses one message's row (a trigger stands in for any such error).

    Its batch falls back to one message at a time: the others take effect
    once, none dead-lettered; the refused one is dead-lettered once as
    undecodable, its inbox row claimed without its msg-id, never nak'ed forever.
    """
    await create_effects_table(engine)
    async with engine.begin() as conn:
        for ddl in REFUSE_DDL:
            await conn.execute(sa.text(ddl))
    app = make_app(database_url, nats_url)
    recording_handler(app, "refuse")
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    good = [f"g{i}" for i in range(20)]
    for i, body in enumerate(good[:10]):
        await publish(js, body, msg_id=f"id-{i}")
    await publish(js, "refused", msg_id="refused")
    for body in good[10:]:
        await publish(js, body)
    async with running(app):
        await wait_for(lambda: drained(js, "eop-refuse"), what="the batch")
        await still_processes(js, engine, "eop-refuse")
    assert await effects_by_body(engine) == dict.fromkeys([*good, "after"], 1)
    [(body, reason, error)] = await dead_letters(engine)
    assert (body, reason) == ("refused", "undecodable")
    assert "cannot be stored" in error
    assert "inbox" in error
    row = await scalar(
        engine,
        "SELECT outcome || ':' || coalesce(msg_id, '-') FROM eop.inbox WHERE stream_seq = 11",
    )
    assert row == "dead_lettered:-"
