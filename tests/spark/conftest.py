"""The Spark test bed: one local[2] SparkSession, one standalone cluster and one Spark
Connect server per test session; ``any_spark`` runs a module's tests on classic and Connect.

Without PySpark the Spark tests are skipped, except under CI=true where they
fail (like a missing server binary: see tests/conftest.py).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from eop.tools.spark_cluster import Cluster
from tests.conftest import unavailable
from tests.spark.connect_server import ConnectServer

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """A local[2] session with the jetstream source registered (its Java found or provided)."""
    if importlib.util.find_spec("pyspark") is None:
        unavailable("PySpark is not installed: pip install -e '.[spark]'")
    from eop.contrib.spark import session

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


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    """A Spark Connect server (local[2]) on a free port, from pyspark's jars."""
    if importlib.util.find_spec("pyspark") is None:
        unavailable("PySpark is not installed: pip install -e '.[spark]'")
    if importlib.util.find_spec("grpc") is None or importlib.util.find_spec("pandas") is None:
        unavailable("Spark Connect's client is not installed: pip install -e '.[spark-connect]'")
    server = ConnectServer(tmp_path_factory.mktemp("spark-connect"))
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module", params=["classic", "connect"])
def any_spark(request: pytest.FixtureRequest) -> Iterator[SparkSession]:
    """The classic local[2] session, then a Spark Connect session: the module's tests on both.

    Module-scoped, so pytest runs all of a module's classic tests, then all of
    its Connect ones: a Connect session switches PySpark into Connect mode for
    the whole process (``pyspark.sql.functions`` build Connect columns), which
    this fixture turns off again after the Connect tests.
    """
    if request.param == "classic":
        yield request.getfixturevalue("spark")
        return
    server: ConnectServer = request.getfixturevalue("connect_server")
    from eop.contrib.spark import session

    spark = session.build(remote=server.url)
    try:
        yield spark
    finally:
        spark.stop()
        os.environ.pop(CONNECT_MODE_VAR, None)


CONNECT_MODE_VAR = "SPARK_CONNECT_MODE_ENABLED"
"""Set by PySpark once a Connect session exists in the process."""
