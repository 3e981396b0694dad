"""PostgreSQL gone inside a block: :class:`eop.DatabaseUnavailable`, in the caller's words."""

from __future__ import annotations

import pytest

from eop import errors
from eop.pg import failures


def test_an_unreachable_server_becomes_database_unavailable_with_the_first_line() -> None:
    """By default the message is "PostgreSQL is unreachable: " and the error's first line,
    as :func:`eop.pg.failures.connected` says it, the error kept as the cause."""
    refused = ConnectionRefusedError("[Errno 111] Connect call failed\nmore detail")
    with pytest.raises(errors.DatabaseUnavailable) as info, failures.unavailable_when_unreachable():
        raise refused
    assert str(info.value) == "PostgreSQL is unreachable: [Errno 111] Connect call failed"
    assert info.value.__cause__ is refused


def test_the_caller_names_the_failure_and_how_the_error_is_described() -> None:
    """``what`` and ``describe`` make the message (the audit's, Spark's)."""
    with (
        pytest.raises(errors.DatabaseUnavailable, match=r"^during the audit: OSError!$"),
        failures.unavailable_when_unreachable("during the audit", lambda e: "OSError!"),
    ):
        raise OSError("reset")


def test_an_error_that_is_not_the_servers_absence_passes_through() -> None:
    """A handler's or a statement's error is not translated."""
    with pytest.raises(ValueError, match="a bug"), failures.unavailable_when_unreachable():
        raise ValueError("a bug")
