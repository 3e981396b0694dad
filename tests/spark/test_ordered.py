"""Spark and ordered handlers: the subjects of a partitioned handler, and no job beside workers.

``spark_partitioned`` (tests/spark/sparkapp.py) spreads its accounts over 3
partitions, so the stream stores ``ORDERS.acc1.step`` as ``<n>.ORDERS.acc1.step``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from eop import cli, errors
from eop.broker import jetstream
from eop.contrib.spark import fleet, jobs, lease, sink
from eop.contrib.spark.apply import Counts
from eop.message import fingerprint
from eop.ordering import partitions
from tests.integration.bed import STREAM, bed_settings, create_effects_table, running, wait_for

from . import sparkapp

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration

HANDLER = "spark_partitioned"
SPEC = sparkapp.app.handlers[HANDLER]


@pytest.fixture
async def bed_engine(engine: AsyncEngine) -> AsyncEngine:
    """The test database with an effects table."""
    await create_effects_table(engine)
    return engine


async def _rows(engine: AsyncEngine, query: str) -> list[tuple[Any, ...]]:
    async with engine.connect() as conn:
        return [tuple(row) for row in await conn.execute(sa.text(query))]


async def _worker_caught_up(js: Any) -> bool:
    """Every partition has its consumer, and none has anything pending or unacked."""
    infos = [i for i in await js.consumers_info(STREAM) if i.name.startswith(f"{SPEC.durable}-p")]
    return len(infos) == SPEC.partitions and not any(
        i.num_pending or i.num_ack_pending for i in infos
    )


async def test_a_partitioned_backfill_gives_the_handler_what_a_worker_would(
    spark: SparkSession, database_url: str, nats_url: str, js: Any, bed_engine: AsyncEngine
) -> None:
    """partitions=3: the backfill reads the stored ``<n>.ORDERS.<account>.step`` subjects,
    keeps each account in order by its own token, and hands the handler (and the inbox's
    fingerprint) the subject as published; a worker started afterwards finds every message
    done, with the same fingerprint (no quarantine), and while it runs a backfill refuses."""
    await js.add_stream(
        jetstream.stream_config(sparkapp.app.stream_spec(STREAM), partitions.transform(SPEC))
    )
    published = []
    for i in range(30):
        subject, msg_id = f"ORDERS.acc{i % 4}.step", f"id-{i}" if i % 2 else None
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        ack = await js.publish(subject, f"{i}".encode(), headers=headers)
        published.append((ack.seq, subject, msg_id, f"{i}".encode()))
    stored = (await js.get_msg(STREAM, 1)).subject
    assert stored.partition(".")[2] == "ORDERS.acc0.step"
    assert stored != "ORDERS.acc0.step"

    target = sink.Target.create(sparkapp.PATH, HANDLER, database_url=database_url)
    read = jobs.ReadOptions(nats_url, per_partition=7)
    counts = await asyncio.to_thread(jobs.backfill, spark, target, SPEC, read)
    assert counts == Counts(processed=30)

    effects = await _rows(bed_engine, "SELECT msg_key, body FROM effects ORDER BY id")
    assert sorted(body for _, body in effects) == sorted(s for _, s, _, _ in published)
    for account in range(4):
        seqs = [int(k.split(":")[1]) for k, _ in effects if k.startswith(f"acc{account}:")]
        assert seqs == sorted(seqs)
        assert len(seqs) in (7, 8)
    inbox = dict(await _rows(bed_engine, "SELECT stream_seq, fingerprint FROM eop.inbox"))
    assert inbox == {seq: fingerprint(s, m, d) for seq, s, m, d in published}

    app = sparkapp.app.with_settings(**vars(bed_settings(database_url, nats_url)))
    async with running(app, handlers=[HANDLER]):
        await wait_for(lambda: _worker_caught_up(js), what="the worker to see every partition")
        with pytest.raises(errors.ConfigurationError, match=r"'spark_partitioned'.* 1 worker"):
            await asyncio.to_thread(jobs.backfill, spark, target, SPEC, read)
    assert await _rows(bed_engine, "SELECT count(*) FROM eop.dead_letters") == [(0,)]
    assert len(await _rows(bed_engine, "SELECT id FROM effects")) == 30


@pytest.mark.parametrize("held_by", ["member", "lease", "expired"])
async def test_a_spark_job_of_an_ordered_handler_refuses_to_start_while_workers_hold_it(
    database_url: str,
    nats_url: str,
    engine: AsyncEngine,
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
    held_by: str,
) -> None:
    """A live member row, or an unexpired partition lease, of the handler: `eop spark
    backfill` and `eop spark stream` fail at once (before Spark starts) with one line naming
    the handler, the processes and hosts, and the fix; expired rows hold nothing."""
    expires = "now() - interval '1 second'" if held_by == "expired" else "now() + interval '1 h'"
    async with engine.begin() as conn:
        if held_by in ("member", "expired"):
            await conn.execute(
                sa.text(
                    "INSERT INTO eop.members (subscription, member, host, pid, expires_at) "
                    f"VALUES (:s, 'web-1:7:ab', 'web-1', 7, {expires})"
                ),
                {"s": HANDLER},
            )
        if held_by in ("lease", "expired"):
            await conn.execute(
                sa.text(
                    "INSERT INTO eop.partitions (subscription, partition, partition_count, "
                    "owner, owner_host, owner_pid, expires_at) "
                    f"VALUES (:s, 1, 3, 'web-2:8:cd', 'web-2', 8, {expires})"
                ),
                {"s": HANDLER},
            )
    if held_by == "expired":
        app = sparkapp.app.with_settings(database_url=database_url)
        try:
            await asyncio.to_thread(fleet.check_idle, app, SPEC)
        finally:
            await app.dispose()
        return
    base = [sparkapp.PATH, "--handler", HANDLER, "--database-url", database_url]
    # A master nobody listens on: had the command got past the check, it would fail there.
    base += ["--nats-url", nats_url, "--master", "spark://127.0.0.1:1"]
    host = "web-1" if held_by == "member" else "web-2"
    for action in (["backfill"], ["stream", "--checkpoint", str(tmp_path)]):
        status = await asyncio.to_thread(
            cli.main, ["--log-level", "error", "spark", *action, *base]
        )
        err = capsys.readouterr().err
        assert status == 1
        assert err.startswith(
            f"eop: error: handler {HANDLER!r} keeps its keys in order and 1 worker process "
            f"on 1 host ({host}) run it"
        ), err
        assert "scale them to 0" in err
        assert len(err.strip().splitlines()) == 1


async def _publish(js: Any, start: int, count: int) -> None:
    for i in range(start, start + count):
        await js.publish(f"ORDERS.acc{i % 4}.step", f"{i}".encode())


async def _owners(engine: AsyncEngine) -> list[str | None]:
    rows = await _rows(engine, f"SELECT owner FROM eop.partitions WHERE subscription = '{HANDLER}'")
    return [owner for (owner,) in rows]


async def test_a_worker_started_during_a_spark_stream_waits_for_it_then_goes_on_in_order(
    spark: SparkSession,
    database_url: str,
    nats_url: str,
    js: Any,
    bed_engine: AsyncEngine,
    tmp_path: Any,
) -> None:
    """The stream holds every partition's lease while it runs: a worker started meanwhile
    owns no partition and processes nothing (the stream does, the messages published
    after the worker started included); once the stream stops it gives the leases up,
    the worker takes them and handles what comes next, each account in stream order."""
    await js.add_stream(
        jetstream.stream_config(sparkapp.app.stream_spec(STREAM), partitions.transform(SPEC))
    )
    settings = bed_settings(database_url, nats_url, partition_lease_s=3.0)
    app = sparkapp.app.with_settings(**vars(settings))
    target = sink.Target.create(sparkapp.PATH, HANDLER, database_url=database_url)
    effects = "SELECT count(*) FROM effects"
    await _publish(js, 0, 20)
    query = await asyncio.to_thread(
        jobs.stream,
        spark,
        target,
        SPEC,
        jobs.ReadOptions(nats_url),
        checkpoint=str(tmp_path / "checkpoint"),
        trigger_s=0.5,
        on_batch=lambda *_: None,
        app=app,
    )
    waiting = asyncio.ensure_future(asyncio.to_thread(jobs.wait, query))
    try:
        await wait_for(lambda: _equals(_rows(bed_engine, effects), [(20,)]), 60, "the stream")
        async with running(app, handlers=[HANDLER]) as worker:
            await _publish(js, 20, 20)
            await wait_for(lambda: _equals(_rows(bed_engine, effects), [(40,)]), 60, "40")
            # Several of the worker's ticks (a second apart): it found nothing to own.
            await asyncio.sleep(3)
            owners = await _owners(bed_engine)
            assert worker.processed == 0
            assert len(owners) == 3
            assert all(owner is not None and ":spark-" in owner for owner in owners), owners
            query.stop()
            await waiting
            await wait_for(lambda: _all_owned_by_workers(bed_engine), 30, "the worker to take over")
            await _publish(js, 40, 20)
            await wait_for(lambda: _equals(_rows(bed_engine, effects), [(60,)]), 60, "60")
            assert worker.processed >= 20
    finally:
        query.stop()
        await waiting
    rows = await _rows(bed_engine, "SELECT msg_key FROM effects ORDER BY id")
    for account in range(4):
        seqs = [int(k.split(":")[1]) for (k,) in rows if k.startswith(f"acc{account}:")]
        assert seqs == sorted(seqs)
        assert len(seqs) == 15
    assert await _rows(bed_engine, "SELECT count(*) FROM eop.dead_letters") == [(0,)]


async def _equals(rows: Any, expected: list[tuple[Any, ...]]) -> bool:
    return bool(await rows == expected)


async def _all_owned_by_workers(engine: AsyncEngine) -> bool:
    owners = await _owners(engine)
    return bool(owners) and all(o is not None and ":spark-" not in o for o in owners)


def test_an_ordered_job_starting_inside_the_stream_is_refused_before_it_runs() -> None:
    """A range from --from-seq would run a key's messages at and above it before its earlier
    ones that have no outcome yet, and the later ones after them: refused in one line, as
    the command builds its options (before Spark starts). From the stream's start, or
    ending early (--to-seq), a range keeps each key's order."""
    read = jobs.ReadOptions(nats_url="nats://127.0.0.1:1", from_seq=28760)
    with pytest.raises(errors.ConfigurationError, match=r"keeps its keys in order.*--from-seq"):
        jobs.check_range(SPEC, read)
    jobs.check_range(SPEC, jobs.ReadOptions(nats_url="nats://127.0.0.1:1", from_seq=1, to_seq=9))
    jobs.check_range(SPEC, jobs.ReadOptions(nats_url="nats://127.0.0.1:1", to_seq=9))
    unordered = next(s for s in sparkapp.app.handlers.values() if s.order_by is None)
    jobs.check_range(unordered, read)


async def test_the_refusal_beside_a_spark_job_says_a_killed_one_holds_it_for_its_lease(
    database_url: str, engine: AsyncEngine
) -> None:
    """Another Spark job's member row holds the handler: the one line asks to wait for it,
    and says that a job that was killed (which nobody can stop any more) holds it only
    until its lease lapses, with how long that is."""
    async with engine.begin() as conn:
        await conn.execute(
            sa.text(
                "INSERT INTO eop.members (subscription, member, host, pid, expires_at) "
                "VALUES (:s, :m, 'vm', 9, now() + interval '1 h')"
            ),
            {"s": HANDLER, "m": f"vm:9:{lease.SPARK_MARK}x"},
        )
    app = sparkapp.app.with_settings(database_url=database_url)
    try:
        with pytest.raises(errors.ConfigurationError) as caught:
            await asyncio.to_thread(fleet.check_idle, app, SPEC)
    finally:
        await app.dispose()
    said = str(caught.value)
    assert "a Spark job started on vm runs it" in said
    assert f"until its lease lapses, partition_lease_s: {app.settings.partition_lease_s:g} s" in (
        said
    )
