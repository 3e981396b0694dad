"""The embedded servers behave as the chaos tests will need them to."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import nats
import pytest
import sqlalchemy as sa
from nats.js.api import AckPolicy, ConsumerConfig, StorageType
from sqlalchemy.ext.asyncio import create_async_engine

from eop.pg import models

from .bed import insert_inbox

if TYPE_CHECKING:
    from collections.abc import Callable

    from nats.js import JetStreamContext
    from sqlalchemy.ext.asyncio import AsyncEngine

    from eop.tools import embedded


async def publish_three_ack_one(js: JetStreamContext) -> None:
    await js.add_stream(name="KEEP", subjects=["keep.>"], storage=StorageType.FILE)
    for n in range(3):
        await js.publish("keep.x", f"m{n}".encode())
    config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT)
    psub = await js.pull_subscribe("keep.>", durable="d", stream="KEEP", config=config)
    [msg] = await psub.fetch(1, timeout=2)
    await msg.ack_sync()


async def read_state(url: str) -> tuple[int, int, int]:
    """Messages in the stream, the consumer's ack floor and its pending count."""
    nc = await nats.connect(url, connect_timeout=2)
    try:
        js = nc.jetstream()
        stream = await js.stream_info("KEEP")
        consumer = await js.consumer_info("KEEP", "d")
        assert consumer.ack_floor is not None
        return stream.state.messages, consumer.ack_floor.stream_seq, consumer.num_pending
    finally:
        await nc.close()


async def test_nats_restart_keeps_file_stream_messages_and_ack_floor(
    nats_server: embedded.NatsServer, js: JetStreamContext
) -> None:
    """A clean restart on the same port and store keeps streams, messages and ack floors."""
    await publish_three_ack_one(js)
    port = nats_server.port
    nats_server.restart()
    assert nats_server.port == port
    assert await read_state(nats_server.url) == (3, 1, 2)


async def test_nats_kill_keeps_messages_but_may_forget_a_confirmed_ack(
    nats_server: embedded.NatsServer,
    js: JetStreamContext,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGKILL stops the server at once; a start on the same store recovers every message.

    The consumer's state is written lazily: an ack confirmed by ack_sync just
    before the kill is usually forgotten (that message is delivered again),
    which is why the inbox, not the ack, carries exactly-once.
    """
    await publish_three_ack_one(js)
    nats_server.kill()
    assert nats_server.pid is None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", nats_server.port), timeout=1).close()
    nats_server.start()
    messages, ack_floor, _ = await read_state(nats_server.url)
    assert messages == 3
    assert ack_floor in (0, 1)
    with capsys.disabled():
        print(f"\n[nats kill] ack floor after SIGKILL + start: {ack_floor} (1 before the kill)")


def test_nats_server_url_and_cleanup() -> None:
    """The URL names the free port chosen; close() stops the server and removes its temp store."""
    from eop.tools.embedded import NatsServer

    with NatsServer() as server:
        assert server.url == f"nats://127.0.0.1:{server.port}"
        store = server.store_dir
        assert server.pid is not None
    assert server.pid is None
    assert not store.exists()


async def count_rows(url: str) -> int:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return int((await conn.execute(sa.text("SELECT count(*) FROM kept"))).scalar_one())
    finally:
        await engine.dispose()


async def test_postgres_restart_and_kill_keep_committed_data(
    make_postgres_server: Callable[..., embedded.PostgresServer],
) -> None:
    """Committed rows survive a fast restart and a SIGKILL of the whole server (fsync off)."""
    server = make_postgres_server()
    url = server.create_database("keep")
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE kept (n int)"))
        await conn.execute(sa.text("INSERT INTO kept VALUES (1), (2)"))
    await engine.dispose()
    server.restart()
    assert await count_rows(url) == 2
    server.kill()
    assert server.pid is None
    server.start()
    assert await count_rows(url) == 2


async def test_postgres_terminate_backends_drops_open_sessions(
    postgres: embedded.PostgresCluster, engine: AsyncEngine
) -> None:
    """terminate_backends ends other sessions of a database; a pool then reconnects by itself."""
    async with engine.connect() as conn:
        await conn.execute(sa.text("SELECT 1"))
        database = engine.url.database
        assert database is not None
        assert postgres.terminate_backends(database) >= 1
        with pytest.raises(sa.exc.DBAPIError):
            await conn.execute(sa.text("SELECT 1"))
    async with engine.connect() as conn:
        assert (await conn.execute(sa.text("SELECT 1"))).scalar_one() == 1


@pytest.mark.parametrize("run", [1, 2])
async def test_each_test_gets_its_own_migrated_database(engine: AsyncEngine, run: int) -> None:
    """Every test starts from an empty, migrated clone: rows of an earlier test are not there."""
    inbox = models.tables("eop").inbox
    async with engine.begin() as conn:
        assert (await conn.execute(sa.select(sa.func.count()).select_from(inbox))).scalar() == 0
        await insert_inbox(
            conn,
            [
                dict(
                    subscription="s", stream="S", stream_epoch="e", stream_seq=1,
                    fingerprint=b"f", outcome="processed", delivery_count=run,
                )
            ],
        )  # fmt: skip


ORPHAN = """
import os, signal
from eop.tools.embedded import NatsServer
server = NatsServer()
server.start()
print(server.pid, server.store_dir.parent, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no finalizer, no atexit: the server is orphaned
"""


def test_servers_orphaned_by_a_killed_run_are_reaped_by_the_next() -> None:
    """A run SIGKILLed before cleanup leaves its server behind; the next server started stops it."""
    import subprocess
    import sys

    from eop import scratch_owners
    from eop.tools.embedded import NatsServer

    result = subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True)
    pid_text, scratch_text = result.stdout.split()
    orphan_pid, scratch = int(pid_text), Path(scratch_text)
    assert scratch_owners.alive(orphan_pid)
    assert scratch.exists()
    with NatsServer():
        assert not scratch_owners.alive(orphan_pid)
        assert not scratch.exists()


async def probe_exports(exports: dict[str, str]) -> str:
    """Use both servers of ``exports``; PostgreSQL's data directory."""
    nc = await nats.connect(exports["EOP_NATS_URL"], connect_timeout=5)
    await nc.jetstream().account_info()
    await nc.close()
    engine = create_async_engine(exports["EOP_DATABASE_URL"])
    async with engine.connect() as conn:
        data_dir = (await conn.execute(sa.text("SHOW data_directory"))).scalar_one()
    await engine.dispose()
    return str(data_dir)


def test_python_m_embedded_serves_both_until_sigterm() -> None:
    """``python -m eop.tools.embedded`` prints working EOP_* exports; SIGTERM stops both
    servers and removes their data (exit 0)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "eop.tools.embedded"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert child.stdout is not None
        lines = [child.stdout.readline() for _ in range(2)]
        exports = dict(line.removeprefix("export ").strip().split("=", 1) for line in lines)
        data_dir = Path(asyncio.run(probe_exports(exports)))
        assert data_dir.exists()
        child.send_signal(signal.SIGTERM)
        assert child.wait(60) == 0
        assert not data_dir.exists()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
