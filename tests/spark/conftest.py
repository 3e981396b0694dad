"""The Spark test bed: one local[2] SparkSession, and one standalone cluster, per test session.

Without PySpark the Spark tests are skipped, except under CI=true where they
fail (like a missing server binary: see tests/conftest.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from eop.spark.cluster import Cluster
from tests.conftest import unavailable

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """A local[2] session with the jetstream source registered (its Java found or provided)."""
    if importlib.util.find_spec("pyspark") is None:
        unavailable("PySpark is not installed: pip install -e '.[spark]'")
    from eop.spark import session

    spark = session.build("local[2]", app_name="eop-tests")
    spark.sparkContext.setLogLevel("ERROR")
    yield spark
    spark.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A Spark standalone master and worker on 127.0.0.1, started from pyspark's jars.

    Its executors run the Python a job names, in work directories of their
    own: the tests' modules are not on their path.
    """
    if importlib.util.find_spec("pyspark") is None:
        unavailable("PySpark is not installed: pip install -e '.[spark]'")
    started = Cluster(tmp_path_factory.mktemp("spark-cluster"))
    try:
        yield started.start()
    finally:
        started.stop()
