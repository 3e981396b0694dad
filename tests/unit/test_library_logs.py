"""What libraries log through the stdlib's logging comes out as eop's own lines.

In eop's processes (where ``log.configure`` runs), a record of asyncio, nats-py,
SQLAlchemy, asyncpg or alembic is one ``library.log`` line of the configured
renderer, never Python's plain text (which breaks a JSON log pipeline), and
never the values the record was formatted with.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.runtime.migration import MigrationContext
from sqlalchemy import exc as sa_exc

from eop import log

ROOT = Path(__file__).resolve().parents[2]

SECRET = "payload-5e2b"


class _DriverError(Exception):
    """A driver's error whose text, like psycopg's, quotes the failing row on DETAIL."""


_DriverError.__module__ = "psycopg.errors"


def _integrity_error() -> sa_exc.IntegrityError:
    """An IntegrityError holding SECRET as a bound value and in its driver's DETAIL line."""
    try:
        try:
            raise _DriverError(
                'new row for relation "effects" violates check constraint "no_poison"\n'
                f"DETAIL:  Failing row contains (1, {SECRET})."
            )
        except _DriverError as orig:
            raise sa_exc.IntegrityError(
                "INSERT INTO effects (id, body) VALUES ($1, $2)", (1, SECRET), orig
            ) from orig
    except sa_exc.IntegrityError as exc:
        return exc


def _lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_library_warning_with_an_exception_is_one_json_line_without_its_values() -> None:
    """The record's logger, level and message template, its error described as eop's own
    errors are; neither its %-arguments nor the exception's bound values and DETAIL."""
    out = io.StringIO()
    log.configure("json", stream=out)
    logging.getLogger("sqlalchemy.pool").warning(
        "Exception closing connection %r", f"<conn {SECRET}>", exc_info=_integrity_error()
    )
    [line] = _lines(out)
    assert line["event"] == "library.log" == log.Event.LIBRARY_LOG
    assert line["logger"] == "sqlalchemy.pool"
    assert line["level"] == "warning"
    assert line["message"] == "Exception closing connection %r"
    assert str(line["error"]).startswith("IntegrityError: (psycopg.errors._DriverError) new row")
    assert line["pid"] == os.getpid()
    assert "timestamp" in line
    assert SECRET not in out.getvalue()
    assert "exception" not in line  # a warning's traceback: asyncpg repeats its own


def test_a_library_error_carries_its_traceback_sanitised() -> None:
    """From ERROR up the traceback is kept, as format_traceback writes it: frames, no values."""
    out = io.StringIO()
    log.configure("json", stream=out)
    try:
        raise RuntimeError("reset failed") from _integrity_error()
    except RuntimeError:
        logging.getLogger("sqlalchemy.pool.impl.QueuePool").exception(
            "Exception during reset or similar"
        )
    [line] = _lines(out)
    assert (line["level"], line["logger"]) == ("error", "sqlalchemy.pool.impl.QueuePool")
    assert "in test_a_library_error_carries_its_traceback_sanitised" in str(line["exception"])
    assert "RuntimeError: reset failed" in str(line["exception"])
    assert SECRET not in out.getvalue()


def test_configuring_twice_routes_each_library_record_once() -> None:
    """configure() is idempotent: one handler on the root logger, one line a record."""
    first, second = io.StringIO(), io.StringIO()
    log.configure("json", stream=first)
    log.configure("json", stream=second)
    logging.getLogger("nats.aio.client").error("nats: encountered error")
    assert first.getvalue() == ""
    assert [line["event"] for line in _lines(second)] == ["library.log"]


def test_library_records_use_the_configured_renderer() -> None:
    """Console lines for console output, as eop's own lines."""
    out = io.StringIO()
    log.configure("console", stream=out)
    logging.getLogger("asyncpg.pool").warning("Failed to restore the pool connection floor")
    [text] = out.getvalue().splitlines()
    assert "library.log" in text
    assert "[asyncpg.pool]" in text
    assert "message='Failed to restore the pool connection floor'" in text


def test_the_configured_level_filters_library_records_too() -> None:
    out = io.StringIO()
    log.configure("json", "error", stream=out)
    logging.getLogger("alembic.runtime.migration").warning("a warning below error")
    assert out.getvalue() == ""
    logging.getLogger("alembic.runtime.migration").error("an error")
    assert [line["message"] for line in _lines(out)] == ["an error"]


def test_the_default_level_lets_no_library_info_chatter_through() -> None:
    """configure() leaves the root logger's level alone: alembic's INFO lines, which a
    worker's schema check and each step of `eop db upgrade` write, stay out."""
    out = io.StringIO()
    log.configure("json", "info", stream=out)
    engine = sa.create_engine("sqlite://")
    with engine.connect() as conn:
        MigrationContext.configure(conn).get_current_heads()
    engine.dispose()
    assert out.getvalue() == ""


def test_a_library_logger_set_lower_on_purpose_gets_through_down_to_eops_level() -> None:
    out = io.StringIO()
    log.configure("json", "info", stream=out)
    chatty = logging.getLogger("alembic.runtime.migration")
    chatty.setLevel(logging.DEBUG)
    try:
        chatty.debug("below eop's level")
        chatty.info("Context impl %s.", "SQLiteImpl")
    finally:
        chatty.setLevel(logging.NOTSET)
    assert [(line["level"], line["message"]) for line in _lines(out)] == [
        ("info", "Context impl %s.")
    ]


def test_a_message_built_beforehand_has_its_quoted_values_and_passwords_masked() -> None:
    """A library that formats its message itself (an f-string, asyncio's report of a
    task) leaves the values in the template: quoted ones and URLs' passwords are masked."""
    out = io.StringIO()
    log.configure("json", stream=out)
    logging.getLogger("somelib").error(
        f"cannot reach postgresql://app:s3cr3t@db/app for row '{SECRET}'"
    )
    [line] = _lines(out)
    assert line["message"] == "cannot reach postgresql://app:***@db/app for row '***'"


def test_a_message_that_is_an_exception_or_an_object_shows_no_values() -> None:
    """``logger.error(exc)`` is described as eop's errors are; another object by its type."""
    out = io.StringIO()
    log.configure("json", stream=out)
    logging.getLogger("somelib").error(_integrity_error())
    logging.getLogger("somelib").error({"body": SECRET})
    first, second = _lines(out)
    assert str(first["message"]).startswith("IntegrityError: ")
    assert second["message"] == "(dict)"
    assert SECRET not in out.getvalue()


def test_the_applications_own_record_keeps_its_formatted_message() -> None:
    """A handler's own ``logging.getLogger(__name__).warning("order %s rejected", n)``
    says what the application chose to say: formatted, its quoted values masked. Only
    the libraries' records are cut to their templates."""
    out = io.StringIO()
    log.configure("json", stream=out)
    logging.getLogger("orders.handlers").warning("order %s rejected", 42)
    logging.getLogger("orders.handlers").warning("note %s", f"'{SECRET}'")
    logging.getLogger("sqlalchemy.pool").warning("order %s rejected", 42)
    first, second, library = _lines(out)
    assert (first["logger"], first["message"]) == ("orders.handlers", "order 42 rejected")
    assert second["message"] == "note '***'"
    assert library["message"] == "order %s rejected"


def test_a_record_that_cannot_be_written_is_dropped_without_printing_its_arguments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The stdlib's report of a failed handler prints the record's message and arguments
    on stderr: this handler's says nothing."""
    out = io.StringIO()
    log.configure("json", stream=out)
    out.close()
    logging.getLogger("somelib").warning("row %s", SECRET)
    assert SECRET not in capsys.readouterr().err


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_python_warning_is_one_line_with_its_category_and_its_quoted_values_masked() -> None:
    """Python's warnings (SQLAlchemy's, a DeprecationWarning) print as two plain lines of
    their own otherwise: after configure() each is a ``library.log`` line of logger
    ``py.warnings`` with its category and where it was raised, its quoted values masked."""
    out = io.StringIO()
    with warnings.catch_warnings():  # puts Python's own showwarning back after
        warnings.simplefilter("always")
        log.configure("json", stream=out)
        warnings.warn(
            f"connection for '{SECRET}' was never checked in", RuntimeWarning, stacklevel=1
        )
    (line,) = _lines(out)
    assert line["event"] == "library.log"
    assert line["logger"] == "py.warnings"
    assert line["level"] == "warning"
    assert line["category"] == "RuntimeWarning"
    assert str(line["source"]).startswith(__file__)
    assert str(line["message"]).startswith("connection for ")
    assert SECRET not in out.getvalue()


def test_importing_eop_leaves_the_stdlibs_logging_alone() -> None:
    """An application embedding eop keeps its own logging: only log.configure() (eop's
    processes) puts a handler on the root logger."""
    done = _python(
        "import logging, eop, eop.cli, eop.log, eop.outbox, eop.runtime.worker\n"
        "print(logging.getLogger().handlers, logging.getLogger().level)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"[] {logging.WARNING}"


# Real libraries logging through the stdlib: SQLAlchemy's pool, whose connection's
# rollback fails with a driver's error quoting the row, and asyncio, reporting a task
# whose exception nobody retrieved (its repr quoting the value).
_LIBRARIES_LOGGING = f"""
import asyncio
import warnings
from sqlalchemy import pool
from eop import log

SECRET = {SECRET!r}

class DriverError(Exception):
    pass

DriverError.__module__ = "psycopg.errors"

class Connection:
    def rollback(self):
        raise DriverError("connection lost\\nDETAIL:  Failing row contains (" + SECRET + ").")

    def close(self):
        pass

log.configure("json")
pool.QueuePool(Connection).connect().close()

async def fails():
    raise ValueError("'" + SECRET + "' refused")

async def main():
    asyncio.ensure_future(fails())
    await asyncio.sleep(0.01)
    warnings.warn("a warning of " + repr(SECRET), RuntimeWarning)

asyncio.run(main())
"""


def test_a_process_configured_for_json_writes_only_json_lines_on_stderr() -> None:
    """Every stderr line of a process whose libraries log is a JSON object, and none holds
    the values their messages and exceptions carried."""
    done = _python(_LIBRARIES_LOGGING)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [line["event"] for line in lines] == ["library.log"] * 3, done.stderr
    by_logger = {line["logger"]: line for line in lines}
    assert by_logger["py.warnings"]["category"] == "RuntimeWarning"
    reset = by_logger["sqlalchemy.pool.impl.QueuePool"]
    assert reset["message"] == "Exception during reset or similar"
    assert "psycopg.errors.DriverError: connection lost" in str(reset["exception"])
    assert SECRET not in json.dumps(reset)
    task = by_logger["asyncio"]
    assert str(task["message"]).startswith("Task exception was never retrieved")
    # The ValueError is the program's own: its text is shown, as eop shows it in its own
    # lines (docs/security.md); the repr asyncio quoted it in is masked.
    assert SECRET not in str(task["message"])
    assert str(task["error"]) == f"ValueError: '{SECRET}' refused"


# An eop command whose prepare hook logs a library warning, then stops the command.
_COMMAND_UNDER = """
import logging, sys
from eop import cli, errors
{host}

def prepare():
    logging.getLogger("sqlalchemy.pool").warning("Exception during reset or similar")
    raise errors.ConfigurationError("stopped before the command")

sys.exit(cli.main(["--log-format", "json", "db", "current"], prepare=prepare))
"""


@pytest.mark.parametrize("host", [False, True])
def test_an_eop_command_routes_library_records_unless_the_host_configured_logging(
    host: bool,
) -> None:
    """``eop worker`` from a shell: a library's record is eop's JSON line. Under a host
    whose logging put handlers on the root logger (a Django project's LOGGING under
    ``manage.py eop worker``), the host's handler prints it, in its format, and eop
    adds no second line."""
    setup = 'logging.basicConfig(format="HOST %(name)s %(message)s")' if host else ""
    done = _python(_COMMAND_UNDER.format(host=setup))
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    # The command's last words are a JSON line too (--log-format json).
    last = json.loads(lines[-1])
    assert (last["event"], last["error"]) == ("command.failed", "stopped before the command")
    if host:
        assert lines[:-1] == ["HOST sqlalchemy.pool Exception during reset or similar"]
    else:
        (line,) = (json.loads(text) for text in lines[:-1])
        assert (line["event"], line["logger"]) == ("library.log", "sqlalchemy.pool")
