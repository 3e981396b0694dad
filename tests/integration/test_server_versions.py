"""What eop asks of the nats-server it runs on: a minimum version, and streams that keep
what they acknowledge (docs/servers.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

import eop
from eop.broker import server
from eop.ops import status
from eop.tools import embedded

from .bed import bed_settings, error_lines
from .test_cli import eop as run_eop
from .test_cli import eop_env

APP = "tests.integration.dlqapp:app"


def _version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    found = re.search(r"v(\d+)\.(\d+)\.(\d+)", out.stdout)
    return tuple(int(part) for part in found.groups()) if found else ()


def _old_nats_server() -> str:
    """A nats-server older than eop's minimum: $EOP_TEST_OLD_NATS_SERVER, else one on PATH
    or in /usr/sbin (Debian's package is 2.9), else the test is skipped."""
    candidates = [os.environ.get("EOP_TEST_OLD_NATS_SERVER"), shutil.which("nats-server")]
    candidates.append("/usr/sbin/nats-server")
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            version = _version(candidate)
            if version and version[:2] < server.MINIMUM:
                return candidate
    pytest.skip("no nats-server older than 2.10 here (set EOP_TEST_OLD_NATS_SERVER)")


def test_a_nats_server_older_than_the_minimum_is_refused_in_one_line(database_url: str) -> None:
    """nats-server 2.9 drops a stream's metadata and subject transforms without a word:
    every command refuses it at connect, in one `eop: error:` line naming its version,
    where it is and the version to upgrade to, before creating anything."""
    binary = _old_nats_server()
    shown = server.shown(_version(binary))
    with embedded.NatsServer(binary=binary) as old:
        env = eop_env(database_url, old.url)
        for command in (("status", APP), ("worker", APP)):
            refused = run_eop(*command, env=env)
            assert refused.returncode != 0, refused.stdout
            lines = [line for line in refused.stderr.splitlines() if line.strip()]
            # A worker logs its start first (JSON lines); the refusal is the last line.
            assert error_lines(lines[-1])[0].startswith(f"eop: error: nats-server {shown} at "), (
                refused.stderr
            )
            assert "eop needs nats-server 2.10 or newer" in error_lines(lines[-1])[0]
            assert "Traceback" not in refused.stderr
        assert not any(old.store_dir.glob("jetstream/*/streams/*")), "a stream was created"


async def create_stream(nc: NATS, config: dict[str, Any]) -> None:
    """Create a stream raw, as an operator's `nats stream add` would."""
    reply = await nc.request(f"$JS.API.STREAM.CREATE.{config['name']}", json.dumps(config).encode())
    assert "error" not in json.loads(reply.data), reply.data


async def test_status_warns_about_a_stream_that_acknowledges_before_the_disk(
    database_url: str, nats_url: str, nc: NATS
) -> None:
    """persist_mode async (nats-server 2.12+) sends the PubAck before the message is on disk:
    `eop status` warns that a nats-server crash can lose acknowledged messages, and says
    the mode cannot be edited away; memory storage gets its own warning; a default file
    stream none."""
    if (server.version_of(nc) or (0, 0))[:2] < server.PERSIST_MODE:
        pytest.skip("persist_mode needs nats-server 2.12 or newer")

    async def warnings(name: str, persist_mode: str | None, storage: str) -> list[str]:
        """`eop status`'s warnings for a handler on a stream of its own, which eop never
        creates."""
        config: dict[str, Any] = {"name": name, "subjects": [f"{name}.>"], "storage": storage}
        if persist_mode is not None:
            config["persist_mode"] = persist_mode
        await create_stream(nc, config)
        app = eop.App(settings=bed_settings(database_url, nats_url))

        @app.handler(stream=name, subject=f"{name}.created", name="billing")
        async def bill(msg: eop.Message, session: Any) -> None:
            pass

        try:
            [s] = await status.collect(app)
            if s.warnings:
                assert f"billing: {s.warnings[0]}" in status.format_table([s])
            return s.warnings
        finally:
            await app.dispose()
            await nc.request(f"$JS.API.STREAM.DELETE.{name}", b"")

    # Deleting an account's last file stream removes the account's streams directory behind
    # the reply, and a stream created meanwhile fails with "error creating store for stream":
    # a stream kept to the end keeps that directory.
    await create_stream(nc, {"name": "KEEP", "subjects": ["KEEP.>"], "storage": "file"})
    [warning] = [w for w in await warnings("ASYNC", "async", "file") if "persist_mode" in w]
    assert "can lose messages" in warning
    assert "cannot change it on a stream: recreate the stream" in warning
    in_memory = await warnings("MEMORY", None, "memory")
    assert any("keeps its messages in memory" in w for w in in_memory), in_memory
    assert await warnings("FILE", None, "file") == []
