"""`eop dlq` and `eop status` as a user runs them, against `eop worker` subprocesses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from nats.js import api
from sqlalchemy.ext.asyncio import AsyncEngine

import eop
from eop.ops import status
from eop.pg import models
from eop.tools import embedded

from .bed import (
    STREAM,
    SUBJECT,
    bed_settings,
    create_effects_table,
    drained,
    effects_by_body,
    wait_for,
)
from .test_cli import ROOT, consumer_exists, eop_env
from .test_cli import eop as run_eop

APP = "tests.integration.dlqapp:app"


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "eop", "worker", APP],
        env=env,
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


def eop_bytes(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    """Run `eop ARGS`, its output as bytes."""
    return subprocess.run(
        [sys.executable, "-m", "eop", *args], env=env, cwd=ROOT, capture_output=True, check=True
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


async def test_dlq_commands_list_show_replay_once_and_purge(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine, tmp_path: Path
) -> None:
    """A poison message dead-lettered by a worker: listed, shown, replayed once into a healed
    worker (a second replay says it was already done), then purged."""
    await create_effects_table(engine)
    env = eop_env(database_url, nats_url, EOP_APP=APP)
    worker = start_worker(env, tmp_path / "sick.log")
    try:
        await wait_for(lambda: consumer_exists(js, "eop-billing"), what="the consumer")
        await js.publish(SUBJECT, b"ok")
        await js.publish(SUBJECT, b"poison-1", headers={"Authorization": "Bearer s3cr3t"})
        await wait_for(lambda: drained(js, "eop-billing"), what="the dead letter")
    finally:
        stop(worker)

    listed = run_eop("dlq", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert (row["subscription"], row["reason"], row["stream_seq"]) == ("billing", "rejected", 2)
    assert row["payload_size"] == len(b"poison-1")
    dl = str(row["id"])
    table = run_eop("dlq", "list", "--handler", "billing", "--reason", "BILLABLE", env=env)
    assert "rejected" in table.stdout
    assert "poison is not billable" in table.stdout
    nothing = run_eop("dlq", "list", "--since", "1h", "--reason", "no such reason", env=env)
    assert nothing.stdout.count("\n") == 1  # the header line only
    shown = run_eop("dlq", "show", dl, env=env)
    assert '"Authorization": "***"' in shown.stdout
    assert "s3cr3t" not in shown.stdout
    assert "poison-1" not in shown.stdout  # the payload only on request
    payload = eop_bytes("dlq", "show", dl, "--payload", env=env)
    assert payload.stdout == b"poison-1"

    healed = start_worker({**env, "DLQAPP_HEAL": "1"}, tmp_path / "healed.log")
    try:
        first = run_eop("dlq", "replay", dl, env=env)
        assert first.returncode == 0, first.stderr
        assert "published" in first.stdout
        await wait_for(lambda: drained(js, "eop-billing"), what="the replay")
        second = run_eop("dlq", "replay", "--all", "--handler", "billing", env=env)
        assert second.returncode == 0, second.stderr
        assert "skipped" in second.stdout
        assert "already replayed" in second.stdout
        await wait_for(lambda: drained(js, "eop-billing"), what="nothing more")
    finally:
        stop(healed)
    assert await effects_by_body(engine) == {"ok": 1, "poison-1": 1}
    logs = (tmp_path / "sick.log").read_text() + (tmp_path / "healed.log").read_text()
    assert "s3cr3t" not in logs
    assert "poison-1" not in logs

    refused = run_eop("dlq", "purge", "--all", env=env)
    assert refused.returncode == 1
    assert "--yes" in refused.stderr
    assert run_eop("dlq", "purge", env=env).returncode == 2  # no filter, no --all: a usage error
    purged = run_eop("dlq", "purge", "--handler", "billing", "--yes", env=env)
    assert purged.stdout.strip() == "purged 1 dead letter"
    missing = run_eop("dlq", "show", dl, env=env)
    assert missing.returncode == 1
    assert "no dead letter" in missing.stderr


async def test_a_dlq_list_cut_by_its_limit_says_so_in_json_too(
    database_url: str, nats_url: str, engine: AsyncEngine
) -> None:
    """Three dead letters, `--limit 2`: the table and the JSON list both hold two, and
    both say on stderr that they show 2 of 3 (a script counting the JSON is told);
    `--limit 0` lists all."""
    dead_letters = models.tables().dead_letters
    async with engine.begin() as conn:
        await conn.execute(
            dead_letters.insert(),
            [
                {
                    "subscription": "billing",
                    "stream": STREAM,
                    "stream_epoch": "e",
                    "stream_seq": seq,
                    "fingerprint": b"f",
                    "subject": SUBJECT,
                    "headers": {},
                    "payload": b"x",
                    "reason": "rejected",
                    "error": "no",
                    "delivery_count": 1,
                }
                for seq in (1, 2, 3)
            ],
        )
    env = eop_env(database_url, nats_url, EOP_APP=APP)
    for form in ((), ("--json",)):
        cut = run_eop("dlq", "list", "--limit", "2", *form, env=env)
        assert cut.returncode == 0, cut.stderr
        assert "(2 of 3 shown; --limit N shows more" in cut.stderr
    assert len(json.loads(cut.stdout)) == 2
    every = run_eop("dlq", "list", "--limit", "0", "--json", env=env)
    assert len(json.loads(every.stdout)) == 3
    assert "shown" not in every.stderr


async def test_status_reports_lag_window_redeliveries_inbox_and_dead_letters(
    database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """A consumer whose ack-pending window is full is flagged; counts come from NATS and the DB."""
    app = eop.App(settings=bed_settings(database_url, nats_url))

    @app.handler(stream=STREAM, subject=SUBJECT, name="billing")
    async def bill(msg: eop.Message, session: Any) -> None:
        pass

    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    await js.add_consumer(
        STREAM,
        api.ConsumerConfig(
            durable_name="eop-billing",
            ack_policy=api.AckPolicy.EXPLICIT,
            max_ack_pending=2,
            filter_subject=SUBJECT,
        ),
    )
    for i in range(5):
        await js.publish(SUBJECT, f"m{i}".encode())
    # A stuck worker: it holds two deliveries and acks neither.
    psub = await js.pull_subscribe_bind(durable="eop-billing", stream=STREAM)
    held = await psub.fetch(5, timeout=2)
    assert len(held) == 2
    try:
        [s] = await status.collect(app)
    finally:
        await app.dispose()
    assert (s.handler, s.stream, s.consumer) == ("billing", STREAM, "eop-billing")
    assert (s.ack_pending, s.max_ack_pending, s.num_pending) == (2, 2, 3)
    assert (s.inbox_rows, s.dead_letters, s.watermark) == (0, 0, 0)
    assert s.problems == []
    assert any("window full" in w for w in s.warnings)
    table = status.format_table([s])
    assert "2/2 FULL" in table
    assert "WARNING: ack-pending window full" in table


async def test_status_cli_json_and_clear_errors_for_missing_consumer_and_schema(
    database_url: str, empty_database_url: str, nats_url: str, js: Any, engine: AsyncEngine
) -> None:
    """`eop status --json` for scripts; a missing stream or an unmigrated schema is a clear
    message and exit 1, never a traceback."""
    env = eop_env(database_url, nats_url)
    missing = run_eop("status", APP, env=env)
    assert missing.returncode == 1
    assert "stream 'ORDERS' does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    no_consumer = run_eop("status", APP, "--json", env=env)
    assert no_consumer.returncode == 1
    assert "consumer 'eop-billing' does not exist" in no_consumer.stderr
    assert json.loads(no_consumer.stdout)[0]["problems"]
    await js.add_consumer(
        STREAM,
        api.ConsumerConfig(
            durable_name="eop-billing",
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=float(env["EOP_ACK_WAIT_S"]),
            filter_subject=SUBJECT,
        ),
    )
    await js.publish(SUBJECT, b"waiting")
    ok = run_eop("status", APP, "--json", "--handler", "billing", env=env)
    assert ok.returncode == 0, ok.stderr
    [row] = json.loads(ok.stdout)
    assert (row["num_pending"], row["ack_pending"], row["max_ack_pending"]) == (1, 0, 1000)
    assert row["warnings"] == []
    assert row["ack_wait_s"] == float(env["EOP_ACK_WAIT_S"])
    unmigrated = run_eop("status", APP, env=eop_env(empty_database_url, nats_url))
    assert unmigrated.returncode == 1
    assert "eop db upgrade" in unmigrated.stderr
    unknown = run_eop("status", APP, "--handler", "nope", env=env)
    assert unknown.returncode == 1
    assert "unknown handler" in unknown.stderr


def test_status_with_nats_unreachable_still_shows_what_postgresql_holds(
    database_url: str,
) -> None:
    """NATS down: `eop status` is what an operator runs then. It exits 1 with NATS named
    as each handler's problem (the password redacted), and still shows the inbox, the
    retries and the dead letters from PostgreSQL, never a traceback."""
    url = f"nats://u:hunter2@127.0.0.1:{embedded.free_port()}"
    shown = run_eop("status", APP, "--json", env=eop_env(database_url, url))
    assert shown.returncode == 1, shown.stderr
    assert "Traceback" not in shown.stderr
    assert "hunter2" not in shown.stderr + shown.stdout
    # The refused connection's tries are no warnings of their own: the problem says it.
    assert "nats.error" not in shown.stderr
    rows = json.loads(shown.stdout)
    assert rows
    for row in rows:
        assert any("NATS is unreachable" in p for p in row["problems"]), row
        assert row["num_pending"] is None
        assert (row["dead_letters"], row["retrying"]) == (0, 0)


@pytest.mark.parametrize(
    "command",
    [("list",), ("show", "1"), ("replay", "1"), ("purge", "--all", "--yes")],
    ids=["list", "show", "replay", "purge"],
)
def test_dlq_commands_on_an_unmigrated_schema_say_to_upgrade(
    empty_database_url: str, nats_url: str, command: tuple[str, ...]
) -> None:
    """Every `eop dlq` command on a database without eop's tables: one line, exit 1."""
    result = run_eop("dlq", *command, "--app", APP, env=eop_env(empty_database_url, nats_url))
    assert result.returncode == 1
    assert "run `eop db upgrade`" in result.stderr
    assert "Traceback" not in result.stderr
