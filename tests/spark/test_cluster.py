"""The documented cluster commands, run as a new user would, on a real standalone cluster.

Each command runs in a directory outside the repository that holds only the
app's module; the cluster's executors (see conftest.py) do not have it on
their path. Commands run one at a time: the cluster has two cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from eop.contrib.spark import java
from eop.tools.spark_cluster import Cluster, spark_home
from tests.integration.bed import (
    STREAM,
    bed_settings,
    create_effects_table,
    effects_by_body,
    publish,
    running,
    scalar,
    wait_for,
)

pytestmark = pytest.mark.integration

#: Deadline of one command; a cold driver and executor on a loaded 2-core machine take long.
COMMAND_TIMEOUT_S = 300
MESSAGES = 600

APP = '''
import time

import sqlalchemy as sa
from sqlalchemy.orm import Session

import eop

app = eop.App()
app.stream("ORDERS", subjects=["ORDERS.>"])
INSERT = sa.text("INSERT INTO effects (handler, msg_key, body) VALUES ('cluster', :k, :b)")


@app.handler(stream="ORDERS", subject="ORDERS.created", name="cluster")
def record(msg: eop.Message, session: Session) -> None:
    """One effect row per message, slowly enough that a job lasts a few seconds."""
    time.sleep(0.01)
    session.execute(INSERT, {"k": msg.idempotency_key, "b": msg.data.decode()})
'''


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    """A new user's directory: the app's module and nothing else."""
    (tmp_path / "clusterapp.py").write_text(APP)
    return tmp_path


def user_env(database_url: str, nats_url: str, **extra: str) -> dict[str, str]:
    """The user's environment: eop's settings, Spark on the loopback, no path to the tests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EOP_", "PYSPARK_"))}
    env.pop("PYTHONPATH", None)
    java.ensure_java(env)
    env.update(
        EOP_DATABASE_URL=database_url,
        EOP_NATS_URL=nats_url,
        EOP_LOG_LEVEL="warning",
        # Only loopback traffic, and no web UI on another port.
        SPARK_LOCAL_IP="127.0.0.1",
        EOP_SPARK_CONF="spark.ui.enabled=false",
        **extra,
    )
    return env


def run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A command, its output captured."""
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )


def eop_spark(*args: str) -> list[str]:
    """``eop spark ...`` of the installed package."""
    return [sys.executable, "-m", "eop", "spark", *args]


async def published(js: Any, n: int = MESSAGES) -> None:
    """The stream with ``n`` messages whose bodies are their numbers."""
    await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
    for i in range(n):
        await publish(js, f"m{i}")


def bare_python(where: Path) -> str:
    """A Python of the same version without eop, pyarrow or anything else installed."""
    venv.EnvBuilder(with_pip=False).create(where)
    return str(where / "bin" / "python")


async def test_executors_without_eop_fail_the_backfill_with_one_line_naming_pyspark_python(
    cluster: Cluster, user_dir: Path, database_url: str, nats_url: str, js: Any
) -> None:
    """A plain Python on the executors: exit 1 with the line that names the fix, no job run."""
    await published(js, 10)
    python = bare_python(user_dir / "bare")
    argv = eop_spark("backfill", "clusterapp:app", "--handler", "cluster")
    argv += ["--master", cluster.url, "--python", python]
    done = await asyncio.to_thread(run, argv, user_dir, user_env(database_url, nats_url))
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("eop: error: Spark's executors cannot import eop, pyarrow with ")
    assert "PYSPARK_PYTHON" in last
    assert "An exception was thrown" not in done.stderr


async def test_a_backfill_no_executor_takes_warns_then_ends_at_the_stall_timeout(
    tmp_path: Path, user_dir: Path, database_url: str, nats_url: str, js: Any
) -> None:
    """A master without workers: the job's tasks wait; eop warns, then ends it (exit 1)."""
    await published(js, 10)
    empty = Cluster(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    try:
        await asyncio.to_thread(empty.start, 0)
        argv = eop_spark("backfill", "clusterapp:app", "--handler", "cluster")
        argv += ["--master", empty.url, "--python", sys.executable]
        argv += ["--stall-warn-s", "4", "--stall-timeout-s", "12"]
        done = await asyncio.to_thread(run, argv, user_dir, user_env(database_url, nats_url))
    finally:
        await asyncio.to_thread(empty.stop)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert any(
        line.startswith("eop: warning: ") and "none has run for" in line for line in lines
    ), done.stderr[-3000:]
    assert lines[-1].startswith("eop: error: ")
    assert "no task ran for 12 s (stall timeout)" in lines[-1]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_stops_a_backfill_in_one_line_and_gives_its_lease_up(
    tmp_path: Path,
    user_dir: Path,
    database_url: str,
    nats_url: str,
    js: Any,
    engine: AsyncEngine,
    signum: signal.Signals,
) -> None:
    """SIGTERM or Ctrl-C while a backfill's tasks wait (a master without workers): its Spark
    jobs are cancelled, its lease is given up (no `eop.members` row left for workers or
    the next job to wait out) and it ends with one line, exit 1. SIGTERM ended the
    process at once with its lease kept; SIGINT printed some 120 lines of tracebacks."""
    await published(js, 10)
    empty = Cluster(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    argv = eop_spark("backfill", "clusterapp:app", "--handler", "cluster")
    argv += ["--master", empty.url, "--python", sys.executable, "--stall-warn-s", "2"]
    try:
        await asyncio.to_thread(empty.start, 0)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=user_dir,
            env=user_env(database_url, nats_url),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stderr is not None
            # The job holds its lease and waits for an executor once eop warns of it.
            lines: list[str] = []
            while not any("none has run for" in line for line in lines):
                line = (await proc.stderr.readline()).decode()
                assert line, "".join(lines)[-3000:]
                lines.append(line)
            members = "SELECT count(*) FROM eop.members WHERE subscription = 'cluster'"
            assert await scalar(engine, members) == 1
            proc.send_signal(signum)
            rest = (await proc.stderr.read()).decode()
            code = await asyncio.wait_for(proc.wait(), COMMAND_TIMEOUT_S)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    finally:
        await asyncio.to_thread(empty.stop)
    name = signal.Signals(signum).name
    assert code == 1, rest[-3000:]
    last = rest.strip().splitlines()[-1]
    assert last.startswith(f"eop: error: backfill of ORDERS for handler cluster stopped by {name}")
    assert "Traceback" not in rest, rest[-3000:]
    assert await scalar(engine, members) == 0


async def test_a_stream_whose_probe_no_executor_takes_warns_then_ends_at_the_stall_timeout(
    tmp_path: Path, user_dir: Path, database_url: str, nats_url: str, js: Any
) -> None:
    """A master without workers: the stream's probe waits; eop warns, then ends it (exit 1),
    instead of waiting in silence for ever before the query starts."""
    await published(js, 10)
    empty = Cluster(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    try:
        await asyncio.to_thread(empty.start, 0)
        argv = eop_spark("stream", "clusterapp:app", "--handler", "cluster")
        argv += ["--master", empty.url, "--python", sys.executable]
        argv += ["--checkpoint", str(tmp_path / "checkpoint"), "--available-now"]
        argv += ["--stall-warn-s", "4", "--stall-timeout-s", "12"]
        done = await asyncio.to_thread(run, argv, user_dir, user_env(database_url, nats_url))
    finally:
        await asyncio.to_thread(empty.stop)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert any(
        line.startswith("eop: warning: ") and "none has run for" in line for line in lines
    ), done.stderr[-3000:]
    assert lines[-1].startswith("eop: error: ")
    assert "no task ran for 12 s (stall timeout)" in lines[-1]


async def test_executor_credentials_stay_off_the_cluster_and_missing_ones_fail_fast(
    cluster: Cluster, user_dir: Path, database_url: str, nats_url: str, js: Any
) -> None:
    """--executor-credentials: the driver's database password (a canary) reaches no file of
    the cluster (daemon and executor logs, work directories); executors without
    EOP_DATABASE_URL fail the probe with the line naming it."""
    await published(js, 10)
    canary = "canary-pw-5d1c0e"
    url = database_url.replace("://postgres@", f"://postgres:{canary}@")
    assert canary in url
    argv = eop_spark("backfill", "clusterapp:app", "--handler", "cluster", "--master", cluster.url)
    argv += ["--python", sys.executable, "--py-files", "clusterapp.py", "--executor-credentials"]
    done = await asyncio.to_thread(run, argv, user_dir, user_env(url, nats_url))
    assert done.returncode == 1, done.stderr[-3000:]
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("eop: error: Spark's executors lack the environment variables EOP_DATABASE_URL")
    )
    leaked = [
        path
        for path in cluster.scratch.rglob("*")
        if path.is_file() and canary.encode() in path.read_bytes()
    ]
    assert leaked == []


async def test_spark_submit_without_the_app_shipped_fails_with_one_line_naming_py_files(
    cluster: Cluster, user_dir: Path, database_url: str, nats_url: str, js: Any
) -> None:
    """The package's entry point under spark-submit; the app not shipped: the --py-files line."""
    await published(js, 10)
    entry = run([sys.executable, "-m", "eop.contrib.spark", "--path"], user_dir, dict(os.environ))
    argv = [str(spark_home() / "bin" / "spark-submit"), "--master", cluster.url]
    argv += [entry.stdout.strip(), "backfill", "clusterapp:app", "--handler", "cluster"]
    env = user_env(database_url, nats_url, PYSPARK_PYTHON=sys.executable)
    done = await asyncio.to_thread(run, argv, user_dir, env)
    assert done.returncode == 1, done.stderr[-3000:]
    # spark-submit merges the driver's stderr into its stdout; Spark's INFO lines are around.
    assert (
        "eop: error: Spark's executors cannot import the app module 'clusterapp': ship the "
        "app's code with --py-files (EOP_SPARK_PY_FILES, spark.submit.pyFiles) or install "
        "it in the executors' Python"
    ) in done.stdout.splitlines()
    assert "Traceback" not in done.stdout + done.stderr


async def test_spark_submit_with_the_app_shipped_applies_every_message_once(
    cluster: Cluster,
    user_dir: Path,
    database_url: str,
    nats_url: str,
    js: Any,
    engine: AsyncEngine,
) -> None:
    """The documented spark-submit command: --py-files app.py, the package's entry point."""
    await create_effects_table(engine)
    await published(js, 100)
    entry = run([sys.executable, "-m", "eop.contrib.spark", "--path"], user_dir, dict(os.environ))
    argv = [str(spark_home() / "bin" / "spark-submit"), "--master", cluster.url]
    argv += ["--py-files", "clusterapp.py", entry.stdout.strip()]
    argv += ["backfill", "clusterapp:app", "--handler", "cluster"]
    env = user_env(database_url, nats_url, PYSPARK_PYTHON=sys.executable)
    done = await asyncio.to_thread(run, argv, user_dir, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "100 processed, 0 already done, 0 dead-lettered" in done.stdout
    assert await effects_by_body(engine) == {f"m{i}": 1 for i in range(100)}


async def test_a_backfill_beside_a_live_worker_with_an_executor_killed_applies_each_message_once(
    cluster: Cluster,
    user_dir: Path,
    database_url: str,
    nats_url: str,
    js: Any,
    engine: AsyncEngine,
) -> None:
    """The documented CLI command; mid-job a live worker starts and an executor is killed.

    Every message has one effect, none is dead-lettered, and the backfill ends
    with success once the cluster's worker has started a new executor. (The
    live worker compacts the inbox, so its rows are not counted.)
    """
    await create_effects_table(engine)
    await published(js)
    argv = eop_spark("backfill", "clusterapp:app", "--handler", "cluster")
    argv += ["--master", cluster.url, "--python", sys.executable, "--py-files", "clusterapp.py"]
    argv += ["--messages-per-partition", "50"]
    job = asyncio.create_task(
        asyncio.to_thread(run, argv, user_dir, user_env(database_url, nats_url))
    )
    count = "SELECT count(*) FROM effects"
    await wait_for(
        lambda: _some(engine, count), timeout_s=COMMAND_TIMEOUT_S, what="the backfill's first rows"
    )
    killed = _kill_an_executor(cluster)
    app = _user_app(user_dir).with_settings(**vars(bed_settings(database_url, nats_url)))
    async with running(app):
        done = await job
    assert done.returncode == 0, done.stderr[-3000:]
    assert killed, "no executor was running to be killed"
    assert await effects_by_body(engine) == {f"m{i}": 1 for i in range(MESSAGES)}
    assert "0 dead-lettered, 0 quarantined" in done.stdout
    assert await scalar(engine, "SELECT count(*) FROM eop.dead_letters") == 0


async def _some(engine: AsyncEngine, query: str) -> bool:
    return int(await scalar(engine, query)) > 0


def _kill_an_executor(cluster: Cluster) -> bool:
    """SIGKILL the executor JVMs the cluster's workers run (their Python workers die too)."""
    pids = cluster.executors()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return bool(pids)


def _user_app(user_dir: Path) -> Any:
    """The user's app, imported in the test's process for the live worker."""
    spec = importlib.util.spec_from_file_location("clusterapp", user_dir / "clusterapp.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.app
