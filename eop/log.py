"""Logging through structlog: configuration, the event vocabulary, redaction.

Every log line is an ``event`` from :class:`Event` plus, for message events,
the message's coordinates (handler, stream, seq, delivery count) and the
``action`` taken on the delivery. Payloads are never logged; URLs and headers
go through :func:`redact_url` and :func:`redact_headers` first, exceptions
through :func:`describe_error` and :func:`format_traceback`.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import traceback
from collections.abc import MutableMapping, Sequence
from typing import Any, Protocol

import structlog
from sqlalchemy import exc as sa_exc

from eop import redaction
from eop import settings as settings_mod


class Event(str, enum.Enum):
    """The stable vocabulary of eop's log events."""

    def __str__(self) -> str:
        return str(self.value)

    WORKER_STARTING = "worker.starting"
    WORKER_STARTED = "worker.started"
    WORKER_STOPPING = "worker.stopping"
    WORKER_STOPPED = "worker.stopped"
    WORKER_EXIT_FORCED = "worker.exit_forced"
    WORKER_STARTUP_RETRY = "worker.startup_retry"
    WORKER_STARTUP_STOPPED = "worker.startup_stopped"
    PROCESSES_STARTED = "processes.started"
    PROCESS_EXITED = "processes.exited"
    SUBSCRIPTION_BOUND = "subscription.bound"
    SUBSCRIPTION_LOST = "subscription.lost"
    FETCH_FAILED = "fetch.failed"
    PARTITION_ACQUIRED = "partition.acquired"
    PARTITION_RELEASED = "partition.released"
    PARTITION_LOST = "partition.lost"
    PARTITION_FAILED = "partition.failed"
    PARTITION_KEY_HELD = "partition.key_held"
    MESSAGE_PROCESSED = "message.processed"
    BATCH_PROCESSED = "batch.processed"
    BATCH_FAILED = "batch.failed"
    MESSAGE_DUPLICATE = "message.duplicate"
    MESSAGE_RETRY = "message.retry"
    MESSAGE_DEAD_LETTERED = "message.dead_lettered"
    MESSAGE_QUARANTINED = "message.quarantined"
    MESSAGE_LEASE_SPENT = "message.lease_spent"
    MESSAGE_CLAIM_TIMEOUT = "message.claim_timeout"
    MESSAGE_FAILED = "message.failed"
    MESSAGE_STREAM_GONE = "message.stream_gone"
    TRANSACTION_RETRY = "transaction.retry"
    RETRY_LOOP_FAILED = "retry_loop.failed"
    COMMIT_AMBIGUOUS = "commit.ambiguous"
    ACK_RETRY = "ack.retry"
    ACK_GAVE_UP = "ack.gave_up"
    HEARTBEAT_FAILED = "heartbeat.failed"
    DELIVERY_STUCK = "delivery.stuck"
    """A consumer's oldest delivery has waited unacknowledged past ``stuck_after_ack_waits``."""
    DELIVERY_UNSTUCK = "delivery.unstuck"
    """The stuck delivery was acknowledged at last (the consumer's ack floor moved past it)."""
    UNACKED_WATCH_FAILED = "delivery.watch_failed"
    INBOX_COMPACTED = "inbox.compacted"
    COMPACTION_FAILED = "inbox.compaction_failed"
    STREAM_EPOCH_CHANGED = "stream.epoch_changed"
    STREAM_INFO_RETRY = "stream.info_retry"
    JETSTREAM_INFO_RETRY = "jetstream.info_retry"
    STREAM_REPLICAS_DIFFER = "stream.replicas_differ"
    CONSUMER_ACK_WAIT_CHANGED = "consumer.ack_wait_changed"
    """A worker gave its handler's existing consumer the AckWait of its settings."""
    NATS_DISCONNECTED = "nats.disconnected"
    NATS_RECONNECTED = "nats.reconnected"
    NATS_ERROR = "nats.error"
    NATS_AUTH_REFUSED = "nats.auth_refused"
    NATS_CLOSED = "nats.closed"
    NATS_READER_ENDED = "nats.reader_ended"
    RELAY_STARTING = "relay.starting"
    RELAY_STARTED = "relay.started"
    RELAY_LEADING = "relay.leading"
    RELAY_STANDING_BY = "relay.standing_by"
    RELAY_POLLING = "relay.polling"
    RELAY_FAILED = "relay.failed"
    RELAY_STOPPED = "relay.stopped"
    OUTBOX_PUBLISHED = "outbox.published"
    OUTBOX_REFUSED = "outbox.refused"
    OUTBOX_PARKED = "outbox.parked"
    OUTBOX_PURGED = "outbox.purged"
    DB_POOLER_FOUND = "db.pooler_found"
    DB_POOLER_UNNEEDED = "db.pooler_unneeded"
    DB_MISCONFIGURED = "db.misconfigured"
    SPARK_JOB_STALLED = "spark.job_stalled"
    SPARK_REPORT_UNREAD = "spark.report_unread"
    SPARK_UNWATCHED = "spark.unwatched"
    SPARK_LEASE_LOST = "spark.lease_lost"
    SPARK_LEASE_FAILED = "spark.lease_failed"
    FAULT_ARMED = "fault.armed"
    FAULT_IGNORED = "fault.ignored"
    """``EOP_FAULTS`` is set, but this command never arms fault points (:mod:`eop.faults`)."""
    FAULT_HIT = "fault.hit"
    LOOP_ERROR = "loop.error"


class Action(str, enum.Enum):
    """What eop did with a delivery."""

    def __str__(self) -> str:
        return str(self.value)

    ACK = "ack"
    NAK = "nak"
    TERM = "term"
    LEFT = "left_for_redelivery"
    PARK = "park"
    """Acked, its retry held in the database (the retries table)."""


def _add_pid(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    # The processes of one `eop worker` share stderr: the pid tells their lines apart.
    event_dict.setdefault("pid", os.getpid())
    return event_dict


def configure(
    log_format: settings_mod.LogFormat = "console",
    level: settings_mod.LogLevel = "info",
    stream: Any = None,
) -> None:
    """Configure structlog for eop's processes (the worker and the CLI)."""
    renderer: Any
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _add_pid,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _format_exc_info,
            _stringify_enums,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        # One write() per line (PrintLogger writes the line and its newline
        # separately): the processes of one `eop worker` share stderr, and two
        # writes per line let their lines interleave into broken JSON.
        logger_factory=structlog.WriteLoggerFactory(file=stream) if stream else _stderr_logger,
        cache_logger_on_first_use=False,
    )


def _stderr_logger(*_: Any) -> structlog.WriteLogger:
    # sys.stderr as it is when a line is logged, not when configure() ran: a host
    # application (or a test runner's capture) may swap it later and close the old one.
    return structlog.WriteLogger(sys.stderr)


def _format_exc_info(
    _: Any, __: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    # structlog's format_exc_info prints a plain traceback: bound values and
    # DETAIL lines included. A line logged with exc_info gets format_traceback's.
    exc_info = event_dict.pop("exc_info", None)
    if exc_info is True:
        exc_info = sys.exc_info()
    exc = exc_info[1] if isinstance(exc_info, tuple) else exc_info
    if isinstance(exc, BaseException):
        event_dict["exception"] = format_traceback(exc)
    return event_dict


def _stringify_enums(
    _: Any, __: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    for key, value in event_dict.items():
        if isinstance(value, enum.Enum):
            event_dict[key] = value.value
    return event_dict


class Logger(Protocol):
    """What eop's code logs through: a structlog bound logger, or a :class:`LazyLogger`."""

    def bind(self, **more: Any) -> Logger:
        """A logger with ``more`` bound as well."""

    def debug(self, event: str, **kw: Any) -> Any:
        """Log at debug level."""

    def info(self, event: str, **kw: Any) -> Any:
        """Log at info level."""

    def warning(self, event: str, **kw: Any) -> Any:
        """Log at warning level."""

    def error(self, event: str, **kw: Any) -> Any:
        """Log at error level."""


def get_logger(**bindings: Any) -> Logger:
    """A structlog logger with ``bindings`` bound."""
    logger: Logger = structlog.get_logger("eop").bind(**bindings)
    return logger


class LazyLogger:
    """A logger whose bindings are bound only when it logs at an enabled level.

    The hot path makes one of these per message; binding a structlog logger
    costs more than most lines it would log, and at the default level most
    per-message lines (``message.processed``) are debug lines that are dropped.
    """

    __slots__ = ("_bindings", "_bound")

    def __init__(self, **bindings: Any) -> None:
        self._bindings = bindings
        self._bound: Logger | None = None

    def _logger(self) -> Logger:
        if self._bound is None:
            self._bound = get_logger(**self._bindings)
        return self._bound

    def bind(self, **more: Any) -> LazyLogger:
        """A lazy logger with ``more`` bound as well."""
        return LazyLogger(**{**self._bindings, **more})

    def debug(self, event: str, **kw: Any) -> None:
        """Log at debug level, if that level is enabled."""
        if enabled(logging.DEBUG):
            self._logger().debug(event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        """Log at info level, if that level is enabled."""
        if enabled(logging.INFO):
            self._logger().info(event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        """Log at warning level."""
        self._logger().warning(event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        """Log at error level."""
        self._logger().error(event, **kw)


def enabled(level: int) -> bool:
    """Whether the configured structlog wrapper logs at ``level`` (unknown: yes)."""
    wrapper = structlog.get_config()["wrapper_class"]
    check = getattr(wrapper, "is_enabled_for", None)
    return True if check is None else bool(check(None, level))


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
    (:func:`eop.redaction.scrub_values`) and, for a statement, its SQL.
    """
    chain = _chain(exc)
    values = _bound_values(chain)
    return f"{type(exc).__name__}: {_message(exc, values, _below_database(exc, chain))}"


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
    return "".join(top.format())


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
    if type(exc).__module__.split(".")[0] in _DRIVER_MODULES:
        # PostgreSQL's primary message is one line; DETAIL, HINT and CONTEXT
        # follow it and may quote the row or the values.
        return _first_line(_safe_str(exc))
    return None


# Drivers' exception modules; sqlalchemy's for the asyncpg dialect's emulated DBAPI errors.
_DRIVER_MODULES = ("asyncpg", "psycopg", "psycopg2", "sqlalchemy")


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
