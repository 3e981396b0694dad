"""What differs between a classic SparkSession and a Spark Connect one, for eop.

A Spark Connect session has no SparkContext, no RDDs and no JVM in this
process: eop's jobs take the paths both kinds offer (data sources, Python
UDFs, streaming query progress) and check :func:`is_connect` where they differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def is_connect(spark: SparkSession) -> bool:
    """Whether ``spark`` is a Spark Connect session."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def activate(spark: SparkSession) -> None:
    """Make a classic ``spark`` the JVM's active session in the calling thread.

    Spark looks a Python data source up for a write in the thread's active
    session, which a thread other than the one that built the session lacks
    (PySpark's ``createDataFrame`` does the same). A Connect session's server
    knows its sessions by id: nothing to do.
    """
    if is_connect(spark):
        return
    jvm = spark._jvm
    assert jvm is not None
    spark._get_j_spark_session_class(jvm).setActiveSession(spark._jsparkSession)
