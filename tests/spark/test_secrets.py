"""Credentials the executors read from their own environment: the job carries names only.

A canary password is planted in the driver's environment; it must not be in
what Spark ships to the executors (the pickled sink function, the source's
options and its partitions) nor in their printed forms, and the executor
side gets it from its own variable.
"""

from __future__ import annotations

import pickle

import pytest

from eop import errors
from eop.spark import jobs, offsets, sink, source
from eop.spark.offsets import SourceOptions

CANARY = "canary-s3cret-7f1e"


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
    spec = type("Spec", (), {"stream": "ORDERS", "subject": "ORDERS.>"})()
    options = read.options(spec)  # type: ignore[arg-type]  # only stream and subject are read
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
