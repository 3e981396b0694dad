"""Ordered handlers on a fleet: per-key order across workers, handovers and partitions.

Each test's handler is a per-account state machine: it reads the account's
last applied step ``FOR UPDATE`` and records whether the step it applies is
the next one, so an inversion or a gap is counted in the database itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import nats
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

import eop
from eop.pg import models
from eop.runtime.worker import Worker

from .bed import bed_settings, drained, running, wait_for

STREAM = "LEDGER"

LEDGER_DDL = (
    "CREATE TABLE accounts (account text PRIMARY KEY, step int NOT NULL)",
    "CREATE TABLE applied (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " account text NOT NULL, step int NOT NULL, in_order boolean NOT NULL)",
)


async def create_ledger(engine: AsyncEngine, accounts: int) -> None:
    """The accounts (at step 0) and the applied-steps table."""
    async with engine.begin() as conn:
        for ddl in LEDGER_DDL:
            await conn.execute(sa.text(ddl))
        for i in range(accounts):
            await conn.execute(sa.text("INSERT INTO accounts VALUES (:a, 0)"), {"a": f"acc{i}"})


async def apply_step(session: AsyncSession, account: str, step: int) -> None:
    """The state machine: apply ``step`` to ``account``, recording whether it was next."""
    last = (
        await session.execute(
            sa.text("SELECT step FROM accounts WHERE account = :a FOR UPDATE"), {"a": account}
        )
    ).scalar_one()
    await session.execute(
        sa.text("INSERT INTO applied (account, step, in_order) VALUES (:a, :s, :ok)"),
        {"a": account, "s": step, "ok": step == last + 1},
    )
    await session.execute(
        sa.text("UPDATE accounts SET step = :s WHERE account = :a"), {"a": account, "s": step}
    )


def ledger_app(
    database_url: str, nats_url: str, partitions: int, *, delay_s: float = 0.002, **changes: Any
) -> eop.App:
    """An app with one ordered ledger handler on ``ledger.<account>.step`` (each step
    taking ``delay_s`` of I/O)."""
    settings = bed_settings(database_url, nats_url, **{"concurrency": 32, **changes})
    app = eop.App(settings=settings)
    app.stream(STREAM, subjects=["ledger.>"])

    @app.handler(
        stream=STREAM,
        subject="ledger.*.step",
        name="ledger",
        order_by="subject:1",
        partitions=partitions,
    )
    async def ledger(msg: eop.Message, session: AsyncSession) -> None:
        await asyncio.sleep(delay_s)
        await apply_step(session, msg.subject.split(".")[1], int(msg.data))

    return app


async def publish_burst(nats_url: str, accounts: int, steps: int, start: int = 1) -> None:
    """Steps ``start``.. ``start + steps - 1`` of every account, interleaved, in one burst."""
    import nats

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    acks = []
    for step in range(start, start + steps):
        for i in range(accounts):
            acks.append(js.publish(f"ledger.acc{i}.step", str(step).encode()))
    await asyncio.gather(*acks)
    await nc.close()


async def ledger_counts(engine: AsyncEngine) -> tuple[int, int, int]:
    """(steps applied, applied out of order, steps applied more than once)."""
    async with engine.connect() as conn:
        total, bad = (
            await conn.execute(
                sa.text("SELECT count(*), count(*) FILTER (WHERE NOT in_order) FROM applied")
            )
        ).one()
        twice = (
            await conn.execute(
                sa.text(
                    "SELECT count(*) FROM (SELECT 1 FROM applied GROUP BY account, step"
                    " HAVING count(*) > 1) d"
                )
            )
        ).scalar_one()
    return int(total), int(bad), int(twice)


@pytest.mark.parametrize("partitions", [1, 4])
async def test_two_workers_keep_each_key_in_order_and_share_the_partitions(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine, partitions: int
) -> None:
    """Two workers on one ordered handler (two pods): every account's steps applied once,
    in order; with 4 partitions both workers own some (each does useful work)."""
    accounts, steps = 8, 40
    await create_ledger(engine, accounts)
    first = ledger_app(database_url, nats_url, partitions)
    second = ledger_app(database_url, nats_url, partitions)
    async with running(first) as w1, running(second) as w2:
        runners = (w1._runners["ledger"], w2._runners["ledger"])
        if partitions > 1:
            # A joining worker takes its share within two ticks of the others'.
            await wait_for(
                lambda: _shared(runners, partitions), timeout_s=30, what="the partitions shared"
            )
        await publish_burst(nats_url, accounts, steps)
        await wait_for(lambda: _applied(engine, accounts * steps), timeout_s=60, what="every step")
        owned = (len(runners[0].owned), len(runners[1].owned))
    total, bad, twice = await ledger_counts(engine)
    assert (total, bad, twice) == (accounts * steps, 0, 0)
    assert sum(owned) == partitions
    if partitions > 1:
        assert min(owned) >= 1


async def test_a_worker_that_stops_hands_its_partitions_over_and_order_holds(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A worker stopped mid-burst gives its partitions up; the other takes them and goes
    on from the floor: no step lost, none twice, none out of order. The stop ended every
    run, so what the stopped worker's consumers delivered counts as no run of a crash
    loop: no handover range is recorded and no run counted."""
    accounts, steps = 6, 60
    await create_ledger(engine, accounts)
    # Slow steps: the stopping worker holds fetched steps its lanes never start.
    first = ledger_app(database_url, nats_url, 4, delay_s=0.02)
    second = ledger_app(database_url, nats_url, 4, delay_s=0.02)
    async with running(first) as w1:
        w2 = Worker(second)
        task = asyncio.create_task(w2.run())
        await w2.ready.wait()
        runners = (w1._runners["ledger"], w2._runners["ledger"])
        await wait_for(lambda: _shared(runners, 4), timeout_s=30, what="the partitions shared")
        await publish_burst(nats_url, accounts, steps)
        await wait_for(lambda: _applied(engine, 40), timeout_s=30, what="some steps")
        w2.stop()
        await asyncio.wait_for(task, 30)
        await wait_for(lambda: _applied(engine, accounts * steps), timeout_s=60, what="every step")
        assert len(w1._runners["ledger"].owned) == 4
        assert w2.cancelled == 0
    assert await ledger_counts(engine) == (accounts * steps, 0, 0)
    async with engine.connect() as conn:
        ranges = (await conn.execute(sa.text("SELECT count(*) FROM eop.handovers"))).scalar()
        runs = (await conn.execute(sa.text("SELECT count(*) FROM eop.retries"))).scalar()
    assert (ranges, runs) == (0, 0)


async def test_a_keys_messages_queued_behind_its_running_lane_are_bounded(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """One account's 200 steps on a worker of concurrency 8: the steps fetched while the
    key's lane runs wait behind it, their slots given back only up to the partition's
    lookahead, so the worker never has more than its slots and that lookahead unacked (it
    used to fetch the whole backlog into lanes, every one renewing its messages' leases),
    and every step applies once, in order."""
    steps, concurrency = 200, 8
    await create_ledger(engine, 1)
    app = ledger_app(database_url, nats_url, 1, concurrency=concurrency)
    unacked: list[int] = []
    async with running(app) as worker:
        runner = worker._runners["ledger"]
        await wait_for(lambda: _consumer_of(runner), what="the partition's consumer")
        consumer = runner.owned[0].consumer
        await publish_burst(nats_url, 1, steps)
        while not await _applied(engine, steps):
            unacked.append((await js.consumer_info(STREAM, consumer)).num_ack_pending)
            await asyncio.sleep(0.02)
        bound = concurrency + runner.lookahead
    assert await ledger_counts(engine) == (steps, 0, 0)
    assert len(unacked) > 5
    assert max(unacked) <= bound < steps, unacked


async def _consumer_of(runner: Any) -> bool:
    return 0 in runner.owned and runner.owned[0].consumer is not None


async def _shared(runners: Any, partitions: int) -> bool:
    owned = [len(r.owned) for r in runners]
    return sum(owned) == partitions and min(owned) >= 1


async def _owned_all(engine: AsyncEngine, partitions: int) -> bool:
    with contextlib.suppress(Exception):
        async with engine.connect() as conn:
            n = (
                await conn.execute(
                    sa.text("SELECT count(*) FROM eop.partitions WHERE consumer IS NOT NULL")
                )
            ).scalar_one()
        return int(n) == partitions
    return False


async def _applied(engine: AsyncEngine, count: int) -> bool:
    async with engine.connect() as conn:
        n = (await conn.execute(sa.text("SELECT count(*) FROM applied"))).scalar_one()
    return int(n) >= count


async def test_several_partitions_need_the_streams_transform(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A stream created without the partition transform is refused with the fix named."""
    await js.add_stream(name=STREAM, subjects=["ledger.>"])
    app = ledger_app(database_url, nats_url, 4)
    with pytest.raises(eop.ConfigurationError, match="subject transform to src"):
        async with running(app):
            pass


async def test_the_partition_count_cannot_change_under_a_handler(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Another partition count than the one the handler's rows were made with is refused:
    a key would move to another partition while its earlier messages wait in the old one."""
    await create_ledger(engine, 1)
    async with running(ledger_app(database_url, nats_url, 1)):
        pass
    with pytest.raises(eop.ConfigurationError, match="partitions"):
        async with running(ledger_app(database_url, nats_url, 2)):
            pass
    with contextlib.suppress(Exception):
        await drained(js, "eop-ledger", STREAM)


LEDGER_APP = "tests.integration.ledgerapp:app"


@pytest.mark.parametrize("partitions", [1, 4])
async def test_sigkilled_workers_of_a_fleet_keep_every_key_in_order(
    database_url: str,
    nats_url: str,
    js: Any,
    engine: AsyncEngine,
    tmp_path: Any,
    partitions: int,
) -> None:
    """Two `eop worker` commands, each SIGKILLed twice while it holds keys' messages and
    started again, bursts arriving meanwhile: every step of every account applied once and
    in order (the reported single-worker SIGKILL case applied steps 142-180 after 292)."""
    import random
    import signal

    from .test_cli import Workers, eop_env

    accounts, steps = 10, 60
    await create_ledger(engine, accounts)
    env = eop_env(
        database_url,
        nats_url,
        EOP_PARTITION_LEASE_S="3",
        EOP_CONCURRENCY="32",
        LEDGER_PARTITIONS=str(partitions),
    )
    pool = Workers(env, tmp_path, app=LEDGER_APP)
    rng = random.Random(20261128)
    live = [pool.start(), pool.start()]
    try:
        await wait_for(lambda: _owned_all(engine, partitions), what="every partition owned")
        for burst in range(4):
            await publish_burst(nats_url, accounts, steps // 4, start=burst * steps // 4 + 1)
            await asyncio.sleep(rng.uniform(0.2, 0.8))
            victim = live.pop(rng.randrange(len(live)))
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            live.append(pool.start())
        await wait_for(lambda: _applied(engine, accounts * steps), timeout_s=240, what="every step")
    finally:
        pool.stop_all()
    assert await ledger_counts(engine) == (accounts * steps, 0, 0)
    assert [proc.returncode for proc in live] == [0, 0]


async def test_a_process_frozen_in_the_middle_of_its_tick_does_not_keep_its_partitions(
    engine: AsyncEngine,
) -> None:
    """A tick holds its partitions' rows locked until it commits: a process frozen in the
    middle of one (SIGSTOP) would keep anyone from taking them for as long as it stays
    frozen. The tick's idle-in-transaction timeout ends its transaction on the server."""
    from eop.ordering import ownership
    from eop.ordering import sql as ownership_sql

    tables = models.tables("eop")
    member = ownership.Member(name="b", host="h", pid=2)
    other = ownership.Ownership(engine, tables, "frozen", 2, member, lease_s=1.0)
    await other.prepare()
    frozen = await engine.connect()
    try:
        await frozen.begin()
        await frozen.execute(ownership_sql.tick_timeouts(2000, 5000, 300))
        await frozen.execute(ownership_sql.acquire(tables, "frozen", "a", "h", 1, 60.0, 2))
        await asyncio.sleep(1.0)  # frozen: no COMMIT, no statement
        tick = await other.tick(2, [])
    finally:
        with contextlib.suppress(Exception):
            await frozen.close()
    assert set(tick.owned) == {0, 1}


async def test_a_partition_given_up_goes_to_a_live_member_before_a_killed_ones_lease_runs_out(
    engine: AsyncEngine,
) -> None:
    """A member ranked first that stopped ticking (killed, frozen) keeps its membership row
    until its lease runs out. A partition given up meanwhile (another member's stop) went
    to nobody for that long: every live member's share left it to the dead one. Members
    are ranked only while they renew, so a live one takes it half a lease after the dead
    one's last tick, while the dead one's own partition stays leased to it."""
    from eop.ordering import ownership
    from eop.ordering.share import share

    tables = models.tables("eop")
    lease_s = 6.0
    a, b, c = (
        ownership.Ownership(
            engine, tables, "ranked", 3, ownership.Member(name=n, host="h", pid=i), lease_s
        )
        for i, n in enumerate("abc")
    )
    await a.prepare()
    for member in (a, b, c):
        await member.tick(1, [])
    await c.leave([2])  # c stops cleanly; a is killed (it never ticks again)

    async def b_ticks() -> ownership.Tick:
        members = (await b.tick(0, [])).members
        return await b.tick(share(members, "b", 3), [])

    # a ticked just now: it is still ranked first, and the remainder is its.
    early = await b_ticks()
    assert early.members == ("a", "b")
    assert set(early.owned) == {1}
    await asyncio.sleep(lease_s * ownership.CURRENT_LEASE_LEFT + 0.2)
    late = await b_ticks()
    assert late.members == ("b",)
    assert set(late.owned) == {1, 2}, "the given-up partition waits for a dead member's lease"
    async with engine.connect() as conn:
        owner = await conn.execute(
            sa.text(
                "SELECT owner FROM eop.partitions WHERE subscription = 'ranked' AND partition = 0"
            )
        )
        assert owner.scalar_one() == "a", "a live lease was taken"


async def test_a_message_that_kills_every_owner_is_dead_lettered_as_a_crash_loop(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine, tmp_path: Any
) -> None:
    """A message that kills every process it runs in hands its partition over each time,
    and each new owner's consumer counts its deliveries from 1 again. The earlier owners'
    deliveries are counted all the same: after ``max_deliveries`` it is dead-lettered as a
    crash loop, and its key's later steps and the other keys go on, in order."""
    from .test_cli import Workers, eop_env

    await create_ledger(engine, 2)
    env = eop_env(
        database_url,
        nats_url,
        EOP_PARTITION_LEASE_S="2",
        EOP_MAX_DELIVERIES="3",
        LEDGER_PARTITIONS="1",
    )
    pool = Workers(env, tmp_path, app=LEDGER_APP)
    live = [pool.start(), pool.start()]
    nc = await nats.connect(nats_url)
    try:
        await wait_for(lambda: _owned_all(engine, 1), what="the partition owned")
        pub = nc.jetstream()
        for step in range(1, 6):
            await pub.publish("ledger.acc0.step", str(step).encode())
        await pub.publish("ledger.acc0.step", b"kill")
        for step in range(6, 11):
            await pub.publish("ledger.acc0.step", str(step).encode())
        for step in range(1, 11):
            await pub.publish("ledger.acc1.step", str(step).encode())

        async def settled() -> bool:
            # A killed worker is started again, as Kubernetes would.
            for index, proc in enumerate(live):
                if proc.poll() is not None:
                    live[index] = pool.start()
            return await _applied(engine, 20)

        await wait_for(settled, timeout_s=180, what="every step, past the killing message")
    finally:
        await nc.close()
        pool.stop_all()
    assert await ledger_counts(engine) == (20, 0, 0)
    async with engine.connect() as conn:
        reasons = (await conn.execute(sa.text("SELECT reason FROM eop.dead_letters"))).all()
    assert [r[0] for r in reasons] == ["crash_loop"]


async def test_two_ordered_handlers_in_one_process_drain_a_burst_at_default_concurrency(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Two ordered handlers of four partitions each share one process's slots at the
    default concurrency; a burst keeps keys' messages queued behind their running lanes,
    whose slots are given back and borrowed again all the time. No partition's fetch
    loop may end while its lease is renewed: every step is applied, once and in order
    (a new user's run stalled at 709 and 1005 of 1,200 for good)."""
    accounts, steps = 30, 40
    await create_ledger(engine, accounts)
    app = ledger_app(database_url, nats_url, 4, concurrency=eop.Settings().concurrency)

    @app.handler(
        stream=STREAM,
        subject="ledger.*.step",
        name="ledger_copy",
        order_by="subject:1",
        partitions=4,
    )
    async def copy(msg: eop.Message, session: AsyncSession) -> None:
        await asyncio.sleep(0.001)

    async with running(app):
        await publish_burst(nats_url, accounts, steps)
        for name in ("eop-ledger", "eop-ledger_copy"):
            await wait_for(
                lambda name=name: drained(js, name, STREAM),
                timeout_s=120,
                what=f"{name}'s partitions drained",
            )
    assert await ledger_counts(engine) == (accounts * steps, 0, 0)
