"""Spark Connect failures: a server that dies under a stream, a client that dies under one.

The server's death ends the command within about ``--connect-retry-s`` in one
line naming the server; a client's death leaves its query on the server,
which stops at its next transaction once the client's lease ran out
(:mod:`eop.contrib.spark.lease`). Either way the next run continues from the checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.integration.bed import STREAM, create_effects_table, effects_by_body, publish, wait_for

from . import sparkapp
from .connect_server import ConnectServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
HANDLER = "spark_sync"
RETRY_S = 5.0
LEASE_S = 3.0
#: A stall guard, not a timing: the bound the command documents is RETRY_S and a call.
EXIT_WITHIN_S = 120.0


@pytest.fixture
async def bed_engine(engine: AsyncEngine) -> AsyncEngine:
    """The test database with an effects table."""
    await create_effects_table(engine)
    return engine


def stream_command(
    url: str, database_url: str, nats_url: str, checkpoint: Path, *more: str
) -> list[str]:
    """`eop spark stream` of the sync handler on the Connect server at ``url``."""
    args = [sys.executable, "-m", "eop", "--log-level", "error", "spark", "stream"]
    args += [sparkapp.PATH, "--handler", HANDLER, "--remote", url]
    args += ["--database-url", database_url, "--nats-url", nats_url]
    args += ["--checkpoint", str(checkpoint), "--connect-retry-s", str(RETRY_S)]
    return [*args, *more]


def start(command: list[str], err: Path) -> subprocess.Popen[bytes]:
    """The command in a process of its own, its stderr in ``err``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), EOP_PARTITION_LEASE_S=str(LEASE_S))
    with err.open("wb") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=out)


async def finished(command: list[str], tmp_path: Path) -> tuple[int, str]:
    """Run the command to its end: its status and stderr."""
    err = tmp_path / "rerun.err"
    process = start(command, err)
    status = await asyncio.to_thread(process.wait, EXIT_WITHIN_S * 2)
    return status, err.read_text()


@pytest.mark.timeout(600)  # a server of its own, two runs of the command
async def test_a_stream_whose_connect_server_dies_ends_in_one_line_and_resumes_elsewhere(
    connect_server: ConnectServer,
    database_url: str,
    nats_url: str,
    js: Any,
    bed_engine: AsyncEngine,
    tmp_path: Path,
) -> None:
    """SIGKILL the Connect server under `eop spark stream`: the command ends within its
    retry bound with status 1 and one `eop: error:` line naming the server (no thread's
    traceback); run again on another server, the checkpoint's stream goes on and every
    message is applied once."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    for i in range(1, 21):
        await publish(js, f"order-{i}")
    server = ConnectServer(tmp_path / "server")
    (tmp_path / "server").mkdir()
    server.start()
    checkpoint = tmp_path / "checkpoint"
    err = tmp_path / "stream.err"
    client = start(stream_command(server.url, database_url, nats_url, checkpoint), err)
    try:
        expected = {f"order-{i}": 1 for i in range(1, 21)}
        await wait_for(lambda: _equal(effects_by_body(bed_engine), expected), 180, "the stream")
        server.kill()
        killed_at = time.monotonic()
        try:
            status = await asyncio.to_thread(client.wait, EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the command still runs after its server died:\n{err.read_text()}")
        took_s = time.monotonic() - killed_at
    finally:
        if client.poll() is None:
            client.kill()
        server.stop()
    text = err.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    print(f"the client ended {took_s:.1f} s after the server's SIGKILL")
    assert status == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert lines[-1].startswith(
        f"eop: error: the Spark Connect server {server.url} does not answer"
    ), text[-3000:]
    assert "run the command again" in lines[-1]
    assert [line for line in lines if line.startswith("eop: error:")] == [lines[-1]]
    assert "RETRIES_EXCEEDED" not in text

    for i in range(21, 31):
        await publish(js, f"order-{i}")
    rerun = stream_command(connect_server.url, database_url, nats_url, checkpoint)
    status, text = await finished([*rerun, "--available-now"], tmp_path)
    assert status == 0, text[-3000:]
    assert await effects_by_body(bed_engine) == {f"order-{i}": 1 for i in range(1, 31)}


@pytest.mark.timeout(600)  # two runs of the command
async def test_a_stream_whose_client_died_stops_on_the_server_and_the_next_run_reports_it(
    connect_server: ConnectServer,
    database_url: str,
    nats_url: str,
    js: Any,
    bed_engine: AsyncEngine,
    tmp_path: Path,
) -> None:
    """SIGKILL `eop spark stream`'s client: its query runs on in the Connect server until its
    lease runs out, then its next transaction fails (JobLeaseLost) and the query stops.
    The next run on the checkpoint applies the rest, each message once."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    for i in range(1, 21):
        await publish(js, f"order-{i}")
    checkpoint = tmp_path / "checkpoint"
    err = tmp_path / "stream.err"
    command = stream_command(connect_server.url, database_url, nats_url, checkpoint)
    client = start([*command, "--trigger-s", "0.5"], err)
    try:
        expected = {f"order-{i}": 1 for i in range(1, 21)}
        await wait_for(lambda: _equal(effects_by_body(bed_engine), expected), 180, "the stream")
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait()
    # The orphan runs a micro-batch only for new messages: keep some coming until one of
    # its transactions finds the lease gone.
    seen = len(connect_server.daemon.text()) if connect_server.daemon else 0
    published = 20
    deadline = time.monotonic() + EXIT_WITHIN_S
    while not await _logged(connect_server, seen, "JobLeaseLost"):
        assert time.monotonic() < deadline, "the orphaned query never stopped"
        published += 1
        await publish(js, f"order-{published}")
        await asyncio.sleep(0.5)
    status, text = await finished([*command, "--available-now"], tmp_path)
    assert status == 0, text[-3000:]
    assert await effects_by_body(bed_engine) == {f"order-{i}": 1 for i in range(1, published + 1)}


async def _equal(found: Any, expected: object) -> bool:
    return bool(await found == expected)


async def _logged(server: ConnectServer, after: int, text: str) -> bool:
    return server.daemon is not None and text in server.daemon.text()[after:]
