"""Nothing of a payload in a worker's log, a dead letter's error text or the CLI's output.

Canary values in payloads make the driver or PostgreSQL refuse a handler's
statement (asyncpg's encoder, a too-long varchar, a NUL byte, a unique key
whose DETAIL quotes it, bytes that are not UTF-8), in the three handler styles.
The real `eop worker` runs as a subprocess (json and console logs, at debug
level); afterwards the CLI reads what it left. The canaries must be in the dead
letters' payload column and nowhere else, and only the refused messages may be
dead-lettered, each once, while the good ones are applied once each.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from .bed import drained, scalar, wait_for
from .canaryapp import SINK_DDL, STREAM, STYLES
from .test_cli import ROOT, eop_env
from .test_cli import eop as run_eop

APP = "tests.integration.canaryapp:app"
#: How each kind of poison is refused (asyncpg's encoder, or PostgreSQL for both drivers).
BAD_KINDS = ("int", "long", "text", "key", "bytes")
GOOD_PER_STYLE = 3
MAX_ATTEMPTS = 2


def _canaries(log_format: str) -> dict[tuple[str, str], str]:
    # Short: asyncpg cuts the value it quotes at 40 characters.
    return {
        (style, kind): f"cnry{log_format[0]}{style[:2]}{kind}{secrets.token_hex(4)}"
        for style in STYLES
        for kind in BAD_KINDS
    }


def _body(kind: str, canary: str) -> bytes:
    if kind == "text":
        return f"text:{canary}\x00".encode()  # PostgreSQL text cannot hold NUL
    if kind == "bytes":
        return f"text:{canary}".encode() + b"\xff\xfe"  # not UTF-8: the handler's decode fails
    return f"{kind}:{canary}".encode()


def _start_worker(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """`eop worker`, its stdout and stderr both into ``log_path``."""
    return subprocess.Popen(
        [sys.executable, "-m", "eop", "worker", APP],
        env=env,
        cwd=ROOT,
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
    )


async def _consumers_exist(js: Any) -> bool:
    try:
        for style in STYLES:
            await js.consumer_info(STREAM, f"eop-{style}")
    except Exception:
        return False
    return True


async def _settled(js: Any, engine: AsyncEngine, dead: int, good: int) -> bool:
    if int(await scalar(engine, "SELECT count(*) FROM eop.dead_letters")) < dead:
        return False
    if int(await scalar(engine, "SELECT count(*) FROM sink WHERE s LIKE 'good-%'")) < good:
        return False
    for style in STYLES:
        if not await drained(js, f"eop-{style}", STREAM, engine=engine):
            return False
    return True


def _assert_no_canary(where: str, text: str, canaries: dict[tuple[str, str], str]) -> None:
    for key, canary in canaries.items():
        assert canary not in text, f"{key} canary {canary!r} in {where}"


@pytest.mark.parametrize("log_format", ["json", "console"])
async def test_payload_values_refused_by_the_database_appear_only_in_the_dead_letters_payload(
    database_url: str,
    nats_url: str,
    js: Any,
    engine: AsyncEngine,
    tmp_path: Path,
    log_format: str,
) -> None:
    """Every style and kind of refusal: no canary in any worker log line, dead-letter
    error or traceback, or output of eop dlq list/show (text and --json), eop status and
    eop audit (nor the database password); each
    canary in exactly one dead letter's payload; no good message dead-lettered or applied
    twice."""
    canaries = _canaries(log_format)
    # A password in the URL too (the bed's PostgreSQL trusts any): shown nowhere either.
    shown_never = dict(canaries)
    url = sa.make_url(database_url)
    if url.password is None:
        shown_never[("credential", "password")] = f"pw-{secrets.token_hex(6)}"
        url = url.set(password=shown_never[("credential", "password")])
        database_url = url.render_as_string(hide_password=False)
    async with engine.begin() as conn:
        await conn.execute(sa.text(SINK_DDL))
        for (style, kind), canary in canaries.items():
            if kind == "key":  # the key the message will repeat: its DETAIL quotes it
                await conn.execute(
                    sa.text("INSERT INTO sink (handler, msg_key, u) VALUES ('seed', :k, :u)"),
                    {"k": f"seed-{style}", "u": canary},
                )
    env = {
        **eop_env(database_url, nats_url, EOP_LOG_LEVEL="debug"),
        "EOP_LOG_FORMAT": log_format,
        "EOP_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
    }
    log_path = tmp_path / "worker.log"
    worker = _start_worker(env, log_path)
    try:
        await wait_for(lambda: _consumers_exist(js), timeout_s=60, what="the consumers")
        for style in STYLES:
            # Good and bad neighbours in one fetched batch.
            for i, kind in enumerate(BAD_KINDS):
                await js.publish(f"{STREAM}.{style}", _body(kind, canaries[(style, kind)]))
                if i < GOOD_PER_STYLE:
                    await js.publish(f"{STREAM}.{style}", f"ok:good-{style}-{i}".encode())
        await wait_for(
            lambda: _settled(js, engine, len(canaries), GOOD_PER_STYLE * len(STYLES)),
            timeout_s=120,
            what="every message settled",
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=90) == 0

    logs = log_path.read_text(errors="replace")
    _assert_no_canary("the worker's log", logs, shown_never)
    assert "Traceback" not in logs
    # The lines that carried the values before: the failures were logged, scrubbed.
    assert "message.retry" in logs
    assert "message.dead_lettered" in logs
    assert "query argument $" in logs  # asyncpg's encoder refusal, value masked
    assert "unique constraint" in logs
    if log_format == "json":
        for line in logs.splitlines():
            json.loads(line)

    async with engine.connect() as conn:
        dead = (
            await conn.execute(
                sa.text(
                    "SELECT id, subscription, reason, payload, error, traceback"
                    " FROM eop.dead_letters ORDER BY id"
                )
            )
        ).all()
        good = dict(
            (
                await conn.execute(
                    sa.text("SELECT s, count(*) FROM sink WHERE s LIKE 'good-%' GROUP BY s")
                )
            ).all()
        )
    # Only the refused messages, each once, each for its handler's own failure.
    assert len(dead) == len(canaries)
    assert good == {f"good-{s}-{i}": 1 for s in STYLES for i in range(GOOD_PER_STYLE)}
    held = {}
    for row in dead:
        assert row.reason == "attempts_exhausted", row
        assert row.error
        assert row.traceback
        _assert_no_canary(
            f"dead letter {row.id}'s error and traceback", row.error + row.traceback, shown_never
        )
        [key] = [k for k, c in canaries.items() if c.encode() in bytes(row.payload)]
        assert key[0] == row.subscription
        held[key] = row.id
    assert sorted(held) == sorted(canaries)

    outputs = [
        run_eop("dlq", "list", env=env),
        run_eop("dlq", "list", "--json", env=env),
        run_eop("status", APP, env=env),
        run_eop("audit", APP, env=env),
        run_eop("dlq", "show", "--json", str(held[("orm", "int")]), env=env),
        # One dead letter of each kind (each style in turn): a CLI run costs a second or two.
        *(
            run_eop("dlq", "show", str(held[(STYLES[i % len(STYLES)], kind)]), env=env)
            for i, kind in enumerate(BAD_KINDS)
        ),
    ]
    for result in outputs:
        where = " ".join(str(a) for a in result.args[3:])
        assert "Traceback" not in result.stderr, where
        _assert_no_canary(f"`eop {where}`", result.stdout + result.stderr, shown_never)
    listed = json.loads(outputs[1].stdout)
    assert len(listed) == len(canaries)
    assert all(outputs[i].returncode == 0 for i in (0, 1, 2)), outputs[:3]
