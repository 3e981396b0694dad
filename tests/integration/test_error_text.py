"""What a failed handler statement leaves in dead letters and logs: never its bound values."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
import structlog
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncEngine

import eop
from eop import log
from eop.app import sync_url

from .bed import (
    STREAM,
    SUBJECT,
    bed_settings,
    create_effects_table,
    drained,
    record_effect,
    running,
    scalar,
    wait_for,
)
from .test_batch import prepublish

# A body the effects table refuses; it is the payload, so it must appear nowhere.
POISON = "poison-5e1f9c"
EFFECT = sa.text("INSERT INTO effects (handler, msg_key, body) VALUES (:h, :k, :b)")


def _assert_no_bound_values(text: str) -> None:
    assert POISON not in text
    assert "[parameters:" not in text
    assert "sqlalche.me" not in text
    # PostgreSQL's DETAIL of a check violation quotes the whole row.
    assert "Failing row contains" not in text


@pytest.mark.parametrize("mode", ["session", "writes", "sync"])
async def test_a_failing_statement_is_described_without_its_parameters(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine, mode: str
) -> None:
    """A handler's INSERT violates a check constraint: the dead letter's error and traceback,
    and the retry and dead-letter log lines, name the constraint and the SQL but hold
    neither the bound values (the payload) nor PostgreSQL's row detail. The line of the
    first failure's park says why, with the failures so far."""
    await create_effects_table(engine)
    async with engine.begin() as conn:
        await conn.execute(
            sa.text(f"ALTER TABLE effects ADD CONSTRAINT no_poison CHECK (body <> '{POISON}')")
        )
    # The user's own engines, made without hide_parameters: the description alone
    # must keep the values out.
    sync_engine = sa.create_engine(sync_url(sa.make_url(database_url)))
    app = eop.App(
        settings=bed_settings(database_url, nats_url, max_attempts=2, batch=32, concurrency=32),
        engine=engine,
        sync_sessionmaker=orm.sessionmaker(sync_engine, expire_on_commit=False),
    )
    app.stream(STREAM, subjects=["ORDERS.>"])

    if mode == "session":

        @app.handler(stream=STREAM, subject=SUBJECT, name="checked")
        async def by_session(msg: eop.Message, session: Any) -> None:
            await record_effect(session, "checked", msg)

    elif mode == "sync":  # psycopg, whose error text holds PostgreSQL's DETAIL

        @app.handler(stream=STREAM, subject=SUBJECT, name="checked")
        def by_sync_session(msg: eop.Message, session: orm.Session) -> None:
            session.execute(
                EFFECT, {"h": "checked", "k": msg.idempotency_key, "b": msg.data.decode()}
            )

    else:

        @app.handler(stream=STREAM, subject=SUBJECT, name="checked")
        async def by_writes(msg: eop.Message, writes: eop.Writes) -> None:
            writes.add(EFFECT, {"h": "checked", "k": msg.idempotency_key, "b": msg.data.decode()})

    await prepublish(js, ["fine", POISON])
    try:
        with structlog.testing.capture_logs() as logs:
            async with running(app):
                await wait_for(
                    lambda: drained(js, "eop-checked", engine=engine),
                    what="the poison's dead letter",
                )
    finally:
        sync_engine.dispose()

    error = await scalar(engine, "SELECT error FROM eop.dead_letters")
    tb = await scalar(engine, "SELECT traceback FROM eop.dead_letters")
    assert "no_poison" in error
    assert "INSERT INTO effects" in error
    assert "IntegrityError" in error
    _assert_no_bound_values(error)
    assert "no_poison" in tb
    _assert_no_bound_values(tb)

    logged = [
        e
        for e in logs
        if e["event"] in (str(log.Event.MESSAGE_RETRY), str(log.Event.MESSAGE_DEAD_LETTERED))
        and "error" in e
    ]
    assert logged
    for entry in logged:
        _assert_no_bound_values(str(entry["error"]))
    parks = [e for e in logged if e.get("action") == str(log.Action.PARK)]
    assert any("no_poison" in str(e["error"]) and e.get("failures") == 1 for e in parks)
