"""The outbox as operators run it: `eop relay`, `eop outbox ...`, and the relay through outages."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import create_async_engine

import eop
from eop.pg import migrate
from eop.tools import embedded

from .bed import equals, error_lines, wait_for
from .test_cli import ROOT, eop_env
from .test_cli import eop as run_eop
from .test_outbox import OUT_STREAM, OUT_SUBJECT, make_app, out_count, outbox_rows, relaying


def start_relay(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`eop relay` in a process of its own, its output in ``log``."""
    return subprocess.Popen(
        [sys.executable, "-m", "eop", "relay"],
        env=env,
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


async def _metric(port: int, line: str) -> bool:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())

    try:
        return line in (await asyncio.to_thread(get)).splitlines()
    except OSError:
        return False


async def test_eop_relay_publishes_and_stops_on_sigterm_with_status_0(
    database_url: str, nats_url: str, js: Any, tmp_path: Path
) -> None:
    """`eop relay` (settings from the environment only) publishes committed rows, serves its
    metrics, gives up its lease on SIGTERM and exits 0; `eop outbox status` shows the
    backlog before and after."""
    await js.add_stream(name=OUT_STREAM, subjects=["SHIPMENTS.>"])
    app = make_app(database_url, nats_url)
    async with app.sessionmaker() as session, session.begin():
        for i in range(25):
            eop.outbox.add(session, OUT_SUBJECT, f"r{i}")
    port = embedded.free_port()
    env = eop_env(database_url, nats_url, EOP_METRICS_PORT=str(port))
    before = run_eop("outbox", "status", "--json", env=env)
    assert before.returncode == 0, before.stderr
    backlog = json.loads(before.stdout)
    assert backlog["pending"] == 25
    assert backlog["relay"] is None
    assert backlog["oldest_s"] >= 0
    proc = start_relay(env, tmp_path / "relay.log")
    try:
        await wait_for(lambda: equals(out_count(js), 25), timeout_s=60, what="25 published")
        await wait_for(lambda: equals(outbox_rows(app.engine, "published_at IS NULL"), 0))
        during = json.loads(run_eop("outbox", "status", "--json", env=env).stdout)
        assert during["pending"] == 0
        assert during["relay"] is not None
        await wait_for(lambda: _metric(port, "eop_outbox_published_total 25.0"), what="metrics")
        await wait_for(lambda: _metric(port, "eop_outbox_pending 0.0"), what="backlog gauge")
    finally:
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=60)
    log = (tmp_path / "relay.log").read_text()
    assert status == 0, log
    assert '"event": "relay.leading"' in log
    assert '"event": "relay.stopped"' in log
    after = json.loads(run_eop("outbox", "status", "--json", env=env).stdout)
    assert after["relay"] is None  # the lease was given up, not left to expire
    await app.dispose()


async def test_outbox_commands_list_retry_and_purge_parked_rows(
    database_url: str, nats_url: str, js: Any
) -> None:
    """`eop outbox list` shows parked rows with their reason (never the payload); `retry`
    queues one again, which is then published, and names (exit 1) IDs that are not
    parked; `purge --yes` deletes the other."""
    await js.add_stream(name=OUT_STREAM, subjects=["SHIPMENTS.>"])
    app = make_app(database_url, nats_url, outbox_max_attempts=1)
    async with app.sessionmaker() as session, session.begin():
        eop.outbox.add(session, "LATER.a", b"secret-payload-1")
        eop.outbox.add(session, "LATER.b", b"secret-payload-2")
    async with relaying(app, nats_url):
        await wait_for(lambda: equals(outbox_rows(app.engine, "parked_at IS NOT NULL"), 2), 60)
    env = eop_env(database_url, nats_url)
    listing = run_eop("outbox", "list", env=env)
    assert listing.returncode == 0, listing.stderr
    assert "parked (no_stream)" in listing.stdout
    assert "no stream holds subject LATER.a" in listing.stdout
    assert "secret-payload" not in listing.stdout
    rows = json.loads(run_eop("outbox", "list", "--json", env=env).stdout)
    ids = {row["subject"]: row["id"] for row in rows}
    assert set(ids) == {"LATER.a", "LATER.b"}
    refused = run_eop("outbox", "retry", env=env)
    assert refused.returncode == 2
    assert error_lines(refused.stderr) == [
        "eop: error: name the parked rows to retry (IDs) or pass --all"
    ]
    await js.add_stream(name="LATER", subjects=["LATER.>"])
    retried = run_eop("outbox", "retry", str(ids["LATER.a"]), env=env)
    assert retried.stdout.strip() == "queued 1 parked row again"
    assert retried.returncode == 0
    not_parked = run_eop("outbox", "retry", str(ids["LATER.a"]), "999999", env=env)
    assert not_parked.returncode == 1
    queued = ids["LATER.a"]  # pending again, so not parked any more
    assert f"not parked (published, pending or no such row): {queued}, 999999" in (
        not_parked.stderr
    )
    purged = run_eop("outbox", "purge", "--all", "--yes", env=env)
    assert purged.stdout.strip() == "purged 1 parked row"
    async with relaying(app, nats_url):
        await wait_for(lambda: equals(out_count(js, "LATER"), 1), what="the retried row")
    assert await outbox_rows(app.engine) == 1
    await app.dispose()


async def test_the_relay_rides_out_nats_and_postgres_restarts_without_loss_or_parking(
    make_postgres_server: Any, nats_server: embedded.NatsServer, js: Any
) -> None:
    """Rows added while NATS, then PostgreSQL, are down are all published once both are
    back: an outage is retried, never counted against a row, and nothing is parked."""
    pg = make_postgres_server()
    migrate.upgrade(pg.url)
    await js.add_stream(name=OUT_STREAM, subjects=["SHIPMENTS.>"], duplicate_window=600)
    app = make_app(pg.url, nats_server.url, outbox_max_attempts=1, publish_timeout_s=1.0)
    writer = create_async_engine(pg.url, pool_pre_ping=True)

    async def add(prefix: str, n: int) -> None:
        async with writer.begin() as conn:
            from sqlalchemy.ext.asyncio import AsyncSession

            async with AsyncSession(bind=conn) as session:
                for i in range(n):
                    eop.outbox.add(session, OUT_SUBJECT, f"{prefix}{i}")
                await session.flush()
                await session.commit()

    async with relaying(app, nats_server.url) as relay:
        await add("before", 10)
        await wait_for(lambda: equals(out_count(js), 10), what="first rows")
        await asyncio.to_thread(nats_server.stop)
        await add("nats-down", 10)
        await asyncio.sleep(2)
        await asyncio.to_thread(nats_server.start)
        await wait_for(lambda: equals(_count_on(nats_server), 20), 60, "rows after NATS")
        await asyncio.to_thread(pg.stop)
        await asyncio.sleep(2)
        await asyncio.to_thread(pg.start)
        await add("pg-back", 10)
        await wait_for(lambda: equals(_count_on(nats_server), 30), 60, "rows after PG")
        await wait_for(lambda: equals(outbox_rows(app.engine, "published_at IS NULL"), 0), 60)
        assert relay.parked == 0
    assert await outbox_rows(app.engine, "parked_at IS NOT NULL") == 0
    await writer.dispose()
    await app.dispose()


async def _count_on(server: embedded.NatsServer) -> int:
    import nats

    nc = await nats.connect(server.url)
    try:
        return await out_count(nc.jetstream())
    finally:
        await nc.close()
