"""What differs between a classic SparkSession and a Spark Connect one, for eop.

A Spark Connect session has no SparkContext, no RDDs and no JVM in this
process: eop's jobs take the paths both kinds offer (data sources, Python
UDFs, streaming query progress) and check :func:`is_connect` where they differ.
"""

from __future__ import annotations

import contextlib
import urllib.parse
from typing import TYPE_CHECKING, Any

from eop.contrib.spark import errors

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


#: How long a Spark Connect call is retried when the server does not answer, by default.
RETRY_S = 30.0
# pyspark's default backoff shape, capped lower: 0.1 s doubling to 5 s between attempts.
_FIRST_WAIT_MS = 100
_MAX_WAIT_MS = 5000


def retries_within(within_s: float) -> int:
    """How many retries of the backoff above fit in ``within_s`` seconds of waits."""
    waited, wait, retries = 0.0, float(_FIRST_WAIT_MS), 0
    while waited + wait <= within_s * 1000:
        waited += wait
        retries += 1
        wait = min(wait * 2, _MAX_WAIT_MS)
    return retries


def bound_retries(spark: SparkSession, within_s: float = RETRY_S) -> None:
    """Retry a Connect session's calls to an unanswering server for about ``within_s``, not
    pyspark's ten minutes (its default: a lost server would hold the caller that long per
    call, and once more in ``stop()``)."""
    from pyspark.sql.connect.client.retries import DefaultPolicy

    client: Any = spark.client
    policy = DefaultPolicy(
        max_retries=retries_within(within_s),
        backoff_multiplier=2.0,
        initial_backoff=_FIRST_WAIT_MS,
        max_backoff=_MAX_WAIT_MS,
        max_server_retry_delay=round(within_s * 1000),
    )
    client.set_retry_policies([policy])
    # A reattach that keeps failing is retried for an hour by default; no public setter.
    client._max_retry_exception_elapsed_time = within_s


def abandon(spark: SparkSession) -> None:
    """Stop a Connect session whose server is gone without retrying: release what can be."""
    client: Any = getattr(spark, "client", None)
    if client is not None:
        client.set_retry_policies([])
    with contextlib.suppress(Exception):
        spark.stop()


def lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the Spark Connect server did not answer (gRPC UNAVAILABLE)."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        # grpc.RpcError, without importing grpc (a classic session's install may lack it).
        grpc_error = type(error).__module__.startswith("grpc")
        if grpc_error and getattr(_code(error), "name", None) == "UNAVAILABLE":
            return True
        if type(error).__module__.startswith("pyspark") and "UNAVAILABLE" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _code(error: Any) -> Any:
    with contextlib.suppress(Exception):
        return error.code()
    return None


def shown(remote: str) -> str:
    """A Spark Connect URL as messages show it: ``sc://host:port``, no token or user."""
    parts = urllib.parse.urlsplit(remote.replace("sc://", "http://", 1))
    host = parts.hostname or "?"
    return f"sc://{host}:{parts.port}" if parts.port else f"sc://{host}"


def lost_error(remote: str, retry_s: float) -> errors.SparkConnectLost:
    """The one line for a Spark Connect server that stopped answering."""
    return errors.SparkConnectLost(
        f"the Spark Connect server {shown(remote)} does not answer (retried for "
        f"{retry_s:g} s): check that it runs and is reachable, then run the command again "
        "(a stream continues from its checkpoint; a backfill skips what it committed)"
    )
