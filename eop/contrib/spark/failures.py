"""What a Spark failure says, in one line: the root cause, and the fix when eop knows it.

A failed task reaches the driver as a Py4J or PySpark error whose first line
is only "An exception was thrown from the Python worker:" or "Job aborted
due to stage failure"; the cause is the last exception line of the Python
traceback inside it, or the ``java...Exception`` line of a JVM error.
"""

from __future__ import annotations

import re

_EOP_ERROR = re.compile(r"^\s*(eop(?:\.\w+)*\.\w+): (.+)$", re.MULTILINE)
#: A Python traceback's last line: ``ModuleNotFoundError: No module named 'x'``.
_PYTHON_ERROR = re.compile(
    r"^((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Warning)): (.*)$",
    re.MULTILINE,
)
#: A JVM exception line, as it stands in a stack trace or after "Caused by: ".
_JAVA_ERROR = re.compile(
    r"^(?:Caused by: )?((?:java|javax|scala|org|io|com)\.[\w.$]+(?:Exception|Error))(?:: (.*))?$",
    re.MULTILINE,
)
#: What a SparkException says, wherever it stands (a task's failure is quoted mid-line).
_SPARK_SAYS = re.compile(r"SparkException: ((?:(?!\S*SparkException: )[^\n])+)")
_GENERIC = ("Job aborted", "Task failed")
_JVM_PACKAGES = ("java.", "javax.", "scala.", "org.", "io.", "com.")
#: Wrappers that carry a cause rather than being one.
_WRAPPERS = (
    "org.apache.spark.api.python.PythonException",
    "py4j.protocol.Py4JJavaError",
    "org.apache.spark.SparkException",
)
_CONDITION = re.compile(r"^\[([A-Z_.]+)\]")
_MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")
#: Modules the Python that Spark runs must have: eop[spark]'s.
ENVIRONMENT_MODULES = ("eop", "pyarrow", "pyspark", "sqlalchemy", "psycopg", "nats")

PYTHON_HINT = (
    "point PYSPARK_PYTHON (eop spark --python, EOP_SPARK_PYTHON) at a Python with "
    "eop[spark] installed, on the driver and on every executor"
)
APP_HINT = (
    "ship the app's code with --py-files (EOP_SPARK_PY_FILES, spark.submit.pyFiles) "
    "or install it in the executors' Python"
)


def summary(exc: BaseException) -> str:
    """One line for a failed Spark call: the eop error it carries, else its root cause."""
    return summary_of(str(exc), type(exc).__name__)


def summary_of(text: str, fallback: str = "the Spark job failed") -> str:
    """:func:`summary` of an error's text."""
    found = _EOP_ERROR.findall(text)
    if found:
        name, message = found[-1]
        return f"{message.strip()} ({name.rsplit('.', 1)[-1]})"
    cause = root_cause(text)
    first = text.strip().splitlines()[0].strip() if text.strip() else fallback
    condition = _CONDITION.match(first)
    if cause is None:
        return first[:500]
    prefix = f"[{condition.group(1)}] " if condition else ""
    return f"{prefix}{cause}"[:500]


def root_cause(text: str) -> str | None:
    """The last Python exception line in ``text``, else its deepest JVM exception line."""
    python = [
        (n, m)
        for n, m in _PYTHON_ERROR.findall(text)
        if not _is_wrapper(n) and not n.startswith(_JVM_PACKAGES)
    ]
    if python:
        name, message = python[-1]
        return f"{name.rsplit('.', 1)[-1]}: {message.strip()}"
    java = [(n, m) for n, m in _JAVA_ERROR.findall(text) if not _is_wrapper(n)]
    if java:
        name, message = java[-1]
        if message.strip():
            return f"{name}: {message.strip()}"
        # A bare cause (an executor's Python worker crashed: java.io.EOFException) says
        # less than the innermost SparkException, which tells what happened.
        said = [m.strip() for m in _SPARK_SAYS.findall(text) if not m.startswith(_GENERIC)]
        return f"{said[-1]} ({name})" if said else name
    return None


def hint(text: str, app_module: str | None = None) -> str | None:
    """The fix for a failure whose text says that a module was missing, if eop knows it."""
    match = _MISSING_MODULE.search(text)
    if match is None:
        return None
    top = match.group(1).split(".")[0]
    if top in ENVIRONMENT_MODULES:
        return PYTHON_HINT
    if app_module is not None and top == app_module.split(".")[0]:
        return APP_HINT
    return None


def _is_wrapper(name: str) -> bool:
    return name in _WRAPPERS or name.startswith(("py4j.", "pyspark.errors"))
