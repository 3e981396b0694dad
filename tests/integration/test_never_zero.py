"""Never zero times: infrastructure failures never dead-letter a good message.

A message is dead-lettered only when its handler rejected it, failed on its
own ``max_attempts`` times, or it cannot be decoded. Outages, read-only
windows, lock and statement timeouts, deadlocks and poison neighbours must
not consume its attempts, nor keep it waiting behind them.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import eop
from eop.pg import migrate
from eop.tools import embedded

from .bed import (
    STREAM,
    SUBJECT,
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


async def dead_letters(engine: AsyncEngine) -> int:
    return int(await scalar(engine, "SELECT count(*) FROM eop.dead_letters"))


async def test_postgres_outage_longer_than_every_attempt_dead_letters_nothing(
    make_postgres_server: Callable[..., embedded.PostgresServer], nats_url: str, js: Any
) -> None:
    """PostgreSQL down for many times backoff_max_s x max_attempts: every message of an
    async and a sync handler takes effect once after it is back, none is dead-lettered."""
    server = make_postgres_server()
    url = server.create_database("outage")
    migrate.upgrade(url)
    engine = create_async_engine(url, pool_pre_ping=True)
    await create_effects_table(engine)
    app = eop.App(settings=bed_settings(url, nats_url, max_attempts=2, backoff_max_s=0.3))

    @app.handler(stream=STREAM, subject=SUBJECT, name="async_orm")
    async def on_async(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, "async_orm", msg)

    @app.handler(stream=STREAM, subject=SUBJECT, name="sync")
    def on_sync(msg: eop.Message, session: Session) -> None:
        session.execute(
            sa.text("INSERT INTO effects (handler, msg_key, body) VALUES ('sync', :k, :b)"),
            {"k": msg.idempotency_key, "b": msg.data.decode()},
        )

    try:
        async with running(app):
            for i in range(40):
                await publish(js, f"before-{i}")
            server.stop()
            for i in range(40):
                await publish(js, f"during-{i}")
            # 20 times backoff_max_s x max_attempts, while messages keep arriving.
            await asyncio.sleep(12)
            server.start()
            for name in ("eop-async_orm", "eop-sync"):
                await wait_for(
                    lambda name=name: drained(js, name, engine=engine),
                    timeout_s=60,
                    what=f"{name} to catch up after the outage",
                )
        rows = await engine.connect()
        try:
            counts = (
                await rows.execute(
                    sa.text("SELECT handler, body, count(*) FROM effects GROUP BY handler, body")
                )
            ).all()
        finally:
            await rows.close()
        bodies = [f"before-{i}" for i in range(40)] + [f"during-{i}" for i in range(40)]
        expected = {(h, b): 1 for h in ("async_orm", "sync") for b in bodies}
        assert {(h, b): int(n) for h, b, n in counts} == expected
        assert await dead_letters(engine) == 0
    finally:
        await engine.dispose()


async def test_read_only_window_dead_letters_nothing(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The database refusing writes (25006) for a while is waited out, not counted."""
    await create_effects_table(engine)
    database = engine.url.database
    app = eop.App(settings=bed_settings(database_url, nats_url, max_attempts=2))

    @app.handler(stream=STREAM, subject=SUBJECT, name="writer")
    async def writer(msg: eop.Message, session: AsyncSession) -> None:
        await record_effect(session, "writer", msg)

    async def set_read_only(on: bool) -> None:
        async with engine.connect() as conn:
            # First in its transaction: this session may start read-only itself.
            await conn.execute(sa.text("SET TRANSACTION READ WRITE"))
            await conn.execute(
                sa.text(f'ALTER DATABASE "{database}" SET default_transaction_read_only = {on}')
            )
            await conn.commit()
            # Sessions read the setting when they start: end the worker's.
            await conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            )
            await conn.commit()
        await engine.dispose()  # this test's own pooled sessions were ended too

    async with running(app):
        await publish(js, "warm-up")
        await wait_for(lambda: drained(js, "eop-writer", engine=engine), what="the warm-up")
        await set_read_only(True)
        try:
            for i in range(30):
                await publish(js, f"m{i}")
            await asyncio.sleep(4)
        finally:
            await set_read_only(False)
        await wait_for(
            lambda: drained(js, "eop-writer", engine=engine), timeout_s=60, what="the backlog"
        )
    assert await effects_by_body(engine) == {"warm-up": 1, **{f"m{i}": 1 for i in range(30)}}
    assert await dead_letters(engine) == 0


async def test_lock_and_statement_timeouts_in_handlers_are_retried_not_counted(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A hot row held locked far longer than lock_timeout_s and statement_timeout_s:
    the handlers' 55P03 and 57014 never count as attempts; all take effect once."""
    await create_effects_table(engine)
    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE hot (id int PRIMARY KEY, n int NOT NULL)"))
        await conn.execute(sa.text("INSERT INTO hot VALUES (1, 0), (2, 0)"))
    settings = bed_settings(
        database_url, nats_url, max_attempts=2, lock_timeout_s=0.2, backoff_max_s=0.3
    )
    app = eop.App(settings=settings)

    @app.handler(stream=STREAM, subject=SUBJECT, name="lock_timeout")
    async def on_lock(msg: eop.Message, session: AsyncSession) -> None:
        await session.execute(sa.text("UPDATE hot SET n = n + 1 WHERE id = 1"))
        await record_effect(session, "lock_timeout", msg)

    slow = app.with_settings(lock_timeout_s=30.0, statement_timeout_s=0.2)

    @slow.handler(stream=STREAM, subject=SUBJECT, name="statement_timeout")
    async def on_statement(msg: eop.Message, session: AsyncSession) -> None:
        await session.execute(sa.text("UPDATE hot SET n = n + 1 WHERE id = 2"))
        await record_effect(session, "statement_timeout", msg)

    async with engine.connect() as holder:
        await holder.execute(sa.text("SELECT * FROM hot FOR UPDATE"))
        async with (
            running(app, handlers=["lock_timeout"]),
            running(slow, handlers=["statement_timeout"]),
        ):
            for i in range(20):
                await publish(js, f"m{i}")
            await asyncio.sleep(3)  # many times both timeouts, and max_attempts
            await holder.rollback()
            for name in ("eop-lock_timeout", "eop-statement_timeout"):
                await wait_for(
                    lambda name=name: drained(js, name, engine=engine),
                    timeout_s=60,
                    what=f"{name} after the lock is released",
                )
    assert await scalar(engine, "SELECT n FROM hot WHERE id = 1") == 20
    assert await scalar(engine, "SELECT n FROM hot WHERE id = 2") == 20
    assert await dead_letters(engine) == 0


async def test_random_order_transfers_drain_without_dead_letters(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """Debit/credit between four accounts in random order (deadlocks between batches),
    two workers of concurrency 32: every transfer applies once, the total is kept."""
    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE accounts (id int PRIMARY KEY, balance int)"))
        await conn.execute(
            sa.text("INSERT INTO accounts SELECT g, 1000 FROM generate_series(1, 4) g")
        )
        await conn.execute(sa.text("CREATE TABLE transfers (id text PRIMARY KEY)"))
    app = eop.App(settings=bed_settings(database_url, nats_url, concurrency=32, batch=16))

    @app.handler(stream=STREAM, subject=SUBJECT, name="transfer")
    async def transfer(msg: eop.Message, session: AsyncSession) -> None:
        body = msg.json()
        for account, delta in ((body["from"], -body["amount"]), (body["to"], body["amount"])):
            await session.execute(
                sa.text("UPDATE accounts SET balance = balance + :d WHERE id = :a"),
                {"d": delta, "a": account},
            )
        await session.execute(sa.text("INSERT INTO transfers VALUES (:id)"), {"id": body["id"]})

    rng = random.Random(20261124)
    count = 600
    async with running(app), running(app):
        for i in range(count):
            source, target = rng.sample(range(1, 5), 2)
            data = (
                f'{{"id": "t{i}", "from": {source}, "to": {target}, "amount": {rng.randint(1, 9)}}}'
            )
            await js.publish(SUBJECT, data.encode())
        await wait_for(
            lambda: drained(js, "eop-transfer", engine=engine), timeout_s=120, what="transfers"
        )
    assert await scalar(engine, "SELECT count(*) FROM transfers") == count
    assert await scalar(engine, "SELECT sum(balance) FROM accounts") == 4000
    assert await dead_letters(engine) == 0


async def test_poison_flood_does_not_starve_good_messages(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """More failing messages than MaxAckPending, ahead of good ones: their retries wait in
    the database, so the good ones are all processed before any poison message could be
    exhausted (its backoff alone takes longer), and each poison message then gets exactly
    max_attempts runs and one dead letter."""
    await create_effects_table(engine)
    settings = bed_settings(
        database_url,
        nats_url,
        max_attempts=3,
        max_ack_pending=100,
        backoff_base_s=4.0,
        backoff_max_s=8.0,
        concurrency=32,
        batch=32,
    )
    app = eop.App(settings=settings)
    runs: dict[str, int] = {}

    @app.handler(stream=STREAM, subject=SUBJECT, name="flood")
    async def flood(msg: eop.Message, session: AsyncSession) -> None:
        body = msg.data.decode()
        if body.startswith("poison"):
            runs[body] = runs.get(body, 0) + 1
            raise ValueError("always fails")
        await record_effect(session, "flood", msg)

    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    for i in range(300):
        await publish(js, f"poison-{i}")
    for i in range(100):
        await publish(js, f"good-{i}")

    async def good_done() -> bool:
        return await scalar(engine, "SELECT count(*) FROM effects") == 100

    async with running(app):
        await wait_for(good_done, timeout_s=60, what="the good messages")
        # The first poison message can be exhausted only after 4 + 8 s of backoff.
        assert await dead_letters(engine) == 0
        await wait_for(
            lambda: drained(js, "eop-flood", engine=engine), timeout_s=120, what="the poison"
        )
    assert await dead_letters(engine) == 300
    reasons = await scalar(engine, "SELECT array_agg(DISTINCT reason) FROM eop.dead_letters")
    assert reasons == ["attempts_exhausted"]
    # Three failures each; a first delivery in a batch runs twice (the batch's
    # savepoint-less pass, then its own savepoint), and both count as one failure.
    assert set(runs.values()) <= {3, 4}
    assert await effects_by_body(engine) == {f"good-{i}": 1 for i in range(100)}


async def test_a_message_that_kills_its_worker_dead_letters_nothing_but_itself(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine, tmp_path: Any
) -> None:
    """A message that kills every process it runs in, fetched in one batch with good
    ones: each death sends the whole batch back. A neighbour is counted one run at most
    (its first redelivery, run beside the killer's), then runs alone: only the killer is
    dead-lettered as a crash loop (counting deliveries, 23 of 29 good messages were, at
    max_deliveries=3), the others take effect once."""
    from .test_cli import Workers, eop_env

    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE done (b text PRIMARY KEY)"))
    env = eop_env(database_url, nats_url, EOP_MAX_DELIVERIES="3")
    pool = Workers(env, tmp_path, app="tests.integration.killerapp:app")
    live = [pool.start(), pool.start()]

    async def bound() -> bool:
        try:
            await js.consumer_info("KILL", "eop-killer")
        except Exception:
            return False
        return True

    async def settled() -> bool:
        # A killed worker is started again, as Kubernetes would.
        for index, proc in enumerate(live):
            if proc.poll() is not None:
                live[index] = pool.start()
        done = await scalar(engine, "SELECT count(*) FROM done")
        return int(done) + await dead_letters(engine) >= 30

    try:
        await wait_for(bound, timeout_s=60, what="the workers bound")
        for i in range(30):
            await js.publish("kill.x", b"kill" if i == 10 else f"m{i}".encode())
        await wait_for(settled, timeout_s=180, what="every message settled")
    finally:
        pool.stop_all()
    assert await scalar(engine, "SELECT count(*) FROM done") == 29
    reasons = await scalar(engine, "SELECT string_agg(reason, ',') FROM eop.dead_letters")
    assert reasons == "crash_loop"
