"""What went wrong in the database, in eop's terms: the edge where driver errors are translated.

:func:`classify` names the kind of a failure (a conflict, a lock timeout, a
lost connection, a busy or read-only server, a misconfiguration, or none of
those), whichever driver raised it; :data:`INFRASTRUCTURE` are the kinds that
are never a handler's fault, so :func:`transient` retries them without
counting. :func:`misconfiguration` says which fix a misconfiguration needs.
:func:`translate_claim_errors` says what a failed claim means for its message.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import sqlalchemy.exc as sa_exc

from eop import errors, log

T = TypeVar("T")


class DbFailure(enum.Enum):
    """How the protocol reacts to a database error."""

    CONFLICT = "conflict"
    """40001 / 40P01: retry the whole transaction."""
    LOCK_TIMEOUT = "lock_timeout"
    """55P03: another delivery holds the key; nak with a delay."""
    CONNECTION = "connection"
    """The connection is gone: retry the transaction (or, during COMMIT, the outcome is unknown)."""
    BUSY = "busy"
    """The database cannot serve now (statement timeout, read-only, out of connections or
    resources, a pool with no free connection): retry the transaction later."""
    MISCONFIGURED = "misconfigured"
    """Fails the same way on every attempt until the configuration or the schema changes
    (:func:`misconfiguration`): retried uncounted while the worker stops
    (:mod:`eop.protocol.misconfiguration`)."""
    OTHER = "other"


class Misconfiguration(enum.Enum):
    """What a :attr:`DbFailure.MISCONFIGURED` failure needs fixed."""

    POOLER = "pooler"
    """A transaction-mode pooler lost or doubled a prepared statement: ``db_pooler``."""
    SCHEMA = "schema"
    """A table, column, function, type or schema the statement names does not exist:
    a migration that did not run, or another database or schema."""
    LOGIN = "login"
    """The server refuses a new connection's role, password or database while the
    worker runs: a rotated password, a pg_hba.conf change, a dropped role or database."""


#: Failures of the database, not of a handler: they never count as a message's attempt.
INFRASTRUCTURE = frozenset(
    {
        DbFailure.CONFLICT,
        DbFailure.LOCK_TIMEOUT,
        DbFailure.CONNECTION,
        DbFailure.BUSY,
        DbFailure.MISCONFIGURED,
    }
)

_CONFLICT_STATES = {"40001", "40P01"}
# 57014: statement timeout (or a cancel request); 25006: read-only transaction (a
# standby, or default_transaction_read_only); class 53: insufficient resources
# (too many connections, disk full, out of memory); 55006: object in use.
_BUSY_STATES = {"57014", "25006", "55006"}
# 42P05 / 26000: a prepared statement already exists / does not exist: what a
# transaction-mode pooler does to a connection that caches statements
# (db_pooler set to none or session in front of one). Never a handler's fault.
_POOLER_STATES = {"42P05", "26000"}
# undefined_table, undefined_column, undefined_function (operators too),
# undefined_object (a type...), invalid_schema_name: the statement is the same
# for every message, so is the answer, until a migration runs. Dead-lettering
# would cost good messages for a deployment's mistake.
_SCHEMA_STATES = {"42P01", "42703", "42883", "42704", "3F000"}
# 57P01-57P03: the server is shutting down or terminated the backend;
# class 08: connection exceptions.
_CONNECTION_STATES = {"57P01", "57P02", "57P03"}
# 28000 / 28P01: the server refuses the role or its password (pg_hba.conf, a wrong
# password); 3D000: no such database. Connecting again cannot change the answer:
# at start-up the worker refuses to start, while it runs they are misconfigurations
# (a message's attempt would cost good messages, a silent retry would stall).
_LOGIN_STATES = {"28000", "28P01", "3D000"}


def classify(exc: BaseException) -> DbFailure:
    """Classify a driver or SQLAlchemy error by what the protocol should do about it.

    A bare ``OSError`` counts as a lost connection only below a database
    error: a handler's own ``FileNotFoundError`` or an HTTP client's refused
    connection is the handler's failure, not the database's.
    """
    seen: set[int] = set()
    from_database = False
    any_state = False
    operational = False
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        operational = operational or type(current).__name__ == "OperationalError"
        if isinstance(current, errors.DatabaseUnavailable):
            return DbFailure.CONNECTION
        # Anything carrying a SQLSTATE is a database error, whatever raised it.
        state = _sqlstate(current)
        any_state = any_state or state is not None
        from_database = from_database or state is not None or _is_database_error(current)
        if isinstance(current, sa_exc.DBAPIError) and current.connection_invalidated:
            return DbFailure.CONNECTION
        kind = _of_state(state) if state is not None else None
        if kind is not None:
            return kind
        if isinstance(current, sa_exc.TimeoutError):
            # QueuePool's "QueuePool limit ... reached, connection timed out".
            return DbFailure.BUSY
        if from_database and isinstance(current, (OSError, sa_exc.DisconnectionError)):
            return DbFailure.CONNECTION
        if from_database and type(current).__name__ in _DRIVER_CONNECTION_ERRORS:
            return DbFailure.CONNECTION
        nxt = current.orig if isinstance(current, sa_exc.DBAPIError) else None
        current = nxt or current.__cause__ or current.__context__
    if from_database and operational and not any_state:
        # psycopg's "connection failed: ... Connection refused" carries no SQLSTATE:
        # an OperationalError without one is the connection's, not a statement's.
        return DbFailure.CONNECTION
    return DbFailure.OTHER


def _of_state(state: str) -> DbFailure | None:
    """The kind of a failure with SQLSTATE ``state``; None: not one of them."""
    if state in _CONFLICT_STATES:
        return DbFailure.CONFLICT
    if state == "55P03":
        return DbFailure.LOCK_TIMEOUT
    if state in _CONNECTION_STATES or state.startswith("08"):
        return DbFailure.CONNECTION
    if state in _POOLER_STATES or state in _SCHEMA_STATES or state in _LOGIN_STATES:
        return DbFailure.MISCONFIGURED
    if state in _BUSY_STATES or state.startswith("53"):
        return DbFailure.BUSY
    return None


def transient(exc: BaseException, failures: frozenset[DbFailure] = INFRASTRUCTURE) -> bool:
    """Whether ``exc`` is a failure of the database after which the transaction is retried whole.

    Wherever it is raised, in eop's statements or in a handler's, such a
    failure is not the handler's: it never counts as an attempt. eop's own
    :class:`eop.errors.TransactionConflict` and :class:`eop.errors.DatabaseUnavailable`
    always are; its other errors never; anything else by its :func:`classify`
    kind, one of ``failures``.
    """
    if isinstance(exc, (errors.TransactionConflict, errors.DatabaseUnavailable)):
        return True
    if isinstance(exc, errors.EopError):
        return False
    return classify(exc) in failures


# asyncpg's InternalClientError ("cannot switch to state 15; another operation (2)
# is in progress"): a pooled connection left mid-operation when its backend was
# terminated, which SQLAlchemy's pool can hand out again. It is the connection's
# state, never a message's: retried on another connection (BEGIN invalidates it).
_DRIVER_CONNECTION_ERRORS = {"ConnectionDoesNotExistError", "InterfaceError", "InternalClientError"}

# SQLSTATE classes of a statement whose values PostgreSQL refuses: data
# exceptions (22: a value it cannot convert or accept), integrity constraints
# (23), program limits (54: e.g. an index row too large).
_REFUSED_CLASSES = ("22", "23", "54")


def refuses_values(exc: BaseException) -> bool:
    """Whether ``exc`` says the database (or its driver) refuses the statement's values.

    Unlike a conflict, a timeout or a lost connection, running the same
    statement with the same values again cannot succeed.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        state = _sqlstate(current)
        if (state is not None and state[:2] in _REFUSED_CLASSES) or isinstance(
            current, UnicodeError
        ):
            return True
        nxt = current.orig if isinstance(current, sa_exc.DBAPIError) else None
        current = nxt or current.__cause__ or current.__context__
    return False


async def translate_claim_errors(claim: Awaitable[T]) -> T:
    """Await one message's claim; its failures that concern that message in eop's terms.

    A lock timeout (another delivery of the message holds its key or msg-id)
    is :class:`eop.errors.ClaimTimeout`; values the database refuses (its row
    cannot be stored or indexed) are :class:`eop.errors.UnclaimableMessage`;
    anything else is raised as the driver raised it.
    """
    try:
        return await claim
    except Exception as exc:
        if classify(exc) is DbFailure.LOCK_TIMEOUT:
            raise errors.ClaimTimeout() from exc
        if refuses_values(exc):
            # The message is dead-lettered with this text: bounded as a dead letter's error.
            raise errors.UnclaimableMessage(
                f"the inbox refuses this message's row: {log.bounded_error(exc)}"
            ) from exc
        raise


def pooler_mismatch(exc: BaseException) -> bool:
    """Whether ``exc`` is a prepared statement lost or doubled by a transaction-mode pooler."""
    return misconfiguration(exc) is Misconfiguration.POOLER


def misconfiguration(exc: BaseException) -> Misconfiguration | None:
    """Which misconfiguration ``exc`` shows (a :attr:`DbFailure.MISCONFIGURED`), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        state = _sqlstate(current)
        if state in _POOLER_STATES:
            return Misconfiguration.POOLER
        if state in _SCHEMA_STATES:
            return Misconfiguration.SCHEMA
        if state in _LOGIN_STATES:
            return Misconfiguration.LOGIN
        nxt = current.orig if isinstance(current, sa_exc.DBAPIError) else None
        current = nxt or current.__cause__ or current.__context__
    return None


def database_message(exc: BaseException) -> str:
    """The first line of the database's own message in ``exc``'s chain, and its SQLSTATE
    (``relation "orders" does not exist (SQLSTATE 42P01)``): names, never bound values."""
    found = _short(exc)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        state = _sqlstate(current)
        if state is not None:
            # The deepest is the driver's own, without SQLAlchemy's adapter prefix.
            found = f"{_short(current)} (SQLSTATE {state})"
        nxt = current.orig if isinstance(current, sa_exc.DBAPIError) else None
        current = nxt or current.__cause__ or current.__context__
    return found


def login_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is PostgreSQL refusing the role, its password or the database."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _sqlstate(current) in _LOGIN_STATES:
            return True
        nxt = current.orig if isinstance(current, sa_exc.DBAPIError) else None
        current = nxt or current.__cause__ or current.__context__
    return False


def _is_database_error(exc: BaseException) -> bool:
    if isinstance(exc, sa_exc.SQLAlchemyError):
        return True
    module = type(exc).__module__.split(".")[0]
    return module in ("asyncpg", "psycopg", "psycopg2", "sqlalchemy")


def _sqlstate(exc: BaseException) -> str | None:
    for attr in ("sqlstate", "pgcode"):
        value = getattr(exc, attr, None)
        if isinstance(value, str):
            return value
    return None


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc``, raised while opening or using a connection, means PostgreSQL is gone.

    Unlike :func:`classify`, a bare ``OSError`` counts too: at this edge (no
    handler code runs) it can only come from reaching the server.
    """
    return isinstance(exc, OSError) or classify(exc) is DbFailure.CONNECTION


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]


async def connected(awaitable: Any) -> Any:
    """Await a step that opens a connection; translate 'cannot connect' at the edge."""
    # Not through unavailable_when_unreachable: this runs at every transaction's start,
    # where a try costs nothing and a generator's context manager does.
    try:
        return await awaitable
    except Exception as exc:
        if unreachable(exc):
            raise errors.DatabaseUnavailable(f"PostgreSQL is unreachable: {_short(exc)}") from exc
        raise


@contextlib.contextmanager
def unavailable_when_unreachable(
    what: str = "PostgreSQL is unreachable", describe: Callable[[BaseException], str] = _short
) -> Iterator[None]:
    """Raise :class:`eop.DatabaseUnavailable` (``what: describe(error)``) for an error of
    the block that means PostgreSQL is gone (:func:`unreachable`); let any other through."""
    try:
        yield
    except Exception as exc:
        if unreachable(exc):
            raise errors.DatabaseUnavailable(f"{what}: {describe(exc)}") from exc
        raise
