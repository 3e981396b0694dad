"""Secrets never reach a log line: URL and header redaction, and the configured output."""

from __future__ import annotations

import io
import json
import os
import sys
import traceback

import asyncpg
import pytest
import structlog
from sqlalchemy import exc as sa_exc

import eop
from eop import log, redaction

# ------------------------------------------------------------------ redact_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "postgresql+asyncpg://app:s3cr3t@db.example:5432/app",
            "postgresql+asyncpg://app:***@db.example:5432/app",
        ),
        ("nats://alice:s3cr3t@nats.example:4222", "nats://alice:***@nats.example:4222"),
        ("postgresql://app:p@ss@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app:@db/app", "postgresql://app:***@db/app"),
    ],
    ids=["postgres", "nats-user-password", "at-sign-in-password", "empty-password"],
)
def test_redact_url_hides_the_password(url: str, expected: str) -> None:
    assert redaction.redact_url(url) == expected


@pytest.mark.parametrize(
    "url",
    ["nats://s3cr3tT0ken@nats.example:4222", "nats://s3cr3tT0ken@nats.example"],
)
def test_redact_url_hides_a_token_in_the_user_part_whole(url: str) -> None:
    """nats://TOKEN@host: a user part without a password may be a token."""
    redacted = redaction.redact_url(url)
    assert "s3cr3t" not in redacted
    assert redacted.startswith("nats://***@nats.example")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://db/app?password=s3cr3t", "postgresql://db/app?password=***"),
        (
            "postgresql://db/app?sslmode=require&sslpassword=s3cr3t&application_name=eop",
            "postgresql://db/app?sslmode=require&sslpassword=***&application_name=eop",
        ),
        ("nats://host:4222?token=s3cr3t", "nats://host:4222?token=***"),
        ("http://host/?client_secret=s3cr3t&x=1", "http://host/?client_secret=***&x=1"),
        ("postgresql://db/app?PASSWORD=s3cr3t", "postgresql://db/app?PASSWORD=***"),
    ],
)
def test_redact_url_hides_secrets_in_the_query(url: str, expected: str) -> None:
    assert redaction.redact_url(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+asyncpg://127.0.0.1:5432/postgres",
        "nats://127.0.0.1:4222",
        "postgresql://db/app?host=/tmp/pg&sslmode=disable",
    ],
)
def test_redact_url_leaves_urls_without_secrets_alone(url: str) -> None:
    assert redaction.redact_url(url) == url


def test_redact_url_of_an_unparsable_url_hides_its_user_part() -> None:
    """A URL urlsplit would reject still loses everything before its last '@'."""
    assert "s3cr3t" not in redaction.redact_url("http://[::1:s3cr3t@host")


def test_redact_url_of_a_libpq_keyword_string_hides_the_password() -> None:
    assert "s3cr3t" not in redaction.redact_url("host=db password=s3cr3t dbname=app")


@pytest.mark.parametrize("password", ["pa/ss", "pa#ss", "pa?ss"])
def test_redact_url_hides_a_password_with_url_delimiters(password: str) -> None:
    assert password not in redaction.redact_url(f"postgresql+asyncpg://app:{password}@db/app")


def test_redact_urls_redacts_each_of_a_comma_separated_list() -> None:
    urls = "nats://a:s3cr3t@n1:4222, nats://tok3n@n2:4222,nats://n3:4222"
    assert redaction.redact_urls(urls) == "nats://a:***@n1:4222,nats://***@n2:4222,nats://n3:4222"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "cannot reach postgresql+asyncpg://app:s3cr3t@db:5432/app (refused)",
            "cannot reach postgresql+asyncpg://app:***@db:5432/app (refused)",
        ),
        ("servers nats://s3cr3t@n1:4222 down", "servers nats://***@n1:4222 down"),
        ("host=db password=s3cr3t", "host=db password=***"),
        ("host=db password=s3cr3t dbname=app", "host=db password=*** dbname=app"),
        ("host=db password='s3 cr3t' dbname=app", "host=db password=*** dbname=app"),
        ('call(token="s3 cr3t")\nnext line', "call(token=***)\nnext line"),
        ("Exception closing connection %r", "Exception closing connection %r"),
    ],
)
def test_redact_text_hides_the_passwords_of_the_urls_in_a_text(text: str, expected: str) -> None:
    assert redaction.redact_text(text) == expected


# -------------------------------------------------------------- redact_headers


@pytest.mark.parametrize(
    "name",
    [
        "Authorization",
        "authorization",
        "Proxy-Authorization",
        "X-Api-Key",
        "api_key",
        "Cookie",
        "Set-Cookie",
        "X-Auth-Token",
        "X-Client-Secret",
        "X-Password",
        "X-Signature",
        "Session-Id",
        "Nats-Nkey",
        "X-JWT",
        "X-Credentials",
    ],
)
def test_redact_headers_hides_credential_headers(name: str) -> None:
    assert redaction.redact_headers({name: "s3cr3t"}) == {name: redaction.REDACTED}


def test_redact_headers_keeps_ordinary_headers() -> None:
    headers = {"Nats-Msg-Id": "m-1", "Content-Type": "application/json", "X-Trace": "t"}
    assert redaction.redact_headers(headers) == headers


def test_redact_headers_returns_a_copy() -> None:
    headers = {"Authorization": "Bearer s3cr3t"}
    redaction.redact_headers(headers)
    assert headers == {"Authorization": "Bearer s3cr3t"}


# ------------------------------------------------------------------- configure


def test_json_log_lines_carry_event_level_and_plain_enum_values() -> None:
    out = io.StringIO()
    log.configure("json", "info", stream=out)
    log.get_logger(handler="orders").info(log.Event.MESSAGE_PROCESSED, action=log.Action.ACK)
    line = json.loads(out.getvalue())
    assert line["event"] == "message.processed"
    assert line["action"] == "ack"
    assert line["level"] == "info"
    assert line["handler"] == "orders"
    assert "timestamp" in line


class _Writes(io.StringIO):
    """A stream that records each write() call."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_each_log_line_is_one_write_so_processes_sharing_stderr_never_split_lines() -> None:
    out = _Writes()
    log.configure("json", "info", stream=out)
    log.get_logger(handler="orders").info(log.Event.MESSAGE_PROCESSED)
    log.get_logger().warning(log.Event.ACK_GAVE_UP)
    assert len(out.writes) == 2
    assert all(w.endswith("\n") and w.count("\n") == 1 for w in out.writes)
    assert [json.loads(w)["event"] for w in out.writes] == ["message.processed", "ack.gave_up"]


def test_configured_level_filters_lower_levels() -> None:
    out = io.StringIO()
    log.configure("console", "warning", stream=out)
    logger = log.get_logger()
    logger.info(log.Event.WORKER_STARTED)
    logger.warning(log.Event.ACK_GAVE_UP)
    assert "worker.started" not in out.getvalue()
    assert "ack.gave_up" in out.getvalue()


def test_get_logger_binds_the_given_context() -> None:
    with structlog.testing.capture_logs() as logs:
        log.get_logger(handler="orders", seq=3).info("x")
    assert logs[0]["handler"] == "orders"
    assert logs[0]["seq"] == 3


def test_lazy_logger_drops_lines_below_the_configured_level_without_binding() -> None:
    out = io.StringIO()
    log.configure("console", "info", stream=out)
    logger = log.LazyLogger(handler="orders", seq=3)
    logger.debug(log.Event.MESSAGE_PROCESSED)
    assert logger._bound is None
    assert out.getvalue() == ""
    logger.info(log.Event.MESSAGE_DUPLICATE, action=log.Action.ACK)
    assert "message.duplicate" in out.getvalue()
    assert "handler=orders" in out.getvalue()


def test_lazy_logger_logs_debug_lines_when_debug_is_enabled() -> None:
    out = io.StringIO()
    log.configure("json", "debug", stream=out)
    log.LazyLogger(handler="orders").bind(seq=4).debug(log.Event.MESSAGE_PROCESSED)
    line = json.loads(out.getvalue())
    assert (line["event"], line["handler"], line["seq"]) == ("message.processed", "orders", 4)


# ------------------------------------------------- describe_error, format_traceback

SECRET = "payload-7c1d"


class _DriverError(Exception):
    """A driver's error whose text, like psycopg's, quotes the failing row on DETAIL."""


_DriverError.__module__ = "psycopg.errors"

_DRIVER_TEXT = (
    'new row for relation "effects" violates check constraint "no_poison"\n'
    f"DETAIL:  Failing row contains (1, {SECRET})."
)
_SQL = "INSERT INTO effects (handler, body) VALUES ($1, $2)"


def _integrity_error() -> sa_exc.IntegrityError:
    """A real IntegrityError, raised from its driver error as SQLAlchemy raises it."""
    try:
        try:
            raise _DriverError(_DRIVER_TEXT)
        except _DriverError as orig:
            raise sa_exc.IntegrityError(_SQL, ("checked", SECRET), orig) from orig
    except sa_exc.IntegrityError as exc:
        return exc


def test_a_statement_error_is_described_by_its_sql_and_driver_line_not_its_parameters() -> None:
    exc = _integrity_error()
    assert SECRET in str(exc)  # what SQLAlchemy itself prints: the reason for describe_error
    assert log.describe_error(exc) == (
        "IntegrityError: (psycopg.errors._DriverError) new row for relation "
        '"effects" violates check constraint "no_poison"\n'
        f"[SQL: {_SQL}]"
    )


def test_a_statement_error_description_keeps_sqlalchemys_own_detail_lines() -> None:
    exc = _integrity_error()
    exc.add_detail("raised as a result of Query-invoked autoflush")
    described = log.describe_error(exc)
    assert described.startswith(
        "IntegrityError: (raised as a result of Query-invoked autoflush)\n(psycopg.errors."
    )
    assert SECRET not in described


def test_a_driver_error_is_described_by_its_first_line_only() -> None:
    """asyncpg's and psycopg's texts carry PostgreSQL's DETAIL, which quotes the row."""
    orig = asyncpg.exceptions.CheckViolationError('violates check constraint "no_poison"')
    orig.detail = f"Failing row contains (1, {SECRET})."
    assert SECRET in str(orig)
    assert log.describe_error(orig) == (
        'CheckViolationError: violates check constraint "no_poison"'
    )


def test_a_sqlalchemy_error_is_described_without_its_background_link() -> None:
    exc = sa_exc.InvalidRequestError("this session is closed", code="xd1r")
    assert "sqlalche.me" in str(exc)
    assert log.describe_error(exc) == "InvalidRequestError: this session is closed"


def test_other_errors_are_described_by_their_whole_text() -> None:
    assert log.describe_error(ValueError("bad\nworse")) == "ValueError: bad\nworse"


def test_the_traceback_of_a_statement_error_holds_neither_its_parameters_nor_the_row() -> None:
    """Every exception of the chain is scrubbed, the handler's own wrapper included."""

    def handler() -> None:
        raise RuntimeError("the handler gave up") from _integrity_error()

    with pytest.raises(RuntimeError, match="gave up") as raised:
        handler()
    tb = log.format_traceback(raised.value)
    assert SECRET not in tb
    assert "[parameters:" not in tb
    assert "sqlalche.me" not in tb
    assert "in handler" in tb  # the frames are kept
    assert "RuntimeError: the handler gave up" in tb
    assert "sqlalchemy.exc.IntegrityError: (psycopg.errors._DriverError) new row" in tb
    assert f"[SQL: {_SQL}]" in tb
    assert tb.count("violates check constraint") == 2  # the driver's and SQLAlchemy's


def test_the_traceback_of_other_errors_is_the_standard_one() -> None:
    with pytest.raises(ValueError, match="plain") as raised:
        raise ValueError("plain")
    exc = raised.value
    assert log.format_traceback(exc) == "".join(traceback.format_exception(exc))


def test_the_engines_eop_makes_hide_bound_values() -> None:
    """Defence in depth: SQLAlchemy's own texts and echo logs of eop's engines hide them."""
    app = eop.App(database_url="postgresql+asyncpg://app@db.example/app")
    assert app.engine.sync_engine.hide_parameters
    bind = app.sync_sessionmaker.kw["bind"]
    assert bind.hide_parameters


def test_each_line_names_its_process() -> None:
    """The processes of one `eop worker` share stderr: every line carries its pid."""
    stream = io.StringIO()
    log.configure("json", "info", stream=stream)
    try:
        log.get_logger().info(log.Event.WORKER_STARTED)
    finally:
        log.configure()
    assert json.loads(stream.getvalue())["pid"] == os.getpid()


def test_default_output_is_the_stderr_of_the_moment_not_of_configure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Configured without a stream, lines go to whatever sys.stderr is when they are
    logged: a host (or a test runner's capture) that swaps and closes stderr after
    configure() must not make every later line raise on a closed file."""
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    log.configure("json")
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    log.get_logger().info(log.Event.WORKER_STARTING)
    assert "worker.starting" in second.getvalue()
