"""``manage.py eop_worker`` and ``manage.py eop ...`` as a user runs them: subprocesses, signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.bed import drained, wait_for

from .conftest import HERE, libpq_url
from .test_handlers import accounts, balance, effects, rows, settled

pytestmark = pytest.mark.timeout(300)


def manage_env(database_url: str, nats_url: str, **extra: str) -> dict[str, str]:
    """The environment of a ``manage.py`` subprocess: the project and the test's servers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EOP_")}
    env.update(
        DJANGO_SETTINGS_MODULE="djproject.settings",
        DJPROJECT_DATABASE_URL=libpq_url(database_url),
        DJPROJECT_NATS_URL=nats_url,
        EOP_LOG_FORMAT="json",
        # One process: the test signals it by PID.
        EOP_PROCESSES="1",
        **extra,
    )
    return env


def manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``python manage.py ARGS`` to completion in the project's directory."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        env=env,
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def start_worker(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    """``python manage.py eop_worker ARGS`` in the background, its output in ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "manage.py", "eop_worker", *args],
            env=env,
            cwd=HERE,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def consuming(js: Any) -> bool:
    """True once the worker has made its consumer."""
    try:
        await js.consumer_info("DJ", "eop-slow")
    except Exception:
        return False
    return True


def test_manage_eop_db_check_finds_the_tables_made_by_manage_py_migrate(
    project: str, nats_url: str
) -> None:
    """``manage.py migrate`` (eop's Django migration) left eop's tables at head and as
    modelled; ``manage.py eop`` runs eop's commands on the project's database."""
    env = manage_env(project, nats_url)
    done = manage("eop", "db", "check", env=env)
    assert done.returncode == 0, done.stderr
    assert "up to date" in done.stdout
    listed = manage("eop", "dlq", "list", env=env)
    assert listed.returncode == 0, listed.stderr


def test_manage_eop_streams_create_makes_the_projects_streams(project: str, nats_url: str) -> None:
    """``manage.py eop streams create`` takes the project's app without being told it,
    and makes its declared streams before any worker runs."""
    env = manage_env(project, nats_url)
    done = manage("eop", "streams", "create", env=env)
    assert done.returncode == 0, done.stderr
    states = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines()[1:]}
    assert states == {"DJ": "created", "DJLEDGER": "created"}


def test_a_refused_settings_eop_is_one_line_never_a_traceback(project: str, nats_url: str) -> None:
    """A typo in ``settings.EOP`` (an unknown key) does not fail Django's start with a
    traceback: ``manage.py eop worker`` refuses to run with one line (JSON here, as the
    logs are) and ``manage.py check`` reports it as the system check ``eop.E001``."""
    env = manage_env(project, nats_url, DJPROJECT_EOP_EXTRA=json.dumps({"CONCURENCY": 4}))
    refused = manage("eop", "worker", env=env)
    assert refused.returncode == 1, refused.stderr
    assert "Traceback" not in refused.stderr
    (line,) = refused.stderr.splitlines()
    entry = json.loads(line)
    assert entry["event"] == "command.failed"
    assert "unknown key 'CONCURENCY'" in entry["error"]
    checked = manage("check", env=env)
    assert checked.returncode == 1
    assert "Traceback" not in checked.stderr
    assert "(eop.E001) settings.EOP has an unknown key 'CONCURENCY'" in checked.stderr


def test_a_database_url_flag_is_refused_under_django(project: str, nats_url: str) -> None:
    """Under Django the database is DATABASES': ``--database-url`` is refused with one line
    and the usage status, before anything connects. A worker given a reachable other
    database stopped only once connected, one it could not reach it retried for ever, and
    ``eop db upgrade`` migrated whatever it named."""
    env = manage_env(project, nats_url)
    other = "postgresql://postgres@127.0.0.1:1/other"
    for args in (
        ("eop", "db", "upgrade", "--database-url", other),
        ("eop_worker", f"--database-url={other}"),
    ):
        refused = manage(*args, env=env)
        assert refused.returncode == 2, refused.stderr
        assert "Traceback" not in refused.stderr
        (line,) = refused.stderr.splitlines()
        entry = json.loads(line)
        assert "--database-url is not accepted under Django" in entry["error"]
        assert "DATABASES['default']" in entry["error"]


def test_help_under_django_names_the_projects_settings_not_eops_defaults(
    project: str, nats_url: str
) -> None:
    """``manage.py eop worker --help`` is the help of the command as typed there: its usage
    names ``manage.py eop``, the app is the project's (given for the user), each setting
    names its ``settings.EOP`` key, and ``--database-url``, refused there, is not offered
    with eop's default URL."""
    env = manage_env(project, nats_url)
    for args in (("eop", "worker", "--help"), ("eop_worker", "--help")):
        shown = manage(*args, env=env)
        assert shown.returncode == 0, shown.stderr
        text = " ".join(shown.stdout.split())
        assert text.startswith("usage: manage.py eop worker "), text[:80]
        assert "[MODULE:APP]" in text
        assert "[default: the project's, settings.EOP['APP']]" in text
        assert "[settings.EOP['SCHEMA'] or env: EOP_SCHEMA; default: eop]" in text
        assert "--database-url" not in text
        assert "postgresql+asyncpg://" not in text
    listed = " ".join(manage("eop", "dlq", "list", "--help", env=env).stdout.split())
    assert "--app MODULE:APP take the database URL and schema from this app [default: the " in (
        listed
    )


async def test_eop_worker_sigkilled_mid_batch_and_restarted_applies_each_message_once(
    project: str, nats_url: str, js: Any, tmp_path: Path
) -> None:
    """``manage.py eop_worker`` killed (SIGKILL) while it works through batches, then
    started again: every message's effect exactly once, none dead-lettered, the consumer
    drains; SIGTERM then stops it within its grace, exit 0."""
    await accounts("hot")
    env = manage_env(project, nats_url, DJPROJECT_DELAY_S="0.03")
    log = tmp_path / "worker.log"
    flags = ("--handler", "slow", "--concurrency", "16", "--batch", "8")
    first = start_worker(env, log, *flags)
    await wait_for(lambda: consuming(js), timeout_s=60, what="the worker's consumer")
    for i in range(300):
        await js.publish("dj.slow", json.dumps({"key": str(i)}).encode())

    async def working() -> bool:
        return len(await effects("slow")) >= 60

    await wait_for(working, timeout_s=60, what="the worker to be busy")
    first.send_signal(signal.SIGKILL)
    await asyncio.to_thread(first.wait, 30)
    before = sum((await effects("slow")).values())
    print(f"\n[django sigkill] effects committed before the restart: {before} of 300")
    second = start_worker(env, log, *flags)
    try:
        await wait_for(lambda: settled(js, "eop-slow"), timeout_s=120, what="all messages")
    finally:
        second.send_signal(signal.SIGTERM)
        # Grace (10 s in settings.EOP) plus a margin: a stop that hangs is a failure.
        code = await asyncio.to_thread(second.wait, 40)
    assert code == 0, log.read_text()[-3000:]
    assert await effects("slow") == {str(i): 1 for i in range(300)}
    assert await balance("hot") == 300
    assert await rows("SELECT count(*) FROM eop.dead_letters") == [(0,)]
    assert '"event": "worker.stopped"' in log.read_text()


async def test_eop_worker_stops_on_sigterm_with_a_message_in_flight(
    project: str, nats_url: str, js: Any, tmp_path: Path
) -> None:
    """SIGTERM while a slow handler runs in a lane: it finishes, commits, is acked, and the
    process exits 0 within its grace."""
    await accounts("hot")
    env = manage_env(project, nats_url, DJPROJECT_DELAY_S="1.5")
    log = tmp_path / "worker.log"
    proc = start_worker(env, log, "--handler", "slow")

    async def in_flight() -> bool:
        try:
            info = await js.consumer_info("DJ", "eop-slow")
        except Exception:
            return False
        return bool(info.num_ack_pending)

    await wait_for(lambda: consuming(js), timeout_s=60, what="the worker's consumer")
    await js.publish("dj.slow", json.dumps({"key": "slow"}).encode())
    await wait_for(in_flight, timeout_s=30, what="the message to be in flight")
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 30) == 0, log.read_text()[-3000:]
    assert await effects("slow") == {"slow": 1}, log.read_text()[-6000:]
    assert await rows("SELECT count(*) FROM eop.dead_letters") == [(0,)]


def pg_rows(asyncpg_url: str, sql: str) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` on a database of a server of the test's own (psycopg, autocommit)."""
    import psycopg

    with psycopg.connect(libpq_url(asyncpg_url), autocommit=True) as conn:
        return [tuple(row) for row in conn.execute(sql).fetchall()]


async def test_eop_worker_rides_out_a_postgres_crash_without_losing_or_dead_lettering(
    make_postgres_server: Any, nats_url: str, js: Any, tmp_path: Path
) -> None:
    """PostgreSQL SIGKILLed under ``manage.py eop_worker`` and started again: the lanes'
    broken Django connections are replaced, every message takes effect once, none is
    dead-lettered, the worker keeps running and then stops on SIGTERM."""
    pg = make_postgres_server()
    url = pg.create_database("djoutage")
    env = manage_env(url, nats_url, DJPROJECT_DELAY_S="0.02")
    migrated = await asyncio.to_thread(manage, "migrate", "--verbosity", "0", env=env)
    assert migrated.returncode == 0, migrated.stderr
    await asyncio.to_thread(
        pg_rows, url, "INSERT INTO shop_account (name, balance) VALUES ('hot', 0) RETURNING id"
    )
    log = tmp_path / "worker.log"
    proc = start_worker(env, log, "--handler", "slow", "--concurrency", "8", "--batch", "4")
    try:
        await wait_for(lambda: consuming(js), timeout_s=60, what="the worker's consumer")
        for i in range(150):
            await js.publish("dj.slow", json.dumps({"key": str(i)}).encode())

        async def some_done() -> bool:
            found = await asyncio.to_thread(pg_rows, url, "SELECT count(*) FROM shop_effect")
            return bool(found[0][0] >= 30)

        await wait_for(some_done, timeout_s=60, what="the worker to be busy")
        await asyncio.to_thread(pg.kill)
        await asyncio.sleep(1.0)  # an outage, not a blip
        await asyncio.to_thread(pg.start)
        await wait_for(lambda: drained(js, "eop-slow", "DJ"), timeout_s=120, what="all messages")
        assert proc.poll() is None, log.read_text()[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 40)
    assert code == 0, log.read_text()[-3000:]
    retried = log.read_text().count('"event": "transaction.retry"')
    print(f"\n[django pg crash] transactions retried across the outage: {retried}")
    by_key = await asyncio.to_thread(
        pg_rows, url, "SELECT key, count(*) FROM shop_effect GROUP BY key"
    )
    assert dict(by_key) == {str(i): 1 for i in range(150)}
    assert await asyncio.to_thread(
        pg_rows, url, "SELECT balance FROM shop_account WHERE name = 'hot'"
    ) == [(150,)]
    assert await asyncio.to_thread(pg_rows, url, "SELECT count(*) FROM eop.dead_letters") == [(0,)]
    assert await asyncio.to_thread(pg_rows, url, "SELECT count(*) FROM eop.retries") == [(0,)]


def test_call_command_eop_runs_eops_command_line_in_process(
    project: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``call_command("eop", "db", "current")`` (the command's handle(), not manage.py's
    argv path) prints the revision eop's Django migration left."""
    from django.core.management import call_command

    from eop.pg import migrate

    saved = dict(os.environ)
    try:
        call_command("eop", "db", "current")
    finally:
        # The command exports settings.EOP to the environment (for its child processes).
        os.environ.clear()
        os.environ.update(saved)
    assert capsys.readouterr().out.strip() == migrate.head()


async def test_sigterm_ends_a_worker_whose_orm_handler_hangs_and_the_message_comes_back_once(
    project: str, nats_url: str, js: Any, tmp_path: Path
) -> None:
    """A handler stuck in its lane past the grace period: SIGTERM still ends the process
    (status 3: the lane's thread abandoned), its transaction never commits, and the next
    worker applies the message exactly once."""
    from eop.runtime import shutdown

    await accounts("hot")
    log = tmp_path / "worker.log"
    stuck = start_worker(
        manage_env(project, nats_url, DJPROJECT_DELAY_S="600"),
        log,
        *("--handler", "slow", "--shutdown-grace-s", "2"),
    )
    await wait_for(lambda: consuming(js), timeout_s=60, what="the worker's consumer")
    await js.publish("dj.slow", json.dumps({"key": "stuck"}).encode())

    async def in_flight() -> bool:
        return bool((await js.consumer_info("DJ", "eop-slow")).num_ack_pending)

    await wait_for(in_flight, timeout_s=30, what="the message in flight")

    async def in_handler() -> bool:
        # Delivered is not yet running: the handler's thread is in its sleep once its
        # transaction waits, idle, after the balance's UPDATE.
        found = await rows(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE state = 'idle in transaction' AND query ILIKE '%%balance%%'"
        )
        return bool(found[0][0])

    await wait_for(in_handler, timeout_s=30, what="the handler in its sleep")
    stuck.send_signal(signal.SIGTERM)
    # A liveness bound far above the stop deadline (grace 2 + ack_give_up 10 + 5 s).
    assert await asyncio.to_thread(stuck.wait, 60) == shutdown.EXIT_FORCED
    assert await effects("slow") == {}
    again = start_worker(manage_env(project, nats_url), log, "--handler", "slow")
    try:
        await wait_for(lambda: settled(js, "eop-slow"), timeout_s=60, what="the redelivery")
    finally:
        again.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(again.wait, 40) == 0
    assert await effects("slow") == {"stuck": 1}
    assert await balance("hot") == 1
    assert await rows("SELECT count(*) FROM eop.dead_letters") == [(0,)]
