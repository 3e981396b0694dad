"""Scenario (b) of the specification: duplicate publishes, two effects, nothing left."""

from __future__ import annotations

from typing import Any

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop

from .bed import (
    bed_settings,
    create_effects_table,
    drained,
    effects_by_body,
    record_effect,
    wait_for,
)
from .bed import running as run_worker


async def test_msg_ids_1_2_1_1_2_2_store_two_and_take_effect_twice(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """'hello' on test.1, 'world' on test.2, Msg-Ids 1,2,1,1,2,2, one-minute window.

    The server stores 2 messages, the handler's effects number 2, and a later
    fetch finds nothing.
    """
    await create_effects_table(engine)
    await js.add_stream(name="TEST", subjects=["test.*"], duplicate_window=60.0)
    app = eop.App(settings=bed_settings(database_url, nats_url))

    @app.handler(stream="TEST", subject="test.*", name="scenario-b")
    async def effect(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, "scenario-b", msg)

    sends = [("test.1", b"hello", "1"), ("test.2", b"world", "2")]
    acks = []
    for index in (0, 1, 0, 0, 1, 1):
        subject, body, msg_id = sends[index]
        acks.append(await js.publish(subject, body, headers={"Nats-Msg-Id": msg_id}))
    assert [bool(a.duplicate) for a in acks] == [False, False, True, True, True, True]
    assert (await js.stream_info("TEST")).state.messages == 2

    async with run_worker(app):
        await wait_for(lambda: drained(js, "eop-scenario-b", stream="TEST"), what="2 effects")
    assert await effects_by_body(engine) == {"hello": 1, "world": 1}

    psub = await js.pull_subscribe_bind(durable="eop-scenario-b", stream="TEST")
    with pytest.raises(NatsTimeoutError):
        await psub.fetch(1, timeout=0.5)
