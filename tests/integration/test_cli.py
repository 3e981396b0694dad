"""`eop` as a user runs it: subprocesses, signals, unreachable and restarted servers."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from eop.pg import migrate
from eop.tools import embedded

from .bed import (
    create_effects_table,
    drained,
    effects_by_body,
    equals,
    error_lines,
    publish,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.integration.cliapp:app"


def eop_env(database_url: str, nats_url: str, **extra: str) -> dict[str, str]:
    """The environment of an `eop` subprocess: its servers and short timings."""
    env = dict(os.environ)
    env.update(
        EOP_DATABASE_URL=database_url,
        EOP_NATS_URL=nats_url,
        EOP_LOG_FORMAT="json",
        EOP_ACK_WAIT_S="4",
        EOP_LEASE_MARGIN_S="0.5",
        EOP_BACKOFF_BASE_S="0.1",
        EOP_BACKOFF_MAX_S="1",
        EOP_FETCH_TIMEOUT_S="0.3",
        # One process unless asked: the tests read its output and signal it by PID.
        EOP_PROCESSES="1",
    )
    env.update(extra)
    return env


def eop(*args: str, env: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `eop ARGS` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "eop", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


class Workers:
    """`eop worker` subprocesses, stopped (SIGTERM) at the end."""

    def __init__(self, env: dict[str, str], tmp_path: Path, app: str = APP) -> None:
        self.env, self.tmp_path, self.app = env, tmp_path, app
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        *args: str,
        app: str | None = None,
        env: dict[str, str] | None = None,
        module: str = "eop",
    ) -> subprocess.Popen[bytes]:
        """Start `python -m MODULE worker APP ARGS` (eop.tools.chaos.armed: fault points armed)."""
        log = (self.tmp_path / f"worker-{len(self.procs)}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "worker", app or self.app, *args],
            env={**self.env, **(env or {})},
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "".join(p.read_text() for p in sorted(self.tmp_path.glob("worker-*.log")))

    def stop_all(self) -> list[int]:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        return [proc.wait(timeout=60) for proc in self.procs]


async def consumer_exists(js: Any, durable: str = "eop-cli") -> bool:
    """True once the worker has created its consumer."""
    try:
        await js.consumer_info("ORDERS", durable)
    except Exception:
        return False
    return True


async def test_processes_sharing_a_consumer_through_a_sigkill_apply_each_message_once(
    engine: AsyncEngine, js: Any, workers: Workers
) -> None:
    """Two `eop worker` processes, one SIGKILLed mid-stream and restarted: every effect is 1."""
    await create_effects_table(engine)
    first = workers.start("--concurrency", "4")
    workers.start("--concurrency", "4", "--batch", "4")
    await wait_for(lambda: consumer_exists(js), what="the consumer")
    for i in range(300):
        await publish(js, f"m{i}", msg_id=f"id-{i}")
        if i == 150:
            first.send_signal(signal.SIGKILL)
            first.wait()
            workers.start("--concurrency", "4")
    await wait_for(lambda: drained(js, "eop-cli"), timeout_s=60, what="all messages")
    codes = workers.stop_all()
    assert codes[1:] == [0, 0]
    assert await effects_by_body(engine) == {f"m{i}": 1 for i in range(300)}


async def test_sigterm_stops_the_worker_gracefully_with_exit_code_0(
    engine: AsyncEngine, js: Any, workers: Workers
) -> None:
    """SIGTERM: the in-flight message is finished and acked, then the process exits 0."""
    await create_effects_table(engine)
    workers.env["CLIAPP_HANDLER_DELAY_S"] = "1.0"
    proc = workers.start()
    await wait_for(lambda: consumer_exists(js), what="the consumer")
    await publish(js, "slow")
    await wait_for(lambda: _has_ack_pending(js), what="the message to be in flight")
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 30) == 0
    assert await drained(js, "eop-cli")
    assert await effects_by_body(engine) == {"slow": 1}
    assert '"event": "worker.stopped"' in workers.logs()


async def test_a_worker_process_keeps_its_startup_objects_out_of_full_collections(
    engine: AsyncEngine, js: Any, workers: Workers, tmp_path: Path
) -> None:
    """Once ready, an `eop worker` process freezes what it holds (gc.freeze), so that
    Python's full collections, which stalled every message in flight, walk only what
    came later; the messages are processed as ever."""
    await create_effects_table(engine)
    report = tmp_path / "frozen"
    workers.env["CLIAPP_GC_REPORT"] = str(report)
    workers.start()

    async def started() -> bool:
        return '"event": "worker.started"' in workers.logs()

    await wait_for(started, what="the worker to be ready")
    await publish(js, "after-ready")
    await wait_for(lambda: drained(js, "eop-cli"), what="the message")
    assert workers.stop_all() == [0]
    assert int(report.read_text()) > 10_000
    assert await effects_by_body(engine) == {"after-ready": 1}


async def _has_ack_pending(js: Any) -> bool:
    info = await js.consumer_info("ORDERS", "eop-cli")
    return bool(info.num_ack_pending)


def test_unreachable_nats_at_start_is_a_clear_error_and_non_zero_exit(database_url: str) -> None:
    """NATS down at start, failing fast (startup_attempts 1): exit 1, a one-line cause with
    the password redacted, no traceback."""
    port = embedded.free_port()
    url = f"nats://u:hunter2@127.0.0.1:{port}"
    result = eop("worker", APP, env=eop_env(database_url, url, EOP_STARTUP_ATTEMPTS="1"))
    assert result.returncode == 1
    assert "NATS is unreachable" in result.stderr
    assert "hunter2" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_unreachable_postgres_at_start_is_a_clear_error_and_non_zero_exit(nats_url: str) -> None:
    """PostgreSQL down at start, failing fast (startup_attempts 1): exit 1 and a clear
    cause, password redacted."""
    url = f"postgresql+asyncpg://postgres:hunter2@127.0.0.1:{embedded.free_port()}/x"
    result = eop("worker", APP, env=eop_env(url, nats_url, EOP_STARTUP_ATTEMPTS="1"))
    assert result.returncode == 1
    assert "PostgreSQL" in result.stderr
    assert "hunter2" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_unmigrated_database_tells_to_run_db_upgrade(
    empty_database_url: str, nats_url: str
) -> None:
    """A database without eop's tables: the worker refuses to start and names the fix."""
    result = eop("worker", APP, env=eop_env(empty_database_url, nats_url))
    assert result.returncode == 1
    assert "eop db upgrade" in result.stderr


def test_an_error_every_process_meets_is_printed_once(
    empty_database_url: str, nats_url: str
) -> None:
    """`--processes 2` on a database without eop's tables: both processes refuse to start,
    and the user reads the one `eop: error:` line once, not once per process."""
    result = eop("worker", APP, env=eop_env(empty_database_url, nats_url, EOP_PROCESSES="2"))
    assert result.returncode == 1
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr[-3000:]
    assert "eop db upgrade" in lines[0]
    assert "Traceback" not in result.stderr


async def test_a_failed_migration_is_one_line_and_changes_nothing(
    empty_database_url: str,
) -> None:
    """`eop db upgrade` whose migration PostgreSQL refuses (here a table in its way; in a
    rolling update, a deadlock with an old worker): exit 1, one `eop: error:` line that says
    nothing changed and when to run it again, no traceback; the tables stay where they were."""
    migrate.upgrade(empty_database_url, revision="eop_0010")
    engine = create_async_engine(empty_database_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text("CREATE TABLE eop.inbox_wide (x int)"))
    finally:
        await engine.dispose()
    env = eop_env(empty_database_url, "nats://127.0.0.1:1")
    result = eop("db", "upgrade", env=env)
    assert result.returncode == 1, result.stderr
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert "rolled back, changing nothing" in lines[0]
    assert "run it again" in lines[0]
    assert "Traceback" not in result.stderr
    assert migrate.current(empty_database_url) == "eop_0010"


def test_db_commands_upgrade_current_check_downgrade(empty_database_url: str) -> None:
    """`eop db upgrade | current | check | downgrade base` work from the command line."""
    env = eop_env(empty_database_url, "nats://127.0.0.1:1")
    assert eop("db", "check", env=env).returncode == 1
    upgraded = eop("db", "upgrade", env=env)
    assert upgraded.returncode == 0, upgraded.stderr
    assert eop("db", "current", env=env).stdout.strip() == migrate.head()
    assert eop("db", "check", env=env).returncode == 0
    assert eop("db", "downgrade", "base", env=env).returncode == 0
    assert "base" in eop("db", "current", env=env).stdout


def test_every_worker_flag_names_its_environment_variable() -> None:
    """`eop worker --help` shows the EOP_* variable of each flag."""
    result = eop("worker", "--help", env=dict(os.environ))
    assert result.returncode == 0
    for var in ("EOP_CONCURRENCY", "EOP_BATCH", "EOP_DATABASE_URL", "EOP_NATS_URL", "EOP_CREATE"):
        assert var in result.stdout


async def test_worker_reconnects_after_nats_restart(
    engine: AsyncEngine, js: Any, nats_server: embedded.NatsServer, workers: Workers
) -> None:
    """nats-server stopped and restarted (file storage): the worker carries on by itself."""
    await create_effects_table(engine)
    workers.start()
    await wait_for(lambda: consumer_exists(js), what="the consumer")
    await publish(js, "before")
    await wait_for(lambda: drained(js, "eop-cli"), what="the first message")
    nats_server.stop()
    await asyncio.sleep(1.0)
    nats_server.start()
    await wait_for(lambda: _published(js, "after"), timeout_s=20, what="the client to reconnect")
    await wait_for(lambda: drained(js, "eop-cli"), timeout_s=30, what="the second message")
    assert workers.procs[0].poll() is None
    assert await effects_by_body(engine) == {"before": 1, "after": 1}


async def _published(js: Any, body: str) -> bool:
    try:
        await publish(js, body)
    except Exception:
        return False
    return True


async def test_worker_reconnects_after_postgres_restart(
    make_postgres_server: Any, nats_url: str, js: Any, tmp_path: Path
) -> None:
    """PostgreSQL restarted under a running worker: messages still take effect once."""
    pg = make_postgres_server()
    migrate.upgrade(pg.url)
    engine = create_async_engine(pg.url)
    await create_effects_table(engine)
    pool = Workers(eop_env(pg.url, nats_url), tmp_path)
    try:
        pool.start()
        await wait_for(lambda: consumer_exists(js), what="the consumer")
        await publish(js, "before")
        await wait_for(lambda: drained(js, "eop-cli"), what="the first message")
        await engine.dispose()
        await asyncio.to_thread(pg.restart)
        await publish(js, "after")
        # The effect first: just after a publish the consumer's pending count may not
        # show the new message yet, and "drained" alone would pass before it is handled.
        both = {"before": 1, "after": 1}
        await wait_for(
            lambda: equals(effects_by_body(engine), both),
            timeout_s=30,
            what="the second message's effect",
        )
        await wait_for(lambda: drained(js, "eop-cli"), timeout_s=30, what="the second message")
        assert pool.procs[0].poll() is None
        assert await effects_by_body(engine) == both
    finally:
        pool.stop_all()
        await engine.dispose()
