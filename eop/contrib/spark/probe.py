"""Before a job: can Spark's executors import eop, pyarrow and the app?

Without this, a missing module fails every task of the job, each retried
(25 s and more on a cluster), and the cause lands in the executors' logs. The
probe is one task of a one-row DataFrame (a Python UDF: classic Spark and
Spark Connect alike) that tries the imports and reports, and the driver
turns a failure into one line that names the fix.

The UDF is pickled by value (see :func:`check`), so it runs in an executor
Python that lacks eop: it needs only the standard library and PySpark.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from eop.contrib.spark import errors, failures

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def check(spark: SparkSession, app: str, env: Sequence[str] = ()) -> None:
    """Raise ExecutorsUnready if an executor cannot import what the sink needs.

    ``app`` is the ``module:attribute`` path the sink imports in the tasks;
    ``env``, the environment variables the executors must have (credentials
    they read from their own environment).
    """
    from pyspark import cloudpickle
    from pyspark.sql import functions as F

    module = app.partition(":")[0]
    # By value: an executor without eop could not unpickle a reference to eop.contrib.spark.probe.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call] # pyspark vendors cloudpickle untyped
    try:
        with warnings.catch_warnings():
            # The hints are strings (postponed annotations), which PySpark cannot read; no
            # Arrow: the probe must run where pyarrow is missing.
            warnings.simplefilter("ignore", UserWarning)
            probe = F.udf(_imports, "string", useArrow=False)
        asked = json.dumps({"module": module, "env": list(env)})
        row = spark.range(1, numPartitions=1).select(probe(F.lit(asked))).first()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call] # as above
    if row is None:
        return
    report = json.loads(row[0])
    problem = describe(report, module)
    if problem is not None:
        raise errors.ExecutorsUnready(problem)


def describe(report: dict[str, object], module: str) -> str | None:
    """The one line for an executor's import ``report``, or None if it lacks nothing."""
    missing = report.get("missing")
    assert isinstance(missing, dict)
    python = f"{report.get('python')} (Python {report.get('version')})"
    environment = [name for name in missing if name != module]
    if environment:
        return (
            f"Spark's executors cannot import {', '.join(environment)} with {python}: "
            f"{failures.PYTHON_HINT}"
        )
    if module in missing:
        cause = str(missing[module])
        if failures.hint(cause, module) == failures.APP_HINT:
            return f"Spark's executors cannot import the app module {module!r}: {failures.APP_HINT}"
        return f"Spark's executors failed to import the app module {module!r}: {cause}"
    unset = report.get("unset")
    if unset:
        assert isinstance(unset, list)
        return (
            f"Spark's executors lack the environment variables {', '.join(unset)}, which they "
            "are to read credentials from (--executor-credentials): set them on every node"
        )
    return None


def _imports(asked: str) -> str:
    """Runs in the executor: the modules the sink needs that fail to import, and why."""
    import importlib
    import json
    import os
    import platform
    import sys

    request = json.loads(asked)
    module = request["module"]
    unset = [var for var in request["env"] if var not in os.environ]
    missing = {}
    for name in ("eop", "pyarrow", module):
        if name == module and "eop" in missing:
            break  # the app imports eop: its failure would say nothing new
        try:
            importlib.import_module(name)
        except Exception as exc:
            missing[name] = f"{type(exc).__name__}: {exc}"
    found = {
        "python": sys.executable,
        "version": platform.python_version(),
        "missing": missing,
        "unset": unset,
    }
    return json.dumps(found)
