"""The fault proxy against real servers: forwarding, black hole, reset, lost replies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import nats
import nats.errors
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from eop.pg import failures
from eop.tools import embedded
from eop.tools.chaos.proxy import FaultProxy


@pytest.fixture
async def pg_proxy(postgres: embedded.PostgresCluster) -> AsyncIterator[FaultProxy]:
    """A postgres-aware proxy in front of the session's PostgreSQL."""
    proxy = FaultProxy("127.0.0.1", postgres.port, protocol="postgres")
    await proxy.start()
    yield proxy
    await proxy.close()


@pytest.fixture
async def proxied_engine(database_url: str, pg_proxy: FaultProxy) -> AsyncIterator[AsyncEngine]:
    """An engine on the test's database, reaching it through the proxy."""
    url = sa.make_url(database_url).set(host="127.0.0.1", port=pg_proxy.port)
    engine = create_async_engine(url, poolclass=NullPool)
    yield engine
    await engine.dispose()


async def test_queries_pass_through_with_added_latency(
    proxied_engine: AsyncEngine, pg_proxy: FaultProxy
) -> None:
    """With latency set, every byte still arrives, in order."""
    pg_proxy.set_latency(0.01)
    async with proxied_engine.connect() as conn:
        rows = (await conn.execute(sa.text("SELECT generate_series(1, 2000)"))).all()
    assert [r[0] for r in rows] == list(range(1, 2001))


async def test_blackhole_holds_traffic_until_healed(
    proxied_engine: AsyncEngine, pg_proxy: FaultProxy
) -> None:
    """A black hole holds bytes without losing them: the query completes once healed."""
    async with proxied_engine.connect() as conn:
        pg_proxy.blackhole(True)
        query = asyncio.ensure_future(conn.execute(sa.text("SELECT 42")))
        done, _ = await asyncio.wait({query}, timeout=0.3)
        assert not done
        pg_proxy.heal()
        assert (await query).scalar() == 42


async def test_reset_cuts_open_connections_only(
    proxied_engine: AsyncEngine, pg_proxy: FaultProxy
) -> None:
    """After a reset the old connection fails as a lost connection; a new one works."""
    async with proxied_engine.connect() as conn:
        await conn.execute(sa.text("SELECT 1"))
        assert pg_proxy.reset() == 1
        with pytest.raises(Exception) as caught:  # noqa: PT011  # classified below
            await conn.execute(sa.text("SELECT 1"))
        assert failures.classify(caught.value) is failures.DbFailure.CONNECTION
    async with proxied_engine.connect() as conn:
        assert (await conn.execute(sa.text("SELECT 1"))).scalar() == 1


async def test_dropped_commit_reply_commits_but_the_client_never_learns_it(
    proxied_engine: AsyncEngine, engine: AsyncEngine, pg_proxy: FaultProxy
) -> None:
    """The reply to COMMIT is lost and the connection cut: an ambiguous commit that committed."""
    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE t (x int)"))
    conn = await proxied_engine.connect()
    await conn.execute(sa.text("INSERT INTO t VALUES (1)"))
    pg_proxy.drop_next_reply()
    with pytest.raises(Exception) as caught:  # noqa: PT011  # classified below
        await conn.commit()
    assert failures.classify(caught.value) is failures.DbFailure.CONNECTION
    await conn.invalidate()
    assert pg_proxy.stats["dropped_commit_replies"] == 1
    async with engine.connect() as direct:
        assert (await direct.execute(sa.text("SELECT count(*) FROM t"))).scalar() == 1


async def test_dropped_ack_reply_times_the_ack_out_though_the_server_has_it(
    nats_server: embedded.NatsServer, js: Any
) -> None:
    """The ack reaches the server, its reply vanishes: `ack_sync` times out, nothing is pending."""
    proxy = FaultProxy("127.0.0.1", nats_server.port, protocol="nats")
    await proxy.start()
    nc = await nats.connect(f"nats://127.0.0.1:{proxy.port}")
    try:
        await js.add_stream(name="P", subjects=["p.x"])
        await js.publish("p.x", b"hello")
        sub = await nc.jetstream().pull_subscribe("p.x", durable="d", stream="P")
        (msg,) = await sub.fetch(1, timeout=5)
        proxy.drop_next_reply()
        with pytest.raises(nats.errors.TimeoutError):
            await msg.ack_sync(timeout=0.5)
        assert proxy.stats["dropped_ack_replies"] == 1
        info = await js.consumer_info("P", "d")
        assert info.num_ack_pending == 0
        assert info.ack_floor.stream_seq == 1
    finally:
        await nc.close()
        await proxy.close()
