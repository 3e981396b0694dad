"""`eop status`, `eop audit` and `eop dlq replay` on an ordered handler's partitions.

An ordered handler has no durable of its own: each partition has an owner
(a lease in the database) and a consumer per ownership. These tests pin what
the operators' tools make of that, against real servers.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

import eop
from eop import errors
from eop.handler import HandlerSpec
from eop.ops import audit, dlq, status
from eop.ordering import partitions

from .bed import bed_settings, drained, running, wait_for
from .test_cli import Workers, eop_env
from .test_cli import eop as run_eop
from .test_ordered_fleet import (
    LEDGER_APP,
    STREAM,
    _applied,
    _shared,
    create_ledger,
    ledger_app,
    publish_burst,
)

PARTITIONS = 4


async def _owned_by(engine: AsyncEngine, pids: set[int]) -> bool:
    """Every partition owned by one of ``pids``, each of them owning some, and every
    ownership's consumer recorded."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                sa.text(
                    "SELECT owner_pid, consumer = 'eop-ledger-p' || partition || '-e' || epoch"
                    " FROM eop.partitions WHERE subscription = 'ledger'"
                )
            )
        ).all()
    return (
        len(rows) == PARTITIONS
        and all(bool(ok) for _, ok in rows)
        and {pid for pid, _ in rows} == pids
    )


def _expected_lag(spec: HandlerSpec, subjects: list[str]) -> dict[int, int]:
    """Messages per partition, by the stream's transform (as nats-server hashes keys)."""
    transform = partitions.transform(spec)
    counted = Counter(
        int(partitions.stored_subject(transform, subject).split(".")[0]) for subject in subjects
    )
    return {p: counted.get(p, 0) for p in range(PARTITIONS)}


async def test_status_shows_each_partitions_owner_lag_members_and_last_rebalance(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine, tmp_path: Path
) -> None:
    """Two `eop worker` processes share an ordered handler's 4 partitions, then are killed
    and 24 messages arrive: `eop status` shows every partition with its owner (both
    processes, by host and pid), its consumer's lag and ack-pending counts (as the
    stream's transform spread the messages), the handler's totals, the two live members and
    the last rebalance; no missing-durable problem. A lease that ran out and a partition
    without an owner are warnings, in the text and the JSON."""
    accounts = 8
    await create_ledger(engine, accounts)
    env = eop_env(
        database_url, nats_url, EOP_PARTITION_LEASE_S="60", LEDGER_PARTITIONS=str(PARTITIONS)
    )
    pool = Workers(env, tmp_path, app=LEDGER_APP)
    procs = [pool.start(), pool.start()]
    pids = {p.pid for p in procs}
    try:
        await wait_for(lambda: _owned_by(engine, pids), timeout_s=60, what="both own some")
        await publish_burst(nats_url, accounts, 5)
        await wait_for(lambda: _applied(engine, accounts * 5), timeout_s=60, what="every step")
        await wait_for(lambda: drained(js, "eop-ledger", STREAM), what="every ack")
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    finally:
        pool.stop_all()
    await publish_burst(nats_url, accounts, 3, start=6)
    app = ledger_app(database_url, nats_url, PARTITIONS)
    subjects = [f"ledger.acc{i}.step" for i in range(accounts)] * 3
    expected = _expected_lag(app.handlers["ledger"], subjects)
    try:
        [s] = await status.collect(app)
    finally:
        await app.dispose()
    assert s.problems == [], s.problems
    assert s.warnings == [], s.warnings
    assert s.ordered is not None
    assert [p.partition for p in s.ordered.partitions] == list(range(PARTITIONS))
    owners = s.ordered.owners()
    assert {owner.rsplit(":", 1)[1] for owner in owners} == {str(pid) for pid in pids}
    assert sorted(n for parts in owners.values() for n in parts) == list(range(PARTITIONS))
    assert {p.partition: p.num_pending for p in s.ordered.partitions} == expected
    assert {p.ack_pending for p in s.ordered.partitions} == {0}
    assert (s.num_pending, s.ack_pending) == (accounts * 3, 0)
    assert {m.pid for m in s.ordered.members} == pids
    async with engine.connect() as conn:
        last_at, last_epoch = (
            await conn.execute(
                sa.text(
                    "SELECT acquired_at, epoch FROM eop.partitions"
                    " ORDER BY acquired_at DESC, epoch DESC LIMIT 1"
                )
            )
        ).one()
    assert (s.ordered.last_rebalance_at, s.ordered.last_rebalance_epoch) == (last_at, last_epoch)

    text = run_eop("status", LEDGER_APP, env=env)
    assert text.returncode == 0, text.stderr
    assert "PARTITION" in text.stdout
    assert "eop-ledger-p3-e" in text.stdout
    for pid in pids:
        assert f":{pid} owns partition" in text.stdout
    assert "live members: " in text.stdout
    assert "last rebalance: " in text.stdout
    assert "does not exist" not in text.stdout + text.stderr

    async with engine.begin() as conn:
        await conn.execute(
            sa.text(
                "UPDATE eop.partitions SET expires_at = now() - interval '5 seconds'"
                " WHERE partition = 0"
            )
        )
        await conn.execute(
            sa.text(
                "UPDATE eop.partitions SET owner = NULL, owner_host = NULL, owner_pid = NULL,"
                " expires_at = NULL WHERE partition = 1"
            )
        )
    as_json = run_eop("status", LEDGER_APP, "--json", env=env)
    assert as_json.returncode == 0, as_json.stderr
    [row] = json.loads(as_json.stdout)
    shown = {p["partition"]: p for p in row["ordered"]["partitions"]}
    assert shown[0]["expired"] is True
    assert shown[1]["owner"] is None
    assert {p: shown[p]["num_pending"] for p in shown} == expected
    assert row["ordered"]["last_rebalance_epoch"] == last_epoch
    assert {m["pid"] for m in row["ordered"]["members"]} == pids
    assert any("partition 0's lease expired" in w for w in row["warnings"])
    assert any("partition 1 has no owner" in w for w in row["warnings"])
    assert row["problems"] == []


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
        # Not drained(): a partition whose consumer is not made yet has nothing pending.
        await wait_for(
            lambda: _count(engine, "SELECT count(*) FROM eop.dead_letters", 1),
            what="the dead letter",
        )
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


async def _count(engine: AsyncEngine, query: str, wanted: int) -> bool:
    async with engine.connect() as conn:
        return int((await conn.execute(sa.text(query))).scalar_one()) >= wanted
