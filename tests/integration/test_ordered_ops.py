"""`eop audit` and `eop dlq replay` on an ordered handler's partitions.

An ordered handler has no durable of its own: each partition has an owner
(a lease in the database) and a consumer per ownership. These tests pin what
the operators' tools make of that, against real servers.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

import eop
from eop import errors
from eop.broker import partitions
from eop.ops import audit, dlq

from .bed import bed_settings, drained, running, wait_for
from .test_ordered_fleet import (
    STREAM,
    _applied,
    _shared,
    create_ledger,
    ledger_app,
    publish_burst,
)

PARTITIONS = 4


@pytest.mark.parametrize("count", [1, PARTITIONS])
async def test_audit_of_an_ordered_handler_judges_each_message_by_its_partition(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine, count: int
) -> None:
    """After two workers drained an ordered handler, the audit walks every partition
    (subjects stored behind their partition), matches each message with its inbox
    fingerprint and finds nothing wrong, naming each partition's consumer; an inbox row
    deleted afterwards is acked without an outcome under its partition's ack floor."""
    accounts, steps = 6, 10
    await create_ledger(engine, accounts)
    first = ledger_app(database_url, nats_url, count, compaction_interval_s=0)
    second = ledger_app(database_url, nats_url, count, compaction_interval_s=0)
    async with running(first) as w1, running(second) as w2:
        runners = (w1._runners["ledger"], w2._runners["ledger"])
        if count > 1:
            await wait_for(lambda: _shared(runners, count), timeout_s=30, what="shared")
        await publish_burst(nats_url, accounts, steps)
        await wait_for(lambda: _applied(engine, accounts * steps), timeout_s=60, what="all")
        await wait_for(lambda: drained(js, "eop-ledger", STREAM), what="every ack")

    report = await audit.run(first.with_settings(), ["ledger"])
    [h] = report.handlers
    assert h.clean, h.anomalies
    assert h.settled
    assert (h.checked, h.processed.count) == (accounts * steps, accounts * steps)
    assert [p.partition for p in h.partitions] == list(range(count))
    assert all(
        p.consumer and p.consumer.startswith(f"eop-ledger-p{p.partition}-e") for p in h.partitions
    )
    assert sum(p.ack_floor > 0 for p in h.partitions) == count
    assert "partition 0" in audit.render(report)

    async with engine.begin() as conn:
        seq = (
            await conn.execute(sa.text("DELETE FROM eop.inbox WHERE stream_seq = 7 RETURNING 1"))
        ).scalar_one()
    assert seq == 1
    [h] = (await audit.run(first.with_settings(), ["ledger"])).handlers
    assert [(a.kind, a.seq) for a in h.anomalies] == [("acked_without_outcome", 7)]


@pytest.mark.parametrize("count", [1, PARTITIONS])
async def test_replay_of_an_ordered_handlers_dead_letter_goes_to_its_partition(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine, count: int
) -> None:
    """A published replay of an ordered handler's dead letter is not refused for the
    handler's own partition consumers and reaches the healed handler; the fan-out check
    judges other consumers by the subject the stream stores it under (behind its
    partition): one on another partition does not stop it, one on its partition does."""
    healed: list[bool] = []
    seen: list[bytes] = []
    app = eop.App(settings=bed_settings(database_url, nats_url))
    app.stream(STREAM, subjects=["ledger.>"])

    @app.handler(
        stream=STREAM,
        subject="ledger.*.step",
        name="ledger",
        order_by="subject:1",
        partitions=count,
    )
    async def ledger(msg: eop.Message, session: Any) -> None:
        if msg.data == b"poison" and not healed:
            raise eop.Reject("poison")
        seen.append(msg.data)

    subject = "ledger.acc1.step"
    stored = partitions.stored_subject(partitions.transform(app.handlers["ledger"]), subject)
    async with running(app):
        await js.publish(subject, b"ok")
        await js.publish(subject, b"poison")
        await wait_for(lambda: drained(js, "eop-ledger", STREAM), what="the dead letter")
        async with engine.connect() as conn:
            dead = (await conn.execute(sa.text("SELECT id, subject FROM eop.dead_letters"))).one()
        assert dead[1] == subject
        healed.append(True)
        if count > 1:
            other = (int(stored.split(".")[0]) + 1) % count
            await js.add_consumer(
                STREAM, durable_name="spy-other", filter_subject=f"{other}.ledger.>"
            )
        [result] = await dlq.Replayer(app, js).replay_many([dead[0]])
        assert result.status == "published", result
        await wait_for(lambda: _async(b"poison" in seen), what="the replay handled")
        if count > 1:
            await js.add_consumer(STREAM, durable_name="spy-same", filter_subject=stored)
            with pytest.raises(errors.ReplayRefused, match="spy-same"):
                await dlq.Replayer(app, js).replay(dead[0], again=True)
    assert seen.count(b"poison") == 1


async def _async(value: bool) -> bool:
    return value
