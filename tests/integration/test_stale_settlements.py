"""Settlements of a deleted stream's deliveries never reach its recreation, on real servers.

nats-server applies an ack to the consumer its reply subject names at the stream sequence
it names, and checks nothing else: a durable consumer recreated under the same name with
its stream takes a late ack of the old incarnation's message as an ack of its own message
at that sequence. Acked while another run still processes it, that message is lost to
the first crash or stop (eop.broker.fence).
"""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from structlog.testing import capture_logs

import eop

from . import bed
from .bed import STREAM


async def test_a_late_ack_of_a_deleted_streams_message_leaves_the_recreated_streams_alone(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A handler runs through its stream's deletion; the worker recreates the stream and its
    consumer, and the new incarnation's first message (the same sequence, 1) is running
    when the old one commits. The old message's ack is not sent (``ack.fenced``): the new
    message is still pending on the consumer until its own run acks it, and each message
    took effect once. Sent, the ack settled the new message while its handler ran."""
    await bed.create_effects_table(engine)
    app = eop.App(settings=bed.bed_settings(database_url, nats_url, ack_wait_s=30.0))
    app.stream(STREAM, subjects=["ORDERS.>"], storage="file")
    started = {"old": asyncio.Event(), "new": asyncio.Event()}
    go = {"old": asyncio.Event(), "new": asyncio.Event()}

    @app.handler(stream=STREAM, subject=bed.SUBJECT, name="fenced")
    async def fenced(msg: eop.Message, session: AsyncSession) -> None:
        """Waits for the test's go, then records its message."""
        body = msg.data.decode()
        started[body].set()
        await go[body].wait()
        await bed.record_effect(session, "fenced", msg)

    durable = app.handlers["fenced"].durable

    async def consumer_back() -> bool:
        try:
            await js.consumer_info(STREAM, durable)
        except Exception:
            return False
        return True

    with capture_logs() as logs:
        async with bed.running(app):
            await bed.publish(js, "old")
            await asyncio.wait_for(started["old"].wait(), 20)
            await js.delete_stream(STREAM)
            await bed.wait_for(consumer_back, timeout_s=30, what="the worker to recreate it")
            assert (await bed.publish(js, "new")).seq == 1
            await asyncio.wait_for(started["new"].wait(), 30)
            go["old"].set()

            async def old_settled() -> bool:
                """Its ack held back, or sent: the new message no longer pending."""
                if any(e["event"] == "ack.fenced" for e in logs):
                    return True
                return bool((await js.consumer_info(STREAM, durable)).num_ack_pending == 0)

            await bed.wait_for(old_settled, what="the old message's ack")
            info = await js.consumer_info(STREAM, durable)
            assert info.num_ack_pending == 1, "the new message was acked while it ran"
            go["new"].set()
            await bed.wait_for(lambda: bed.drained(js, durable), what="the new message")
    assert await bed.effects_by_body(engine) == {"old": 1, "new": 1}
    [entry] = [e for e in logs if e["event"] == "ack.fenced"]
    assert (entry["action"], entry["seq"]) == ("ack", 1)
