"""The examples run as the README says they do."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from eop.tools import embedded
from examples.quickstart import app as quickstart

from .bed import bed_settings, drained, equals, running, scalar, wait_for
from .test_cli import ROOT, eop_env

EXAMPLE_TESTS = Path(quickstart.__file__).parent / "test_handlers.py"


async def test_quickstart_bills_and_audits_every_order_once(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The quickstart's async and sync handlers each write one row per order."""
    app = quickstart.app.with_settings(**vars(bed_settings(database_url, nats_url)))
    async with engine.begin() as conn:
        await conn.run_sync(quickstart.Base.metadata.create_all)
    async with running(app):
        await quickstart.publish(10, nats_url)
        await quickstart.publish(10, nats_url)  # the same Msg-Ids again: dropped by the server
        await wait_for(lambda: drained(js, "eop-billing"), what="billing")
        await wait_for(lambda: drained(js, "eop-audit"), what="audit")
    assert await scalar(engine, "SELECT count(DISTINCT order_id) FROM invoices") == 10
    assert await scalar(engine, "SELECT count(*) FROM invoices") == 10
    assert await scalar(engine, "SELECT count(*) FROM audit_entries") == 10


async def test_outbox_example_ships_every_order_posted_to_the_endpoint_once(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """The outbox example: orders posted to its FastAPI endpoint are announced through the
    outbox, reserved by one handler, which requests the shipment through the outbox, and
    shipped by the other: one reservation and one shipment per order; a repeated POST is
    a 409 and announces nothing more."""
    import httpx

    from examples.outbox import app as example
    from examples.outbox import web

    app = example.app.with_settings(**vars(bed_settings(database_url, nats_url)))
    async with engine.begin() as conn:
        await conn.run_sync(example.Base.metadata.create_all)
    api = web.make_api(app)
    async with running(app):
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://orders") as client:
            for i in range(20):
                response = await client.post("/orders", json={"id": f"o-{i}", "total_cents": i})
                assert response.status_code == 201
            again = await client.post("/orders", json={"id": "o-3", "total_cents": 3})
            assert again.status_code == 409
        await wait_for(
            lambda: equals(scalar(engine, "SELECT count(*) FROM shipments"), 20),
            what="20 shipments",
        )
        await wait_for(lambda: drained(js, "eop-reserve"), what="reserve")
        await wait_for(lambda: drained(js, "eop-ship", stream="SHIPMENTS"), what="ship")
    assert await scalar(engine, "SELECT count(DISTINCT order_id) FROM reservations") == 20
    assert await scalar(engine, "SELECT count(*) FROM reservations") == 20
    assert await scalar(engine, "SELECT count(DISTINCT order_id) FROM shipments") == 20
    assert await scalar(engine, "SELECT count(*) FROM shipments") == 20
    assert await scalar(engine, "SELECT count(*) FROM eop.outbox WHERE published_at IS NULL") == 0


def test_the_quickstart_handler_tests_pass_as_a_user_runs_them(
    pytester: pytest.Pytester, postgres: embedded.PostgresCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/quickstart/test_handlers.py, run by pytest in a fresh process outside the
    repository (eop's pytest plugin loaded from its entry point, no conftest): every test
    passes, in memory and on the plugin's database."""
    monkeypatch.setenv("EOP_TEST_DATABASE_URL", postgres.url)
    pytester.makepyfile(test_handlers=EXAMPLE_TESTS.read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=4)


def serve(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    """uvicorn serving the outbox example's endpoint with its in-process worker."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "uvicorn", "examples.outbox.web:api_with_worker"),
                *(
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                    "--timeout-graceful-shutdown",
                    "10",
                ),
            ],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def output(log: Path) -> str:
    """What the servers printed (their worker's log lines among it)."""
    return log.read_text(errors="replace")


async def serving(proc: subprocess.Popen[bytes], client: Any, log: Path) -> bool:
    """True once the server answers (after its lifespan started the worker)."""
    if proc.poll() is not None:
        raise AssertionError(f"uvicorn exited with {proc.returncode}:\n{output(log)[-3000:]}")
    try:
        return (await client.get("/openapi.json")).status_code == 200
    except Exception:
        return False


async def post_orders(client: Any, prefix: str, count: int, after: asyncio.Event) -> list[str]:
    """POST ``count`` orders one after another until the server goes; the ids it took."""
    taken = []
    for i in range(count):
        try:
            response = await client.post(
                "/orders", json={"id": f"{prefix}-{i}", "total_cents": i}, timeout=10
            )
        except Exception:
            break  # the server is stopping: the rest were never sent
        if response.status_code != 201:
            break
        taken.append(f"{prefix}-{i}")
        if i == count // 3:
            after.set()
    after.set()
    return taken


async def test_outbox_example_under_uvicorn_with_its_worker_in_the_lifespan_survives_sigterm(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine, tmp_path: Path
) -> None:
    """uvicorn serving the example with eop.Worker in its lifespan, SIGTERMed while orders
    stream in: it exits 0 in bounded time (no stall), and once served again every stored
    order has exactly one reservation and one shipment, every accepted order is stored,
    nothing is dead-lettered and nothing is left unpublished."""
    import httpx

    from examples.outbox import app as example

    async with engine.begin() as conn:
        await conn.run_sync(example.Base.metadata.create_all)
    env = eop_env(database_url, nats_url, EOP_SHUTDOWN_GRACE_S="10")
    log = tmp_path / "uvicorn.log"
    port = embedded.free_port()
    base = f"http://127.0.0.1:{port}"
    first = serve(env, port, log)
    try:
        async with httpx.AsyncClient(base_url=base) as client:
            await wait_for(lambda: serving(first, client, log), timeout_s=60, what="uvicorn")
            midway = asyncio.Event()
            posting = asyncio.create_task(post_orders(client, "o", 300, midway))
            await midway.wait()
            first.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(first.wait, 60)
            taken = await posting
        # uvicorn ends by raising the signal it caught again, once it has shut down.
        assert code in (0, -signal.SIGTERM), output(log)[-3000:]
        assert output(log).count("worker.stopped") == 1
        assert taken
        second = serve(env, port, log)
        async with httpx.AsyncClient(base_url=base) as client:
            await wait_for(lambda: serving(second, client, log), timeout_s=60, what="uvicorn again")
            stored = await scalar(engine, "SELECT count(*) FROM orders")
            await wait_for(
                lambda: equals(scalar(engine, "SELECT count(*) FROM shipments"), stored),
                timeout_s=60,
                what=f"{stored} shipments",
            )
            await wait_for(lambda: drained(js, "eop-reserve"), what="reserve")
            await wait_for(lambda: drained(js, "eop-ship", stream="SHIPMENTS"), what="ship")
        second.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(second.wait, 60) in (0, -signal.SIGTERM)
        assert output(log).count("worker.stopped") == 2
    finally:
        for proc in (first, locals().get("second")):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert stored >= len(taken)
    ids = "SELECT count(*) FROM orders WHERE id = ANY(:ids)"
    assert await scalar(engine, ids, ids=taken) == len(taken)
    for table in ("reservations", "shipments"):
        assert await scalar(engine, f"SELECT count(*) FROM {table}") == stored
        assert await scalar(engine, f"SELECT count(DISTINCT order_id) FROM {table}") == stored
    assert await scalar(engine, "SELECT count(*) FROM eop.dead_letters") == 0
    assert await scalar(engine, "SELECT count(*) FROM eop.outbox WHERE published_at IS NULL") == 0
