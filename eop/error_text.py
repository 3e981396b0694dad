"""How eop describes an exception: in log lines, dead letters and one-line reports.

The text of a database error carries what must never be shown: a failed
statement's bound values, PostgreSQL's DETAIL (the failing row or key), the
values its messages quote. :func:`describe_error` and :func:`format_traceback`
describe such errors without them (docs/security.md); :mod:`eop.log`
re-exports them.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence

from sqlalchemy import exc as sa_exc

from eop import redaction

#: The most characters of a failure's description a dead letter, a parked retry or an
#: error line keeps.
ERROR_CHARS = 2000


#: The most characters of a failure's description a warning line or a one-line report
#: carries.
BRIEF_ERROR_CHARS = 500


def brief_error(exc: BaseException) -> str:
    """:func:`describe_error`, cut to :data:`BRIEF_ERROR_CHARS`: what a log line's ``error``
    or a one-line report carries."""
    return describe_error(exc)[:BRIEF_ERROR_CHARS]


def round_error(exc: BaseException) -> str:
    """:func:`brief_error`'s first line: what a warning of a background round that failed
    on an outage carries. The failed statement's SQL that follows it, eop's own,
    says nothing about the outage and took several lines of every such warning."""
    return brief_error(exc).split("\n", 1)[0]


def bounded_error(exc: BaseException) -> str:
    """:func:`describe_error`, cut to :data:`ERROR_CHARS`: what a dead letter, a parked
    retry or an error line records."""
    return describe_error(exc)[:ERROR_CHARS]


def describe_error(exc: BaseException) -> str:
    """``exc`` as ``Type: message``, for a log line or a dead letter's ``error``.

    A failed SQL statement's text from SQLAlchemy carries its bound values
    (``[parameters: ...]``: payload data), the driver's DETAIL (PostgreSQL
    quotes the failing row or key there), and often the refused value itself
    (``invalid input syntax for type integer: "..."``, asyncpg's ``invalid
    input for query argument $1: '...'``). Database errors are described by
    their driver's one-line message with the values masked
    (:func:`eop.redaction.scrub_values`) and, for a statement, its SQL. Any
    error's URLs are shown without their passwords, and ``password=`` values
    masked (:func:`eop.redaction.redact_text`).
    """
    chain = _chain(exc)
    values = _bound_values(chain)
    said = f"{type(exc).__name__}: {_message(exc, values, _below_database(exc, chain))}"
    # A handler's own error may quote a URL with its password (a client's connection
    # error): masked as eop masks its own URLs.
    return redaction.redact_text(said)


def format_traceback(exc: BaseException) -> str:
    """``exc``'s traceback, causes included, each database error as :func:`describe_error`
    says, and each exception a database error was raised from (an encoder's
    ``ValueError`` under asyncpg's ``DataError``) with its quoted values masked.

    A plain traceback prints a failed statement's bound values and the driver's
    DETAIL, for every SQLAlchemy and driver exception of the chain.
    """
    chain = _chain(exc)
    values = _bound_values(chain)
    top = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    pending: list[tuple[traceback.TracebackException, BaseException]] = [(top, exc)]
    while pending:
        te, err = pending.pop()
        if _scrubbed(err, values, _below_database(err, chain)) is not None:
            if "_str" not in vars(te):
                # The traceback module no longer keeps the message where we
                # replace it: keep the description, drop the frames.
                return describe_error(exc)
            vars(te)["_str"] = _message(err, values, _below_database(err, chain))
        # TracebackException mirrors the chain it was built from, link by link.
        if te.__cause__ is not None and err.__cause__ is not None:
            pending.append((te.__cause__, err.__cause__))
        if te.__context__ is not None and err.__context__ is not None:
            pending.append((te.__context__, err.__context__))
        members = getattr(te, "exceptions", None)  # an exception group's (3.11+)
        if members:
            pending.extend(zip(members, getattr(err, "exceptions", ()), strict=False))
    return redaction.redact_text("".join(top.format()))


def _message(exc: BaseException, values: Sequence[object] = (), below: bool = False) -> str:
    text = _scrubbed(exc, values, below)
    return _safe_str(exc) if text is None else text


def _scrubbed(exc: BaseException, values: Sequence[object], below: bool) -> str | None:
    """What may be said of ``exc`` when it is a database error, or was raised
    under one (``below``), or quotes text it could not encode; None: its own
    text is safe to show."""
    text = _database_message(exc)
    if text is not None:
        return redaction.scrub_values(text, values)
    if below or isinstance(exc, UnicodeError):
        return redaction.scrub_values(_safe_str(exc), values)
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it was raised from or during, each once."""
    seen: dict[int, BaseException] = {}
    pending = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen[id(current)] = current
        links = [current.__cause__, current.__context__, getattr(current, "orig", None)]
        pending.extend(e for e in links if isinstance(e, BaseException))
        pending.extend(
            e for e in getattr(current, "exceptions", ()) if isinstance(e, BaseException)
        )
    return list(seen.values())


def _bound_values(chain: list[BaseException]) -> list[object]:
    """The bound values of every failed statement in ``chain`` (to be masked wherever quoted)."""
    return [e.params for e in chain if isinstance(e, sa_exc.StatementError) and e.params]


def _below_database(exc: BaseException, chain: list[BaseException]) -> bool:
    """Whether a database error of ``chain`` was raised from or during ``exc``."""
    return any(
        err is not exc
        and _database_message(err) is not None
        and any(link is exc for link in _chain(err))
        for err in chain
    )


def _database_message(exc: BaseException) -> str | None:
    """What may be said of a database error before its values are masked (None: ``exc`` is
    not one)."""
    if isinstance(exc, sa_exc.StatementError):
        # The driver's error line and the SQL; without the parameters, the
        # driver's DETAIL lines and the background link SQLAlchemy appends.
        lines = [f"({detail})" for detail in exc.detail]
        lines.append(_first_line(_args_text(exc)))
        if exc.statement:
            lines.append(f"[SQL: {exc.statement}]")
        return "\n".join(lines)
    if isinstance(exc, sa_exc.SQLAlchemyError):
        return _args_text(exc)  # without the background link
    module = type(exc).__module__
    if module.split(".")[0] in _DRIVER_MODULES or module.startswith(_DJANGO_DB):
        # PostgreSQL's primary message is one line; DETAIL, HINT and CONTEXT
        # follow it and may quote the row or the values.
        return _first_line(_safe_str(exc))
    return None


# Drivers' exception modules; sqlalchemy's for the asyncpg dialect's emulated DBAPI errors.
_DRIVER_MODULES = ("asyncpg", "psycopg", "psycopg2", "sqlalchemy")

# Django re-raises its driver's errors as its own (django.db.utils.IntegrityError and
# the rest, django.db.transaction's), with the driver's whole text: DETAIL included.
_DJANGO_DB = "django.db"


def _args_text(exc: BaseException) -> str:
    # As SQLAlchemyError._message: its str() appends the background link to it.
    if len(exc.args) == 1:
        return str(exc.args[0])
    return str(exc.args) if exc.args else ""


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0]


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return "(its message cannot be printed)"
