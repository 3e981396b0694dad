"""Bound values masked in database error text: eop.redaction.scrub_values and its use by eop.log."""

from __future__ import annotations

import asyncpg
import psycopg
import pytest
import sqlalchemy.exc as sa_exc

from eop import log
from eop.redaction import scrub_values

CANARY = "CANARY-4b1d"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # asyncpg's encoder refusal quotes the argument (its repr, cut at 40 characters).
        (
            f"invalid input for query argument $1: '{CANARY}' "
            "('str' object cannot be interpreted as an integer)",
            "invalid input for query argument $1: *** "
            "('str' object cannot be interpreted as an integer)",
        ),
        (
            f"invalid input for query argument $2: {repr(CANARY * 5)[:40]}... "
            f"(invalid literal for int() with base 10: '{CANARY}')",
            "invalid input for query argument $2: *** "
            "(invalid literal for int() with base 10: '***')",
        ),
        (
            "invalid input for query argument $1: 'a (b' (expected str, got int)",
            "invalid input for query argument $1: *** (expected str, got int)",
        ),
        # PostgreSQL's primary messages quote the refused value.
        (
            f'invalid input syntax for type integer: "{CANARY}"',
            'invalid input syntax for type integer: "***"',
        ),
        (
            f'value "{CANARY}" is out of range for type integer',
            'value "***" is out of range for type integer',
        ),
        (
            f'invalid input value for enum mood: "{CANARY}"',
            'invalid input value for enum mood: "***"',
        ),
        # A value holding a newline: the first line ends inside the quotes.
        (
            f'invalid input syntax for type date: "{CANARY}',
            'invalid input syntax for type date: "***',
        ),
        # DETAIL lines, should one come through.
        (f"Key (sku)=({CANARY}) already exists.", "Key (sku)=(***) already exists."),
        (f"Failing row contains (1, {CANARY}).", "Failing row contains (***)."),
        (
            'invalid byte sequence for encoding "UTF8": 0xe2 0x28',
            'invalid byte sequence for encoding "UTF8": 0x***',
        ),
    ],
)
def test_values_quoted_by_the_database_or_driver_are_masked(text: str, expected: str) -> None:
    assert scrub_values(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        'duplicate key value violates unique constraint "effects_pkey"',
        'new row for relation "effects" violates check constraint "no_poison"',
        'column "nope" of relation "effects" does not exist',
        "value too long for type character varying(5)",
        'invalid byte sequence for encoding "UTF8": 0x00',
        "PostgreSQL text fields cannot contain NUL (0x00) bytes",
        "'utf-8' codec can't decode byte",
    ],
)
def test_names_of_relations_constraints_columns_and_encodings_are_kept(text: str) -> None:
    assert scrub_values(text) == text


def test_known_bound_values_are_masked_wherever_they_appear_unquoted() -> None:
    """Values of at least 4 characters, nested in dicts and lists, as text or repr."""
    params = {"a": [CANARY], "b": {"c": b"bytes-canary"}, "d": 7}
    text = f"x {CANARY} y bytes-canary z 7"
    assert scrub_values(text, [params]) == "x *** y *** z 7"


def _statement_error(text: str, params: object) -> sa_exc.DBAPIError:
    try:
        try:
            raise asyncpg.exceptions.DataError(text)
        except asyncpg.exceptions.DataError as orig:
            raise sa_exc.DBAPIError("INSERT INTO t (n) VALUES ($1)", params, orig) from orig
    except sa_exc.DBAPIError as exc:
        return exc


def test_describe_error_and_traceback_mask_what_the_driver_quotes_and_what_it_was_raised_from() -> (
    None
):
    """asyncpg's DataError is raised from the encoder's ValueError, which quotes the value too."""

    def encode() -> None:
        try:
            int(CANARY)
        except ValueError as cause:
            try:
                raise asyncpg.exceptions.DataError(
                    f"invalid input for query argument $1: '{CANARY}' ({cause})"
                ) from cause
            except asyncpg.exceptions.DataError as orig:
                raise sa_exc.DBAPIError("INSERT INTO t (n) VALUES ($1)", (CANARY,), orig) from orig

    with pytest.raises(sa_exc.DBAPIError) as raised:
        encode()
    assert CANARY in str(raised.value)
    described = log.describe_error(raised.value)
    assert CANARY not in described
    assert "query argument $1: ***" in described
    tb = log.format_traceback(raised.value)
    assert CANARY not in tb
    assert "ValueError: invalid literal for int() with base 10: '***'" in tb
    assert "in encode" in tb


def test_djangos_database_errors_are_scrubbed_as_their_drivers_are() -> None:
    """A Django handler's database error is Django's own (``django.db.utils``), raised from
    psycopg's with the same text: its DETAIL and CONTEXT lines and the values they quote
    are dropped from the description and the traceback, the constraint's name kept."""
    from django.db import utils as django_db

    text = (
        'duplicate key value violates unique constraint "shop_payment_ref_key"\n'
        f"DETAIL:  Key (ref)=({CANARY}) already exists.\n"
        'CONTEXT:  while updating tuple (1,83) in relation "shop_account"'
    )
    try:
        try:
            raise psycopg.errors.UniqueViolation(text)
        except psycopg.errors.UniqueViolation as driver:
            raise django_db.IntegrityError(*driver.args) from driver
    except django_db.IntegrityError as exc:
        described = log.describe_error(exc)
        tb = log.format_traceback(exc)
    assert described == (
        'IntegrityError: duplicate key value violates unique constraint "shop_payment_ref_key"'
    )
    for shown in (described, tb):
        assert CANARY not in shown
        assert "DETAIL" not in shown
        assert "CONTEXT" not in shown
    assert "django.db.utils.IntegrityError" in tb


def test_a_handlers_own_error_raised_from_a_database_error_keeps_its_text() -> None:
    """Only database errors and what they were raised from are scrubbed: a handler's own
    message is its author's (eop cannot tell its words from its data)."""
    db = _statement_error(f'invalid input syntax for type integer: "{CANARY}"', {"n": CANARY})
    try:
        raise RuntimeError("order 'A-1' refused") from db
    except RuntimeError as exc:
        tb = log.format_traceback(exc)
    assert "RuntimeError: order 'A-1' refused" in tb
    assert CANARY not in tb


def test_a_line_logged_with_exc_info_carries_the_scrubbed_traceback() -> None:
    """A safety net: should any line be logged with exc_info, its traceback is
    format_traceback's, not structlog's plain one."""
    import io
    import json

    stream = io.StringIO()
    log.configure("json", "info", stream=stream)
    db = _statement_error(f'invalid input syntax for type integer: "{CANARY}"', {"n": CANARY})
    try:
        raise db
    except sa_exc.DBAPIError:
        log.get_logger().error("some.event", exc_info=True)
    log.get_logger().error("other.event", exc_info=db)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert "DBAPIError" in line["exception"]
        assert CANARY not in json.dumps(line)


def test_a_url_password_quoted_by_any_error_is_masked_in_its_description_and_traceback() -> None:
    """A handler's own error (a client's connection error) may quote a URL with its
    password: the dead letter's error and traceback, and the log lines, show the URL
    without it, the rest of the error's text kept."""
    try:
        raise ConnectionError(f"upstream postgresql://appuser:{CANARY}@10.0.0.1/db failed")
    except ConnectionError as exc:
        described, tb = log.describe_error(exc), log.format_traceback(exc)
    assert described == "ConnectionError: upstream postgresql://appuser:***@10.0.0.1/db failed"
    assert "postgresql://appuser:***@10.0.0.1/db failed" in tb
    assert CANARY not in tb
