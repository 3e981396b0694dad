"""The developer tools in one folder, eop/tools, and Spark in eop/contrib: old paths kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_old_paths_are_aliases_of_the_new() -> None:
    """``eop.embedded``, ``eop.embedded_cluster``, ``eop.chaos`` and ``eop.spark`` give the
    objects of their new modules."""
    from eop import chaos, embedded, embedded_cluster, spark
    from eop.contrib.spark import errors as spark_errors
    from eop.tools import chaos as new_chaos
    from eop.tools import embedded as new_embedded
    from eop.tools import embedded_cluster as new_cluster

    assert embedded.NatsServer is new_embedded.NatsServer
    assert embedded.free_port is new_embedded.free_port
    assert embedded_cluster.NatsCluster is new_cluster.NatsCluster
    assert (chaos.run, chaos.Config, chaos.Payload) == (
        new_chaos.run,
        new_chaos.Config,
        new_chaos.Payload,
    )
    assert spark.errors is spark_errors
    with pytest.raises(AttributeError):
        spark.no_such_module  # noqa: B018  # the attribute access is the test


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["eop.spark", "--path"], "eop/contrib/spark/__main__.py"),
        (["eop.chaos", "--help"], "usage: eop chaos"),
        (["eop.chaos.armed", "--help"], "usage: eop"),
    ],
)
def test_the_old_entry_points_run_the_new(argv: list[str], expected: str) -> None:
    """``python -m eop.spark`` (spark-submit's), ``python -m eop.chaos`` and ``python -m
    eop.chaos.armed`` still run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", *argv], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout
