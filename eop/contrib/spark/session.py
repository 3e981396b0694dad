"""A SparkSession for eop: classic (a Java runtime found or provided) or Spark Connect,
with eop's data sources registered."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from eop import errors as errors_mod
from eop.contrib.spark import connect, errors, java

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[2]"
SUBMITTED_ENV = "PYSPARK_GATEWAY_PORT"
"""Set by spark-submit for the Python driver it starts: the JVM and its master exist."""

#: Settings for a local session; a cluster's come from spark-submit and its own configuration.
LOCAL_CONF = {
    "spark.ui.enabled": "false",
    # Few tasks of small data: the default of 200 shuffle partitions only costs time.
    "spark.sql.shuffle.partitions": "4",
}


def is_local(master: str) -> bool:
    """Whether ``master`` runs Spark inside this process (``local``, ``local[N]``, ...)."""
    return master == "local" or master.startswith("local[")


def build(
    master: str | None = None,
    *,
    app_name: str = "eop",
    conf: Mapping[str, str] | None = None,
    remote: str | None = None,
    connect_retry_s: float = connect.RETRY_S,
) -> SparkSession:
    """Get or create the SparkSession, with the ``jetstream`` and ``eop`` data sources registered.

    ``remote`` (``sc://host:port``) connects to a Spark Connect server instead:
    no JVM here, and ``master`` is the server's. Its Python workers, not this
    process's, import eop and the app. A call the server does not answer is
    retried for about ``connect_retry_s`` (:func:`eop.contrib.spark.connect.bound_retries`).

    ``master`` defaults to spark-submit's when run by spark-submit, else
    ``local[2]``. For local masters: Spark binds to 127.0.0.1, its Python
    workers run this interpreter, and its web UI is off (``conf`` may turn it on).
    """
    builder_cls = _pyspark_session()
    if remote is not None:
        return _connect(builder_cls, remote, conf or {}, connect_retry_s)
    submitted = SUBMITTED_ENV in os.environ
    if master is None and not submitted:
        master = DEFAULT_MASTER
    builder = builder_cls.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    local = master is not None and is_local(master)
    if not submitted:
        # Under spark-submit the JVM runs already, with the Java spark-submit found.
        java.ensure_java()
    settings = dict(LOCAL_CONF) if local else {}
    settings.update(conf or {})
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        # The workers must import eop and the app from the same environment as the driver.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    register(spark)
    return spark


def _connect(
    builder_cls: type[SparkSession], remote: str, conf: Mapping[str, str], retry_s: float
) -> SparkSession:
    if not remote.startswith("sc://"):
        raise errors_mod.ConfigurationError(
            f"a Spark Connect URL starts with sc://, not {remote!r}"
        )
    try:
        import pyspark.sql.connect.session  # noqa: F401 # its requirements, checked here
    except ImportError as exc:
        raise errors.SparkConnectUnavailable(
            f"{errors.SparkConnectUnavailable.__doc__} ({exc})"
        ) from None
    # A session of its own (Connect sessions are cheap, server-side): stopping it
    # leaves a caller's session on the same server alone.
    spark = builder_cls.builder.remote(remote).create()
    connect.bound_retries(spark, retry_s)
    for key, value in conf.items():
        # The server's own settings are its; a session sets its runtime ones.
        spark.conf.set(key, value)
    register(spark)
    return spark


def register(spark: SparkSession) -> None:
    """Register the ``jetstream`` and ``eop`` data sources in a session built elsewhere."""
    from eop.contrib.spark.sink import EopDataSource
    from eop.contrib.spark.source import JetStreamDataSource

    spark.dataSource.register(JetStreamDataSource)
    spark.dataSource.register(EopDataSource)


def ship(spark: SparkSession, files: Sequence[str]) -> None:
    """Put ``files`` (``.py``, ``.zip``, ``.egg``) on the executors' Python path.

    What ``spark.submit.pyFiles`` does under spark-submit, for a session that
    a plain Python process started.
    """
    if connect.is_connect(spark):
        if files:
            # Spark Connect's way: the files go to the server, for this session's workers.
            spark.addArtifacts(*files, pyfile=True)
        return
    for path in files:
        spark.sparkContext.addPyFile(path)


def _pyspark_session() -> type[SparkSession]:
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise errors.SparkUnavailable() from None
    return SparkSession
