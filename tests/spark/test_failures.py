"""One line for a Spark failure: its root cause and the fix, never Spark's wrapper line."""

from __future__ import annotations

from typing import Any

import pytest

from eop.contrib.spark import connect, failures, probe

# Shortened from what PySpark 4.3 raised on a standalone cluster whose executors lacked eop.
DATA_SOURCE = """[PYTHON_DATA_SOURCE_ERROR] Failed to create Python data source instance: \
Traceback (most recent call last):
  File "/venv/pyspark/python/lib/pyspark.zip/pyspark/sql/worker/utils.py", line 98, in worker_run
    main(infile, outfile)
  File "/venv/pyspark/python/lib/pyspark.zip/pyspark/serializers.py", line 483, in loads
    return cloudpickle.loads(obj, encoding=encoding)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
ModuleNotFoundError: No module named 'eop'
 SQLSTATE: 38000

JVM stacktrace:
org.apache.spark.sql.AnalysisException: [PYTHON_DATA_SOURCE_ERROR] Failed to create Python data \
source instance: Traceback (most recent call last):
\tat org.apache.spark.sql.errors.QueryCompilationErrors$.pythonDataSourceError(Errors.scala:2)
"""

# A task's failure: the wrapper line first, the cause at the end of the Python traceback.
TASK = """An exception was thrown from the Python worker:
Traceback (most recent call last):
  File "/venv/pyspark/python/lib/pyspark.zip/pyspark/worker.py", line 4327, in invoke_udf
    run_process()
  File "/tmp/app.py", line 10, in <lambda>
ModuleNotFoundError: No module named 'trialapp'

JVM stacktrace:
org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 1.0 failed 4 \
times, most recent failure: Lost task 0.3 in stage 1.0: org.apache.spark.api.python.\
PythonException: Traceback (most recent call last):
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(R.scala:1)
"""

PY4J = """An error occurred while calling o42.load.
: org.apache.spark.SparkException: Job aborted.
\tat org.apache.spark.sql.X.y(X.scala:1)
Caused by: java.net.ConnectException: Connection refused
\tat java.base/sun.nio.ch.Net.connect0(Native Method)
"""


def test_a_python_traceback_is_summed_up_by_its_last_exception_line() -> None:
    """The wrapper lines are dropped; the error condition stays in front."""
    assert failures.summary_of(DATA_SOURCE) == (
        "[PYTHON_DATA_SOURCE_ERROR] ModuleNotFoundError: No module named 'eop'"
    )
    assert failures.summary_of(TASK) == "ModuleNotFoundError: No module named 'trialapp'"


def test_a_jvm_error_is_summed_up_by_its_deepest_exception_line() -> None:
    """A Py4J error without a Python traceback: the last `Caused by` is the cause."""
    assert failures.summary_of(PY4J) == "java.net.ConnectException: Connection refused"


# An executor's Python worker killed (SIGKILL, the OOM killer) under a backfill's save.
CRASHED = """An error occurred while calling o91.save.
: org.apache.spark.SparkException: Job aborted due to stage failure: Task 1 in stage 3.0 \
failed 1 times, most recent failure: Lost task 1.0 in stage 3.0 (TID 7) (vm executor driver): \
org.apache.spark.SparkException: Python worker exited unexpectedly (crashed)
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.read(PythonRunner.scala:1)
Caused by: java.io.EOFException
\tat java.base/java.io.DataInputStream.readFully(DataInputStream.java:210)
"""


def test_a_crashed_python_worker_is_named_not_the_py4j_wrapper_line() -> None:
    """A bare JVM cause (``Caused by: java.io.EOFException``, no message) is no reason to
    fall back to Py4J's "An error occurred while calling o91.save.": the innermost
    SparkException says what happened, the cause is named beside it."""
    assert failures.summary_of(CRASHED) == (
        "Python worker exited unexpectedly (crashed) (java.io.EOFException)"
    )


def test_an_eop_error_inside_a_failure_wins() -> None:
    """A task that raised an eop error: its message and class name, as before."""
    text = TASK.replace(
        "ModuleNotFoundError: No module named 'trialapp'",
        "eop.contrib.spark.errors.RangeUnavailable: sequences 1 to 9 are gone",
    )
    assert failures.summary_of(text) == "sequences 1 to 9 are gone (RangeUnavailable)"


def test_a_text_without_an_exception_line_keeps_its_first_line() -> None:
    """Nothing to dig out: the first line, as Spark said it."""
    assert failures.summary_of("the query was stopped\nmore") == "the query was stopped"


@pytest.mark.parametrize(
    ("text", "fix"),
    [
        (DATA_SOURCE, failures.PYTHON_HINT),
        (TASK.replace("trialapp", "pyarrow"), failures.PYTHON_HINT),
        (TASK, failures.APP_HINT),
        (TASK.replace("trialapp", "requests"), None),
        (PY4J, None),
    ],
)
def test_a_missing_module_names_its_fix(text: str, fix: str | None) -> None:
    """eop or pyarrow missing: PYSPARK_PYTHON; the app missing: --py-files; else nothing."""
    assert failures.hint(text, "trialapp") == fix


def test_the_probe_report_becomes_one_line_naming_the_fix() -> None:
    """What the executors lack decides the line: their Python first, then the app."""
    base = {"python": "/usr/bin/python3", "version": "3.11.2"}
    lacking_eop = {**base, "missing": {"eop": "ModuleNotFoundError: No module named 'eop'"}}
    line = probe.describe(lacking_eop, "myapp")
    assert line is not None
    assert "cannot import eop with /usr/bin/python3 (Python 3.11.2)" in line
    assert "PYSPARK_PYTHON" in line
    lacking_app = {**base, "missing": {"myapp": "ModuleNotFoundError: No module named 'myapp'"}}
    assert "--py-files" in (probe.describe(lacking_app, "myapp") or "")
    broken = {**base, "missing": {"myapp": "ModuleNotFoundError: No module named 'requests'"}}
    assert "failed to import the app module 'myapp': ModuleNotFoundError" in (
        probe.describe(broken, "myapp") or ""
    )
    assert probe.describe({**base, "missing": {}}, "myapp") is None


def test_executors_lacking_the_credential_variables_are_named() -> None:
    """--executor-credentials: an executor without the variable fails the probe, naming it."""
    report = {"python": "p", "version": "3.11", "missing": {}, "unset": ["EOP_DATABASE_URL"]}
    line = probe.describe(report, "myapp")
    assert line is not None
    assert line.startswith("Spark's executors lack the environment variables EOP_DATABASE_URL")


def test_a_connect_url_is_shown_without_its_credentials() -> None:
    """The token and user of an sc:// URL stay out of messages; host and port stay in."""
    assert connect.shown("sc://u:pw@spark.example:15002/;token=abc;user_id=me") == (
        "sc://spark.example:15002"
    )
    assert connect.shown("sc://localhost") == "sc://localhost"


def test_connect_retries_fit_their_bound() -> None:
    """The backfill's waits (0.1 s doubling to 5 s) add up to no more than the bound."""
    for within_s in (0.05, 5.0, 30.0, 120.0):
        retries = connect.retries_within(within_s)
        waits = [min(0.1 * 2**i, 5.0) for i in range(retries)]
        assert sum(waits) <= within_s
        assert sum(waits) + min(0.1 * 2**retries, 5.0) > within_s
    assert connect.retries_within(30.0) == 10


class _Unavailable(Exception):
    """What grpc raises, as far as connect.lost reads it."""

    __module__ = "grpc._channel"

    def code(self) -> Any:
        return type("Code", (), {"name": "UNAVAILABLE"})()


def test_an_unanswering_connect_server_is_told_from_a_job_failure() -> None:
    """gRPC UNAVAILABLE, raw or as the cause of another error, is a lost server; a task's
    failure is not."""
    assert connect.lost(_Unavailable())
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = _Unavailable()
    assert connect.lost(wrapped)
    assert not connect.lost(RuntimeError(TASK))
    line = str(connect.lost_error("sc://h:15002/;token=secret", 30.0))
    assert line.startswith("the Spark Connect server sc://h:15002 does not answer")
    assert "secret" not in line
