"""Credentials stay out of what Spark ships, shows and keeps.

A canary password is planted in the driver's environment; it must not be in
what Spark ships to the executors (the pickled sink function, the source's
options and its partitions) nor in their printed forms, and the executor
side gets it from its own variable. And with canary credentials given either
way (the executors' own variables, or the settings themselves), a backfill and
a streaming query run in a driver whose web UI is up: no canary in its log,
Spark's event log, any REST endpoint or page of the UI, the plans, or any file
of the checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from eop import errors
from eop.broker import connection
from eop.contrib.spark import jobs, offsets, sink, source
from eop.contrib.spark.offsets import SourceOptions
from eop.nats_access import NatsAccess
from eop.tools import embedded
from tests.integration.bed import STREAM, create_effects_table, effects_by_body, publish

from . import sparkapp

CANARY = "canary-s3cret-7f1e"
ROOT = Path(__file__).resolve().parents[2]
MESSAGES = 30


def test_the_sink_carries_the_database_urls_variable_not_its_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Target(env=...) ships the variable's name; the executor reads the value from it."""
    from pyspark import cloudpickle

    url = f"postgresql+asyncpg://app:{CANARY}@db:5432/app"
    target = sink.Target.create(
        "myapp:app", "billing", env={"database_url": "EOP_DATABASE_URL"}, database_url=url
    )
    shipped = cloudpickle.dumps(sink.PartitionFunction(target))
    assert CANARY.encode() not in shipped
    assert CANARY not in repr(target)
    monkeypatch.setenv("EOP_DATABASE_URL", url)
    assert target.resolved_settings()["database_url"] == url
    monkeypatch.delenv("EOP_DATABASE_URL")
    with pytest.raises(errors.ConfigurationError, match="EOP_DATABASE_URL, which is not set"):
        target.resolved_settings()


def test_the_source_carries_the_nats_passwords_variable_not_its_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """natsPasswordEnv: the planner reads the password, partitions carry only the name."""
    monkeypatch.setenv("EOP_NATS_USER", "app")
    monkeypatch.setenv("EOP_NATS_PASSWORD", CANARY)
    from eop.settings import Settings

    settings = Settings.from_env()
    read = jobs.ReadOptions(
        "nats://n:4222", nats=settings.nats_access, secret_env=(("password", "EOP_NATS_PASSWORD"),)
    )
    spec = type("Spec", (), {"stream": "ORDERS", "subject": "ORDERS.>", "partitions": 1})()
    options = read.options(spec)  # type: ignore[arg-type]  # reads stream, subject, partitions
    assert options["natsPasswordEnv"] == "EOP_NATS_PASSWORD"
    assert CANARY not in repr(options)

    planned = SourceOptions.parse(options)
    assert planned.nats.password == CANARY  # the planner (driver) connects with it
    (partition,) = source._partitions(planned, "epoch", 1, 10)
    assert CANARY.encode() not in pickle.dumps(partition)
    assert CANARY not in repr(partition)
    executor = offsets.with_secrets_from_env(partition.nats, partition.secret_env)
    assert executor.password == CANARY
    monkeypatch.delenv("EOP_NATS_PASSWORD")
    with pytest.raises(errors.ConfigurationError, match="natsPasswordEnv names EOP_NATS_PASSWORD"):
        offsets.with_secrets_from_env(partition.nats, partition.secret_env)


#: The database password, the NATS token and the NATS password of the driver tests.
DB_CANARY = "canary-db-pw-3a9c"
TOKEN_CANARY = "canary-nats-tok-b41d"
PASSWORD_CANARY = "canary-nats-pw-6e02"

#: Each way of giving the credentials: the nats-server's authorization, then the driver's
#: environment and flags (``{nats}`` is the server's host:port, ``{db}`` the database URL).
WAYS = {
    # The executors read the secrets from their own variables; the job carries the names.
    "executor_credentials": (
        f'authorization {{ token: "{TOKEN_CANARY}" }}',
        {
            "EOP_DATABASE_URL": "{db}",
            "EOP_NATS_URL": "nats://{nats}",
            "EOP_NATS_TOKEN": TOKEN_CANARY,
        },
        ["--executor-credentials"],
    ),
    # The settings themselves, passwords inside both URLs: they travel with the tasks.
    "settings": (
        f'authorization {{ user: alice, password: "{PASSWORD_CANARY}" }}',
        {},
        ["--database-url", "{db}", "--nats-url", f"nats://alice:{PASSWORD_CANARY}@{{nats}}"],
    ),
}


@pytest.mark.integration
# A Spark driver that starts, runs two commands and serves its UI: minutes on a loaded machine.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("way", sorted(WAYS))
async def test_no_canary_credential_in_logs_ui_plans_event_log_or_checkpoint(
    way: str, database_url: str, engine: AsyncEngine, tmp_path: Path
) -> None:
    """Backfill and stream with canary credentials; every UI endpoint and page, the plans,
    Spark's event log, the driver's INFO log and every checkpoint file are free of them."""
    config, env_template, flag_template = WAYS[way]
    db_url = database_url.replace("://postgres@", f"://postgres:{DB_CANARY}@")
    assert DB_CANARY in db_url  # the test database trusts local users: any password works
    await create_effects_table(engine)
    try:
        server = embedded.NatsServer(config=config + "\n")
    except errors.ServerBinaryNotFound as exc:
        pytest.skip(str(exc))
    with server:
        hostport = f"{embedded.HOST}:{server.port}"
        filled = [f.format(db=db_url, nats=hostport) for f in flag_template]
        await _publish(way, hostport)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EOP_", "PYSPARK_"))}
        env.update({k: v.format(db=db_url, nats=hostport) for k, v in env_template.items()})
        env.update(EOP_LOG_LEVEL="debug", PYTHONPATH=str(ROOT))
        out = tmp_path / "out"
        argv = [sys.executable, "-m", "tests.spark.canary_driver", str(out), sparkapp.PATH]
        argv += ["--handler", "spark_sync", "--messages-per-partition", "10", *filled]
        done = await asyncio.to_thread(
            subprocess.run, argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840
        )
    assert done.returncode == 0, done.stderr[-5000:]
    assert f"{MESSAGES} processed" in done.stdout
    assert await effects_by_body(engine) == {f"m{i}": 1 for i in range(MESSAGES)}

    statuses: dict[str, int] = json.loads((out / "ui" / "index.json").read_text())
    fetched = {path for path, status in statuses.items() if status == 200}
    assert len(fetched) > 30, statuses
    assert any("/sql/" in path for path in fetched)
    assert any("/taskList" in path for path in fetched)
    assert any(path.startswith("StreamingQuery/statistics") for path in fetched)
    # The stream's micro-batches are SQL executions; their plans hold the source's scan.
    sql = (out / "ui").glob("*_sql_details_true_planDescription_true")
    assert any("MicroBatchScan" in path.read_text() for path in sql)
    assert (out / "checkpoint" / "offsets" / "0").is_file()
    assert (out / "checkpoint" / "commits" / "0").is_file()
    assert any((out / "plans").iterdir())
    assert any((out / "eventlog").iterdir())

    canaries = [DB_CANARY, TOKEN_CANARY, PASSWORD_CANARY]
    logged = [c for c in canaries if c in done.stdout + done.stderr]
    assert logged == [], "in the driver's output"
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) > 40
    leaked = [
        (str(p.relative_to(out)), c)
        for p in files
        for c in canaries
        if c.encode() in p.read_bytes()
    ]
    assert leaked == []


async def _publish(way: str, hostport: str) -> None:
    """The stream and its messages, through the server that ``way`` configured."""
    if way == "executor_credentials":
        access = NatsAccess(url=f"nats://{hostport}", token=TOKEN_CANARY)
    else:
        access = NatsAccess(url=f"nats://alice:{PASSWORD_CANARY}@{hostport}")
    nc = await connection.connect_nats(access, name="eop-test-publisher")
    try:
        js = nc.jetstream()
        await js.add_stream(name=STREAM, subjects=["ORDERS.>"])
        for i in range(MESSAGES):
            await publish(js, f"m{i}")
    finally:
        await nc.close()
