"""Logging through structlog: configuration, the event vocabulary, redaction.

Every log line is an ``event`` from :class:`Event` plus, for message events,
the message's coordinates (handler, stream, seq, delivery count) and the
``action`` taken on the delivery. Payloads are never logged; URLs and headers
go through :func:`redact_url` and :func:`redact_headers` first, exceptions
through :func:`describe_error` and :func:`format_traceback`. Records that
libraries log through the stdlib's :mod:`logging` become ``library.log`` lines
(:func:`library_fields` says what of them is kept).
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import warnings
from collections.abc import MutableMapping
from typing import Any, Protocol

import structlog

from eop import redaction
from eop import settings as settings_mod

# Re-exported: eop's code, and its users', call them as log.describe_error and co.
from eop.error_text import BRIEF_ERROR_CHARS as BRIEF_ERROR_CHARS
from eop.error_text import ERROR_CHARS as ERROR_CHARS
from eop.error_text import bounded_error as bounded_error
from eop.error_text import brief_error as brief_error
from eop.error_text import describe_error as describe_error
from eop.error_text import format_traceback as format_traceback
from eop.error_text import round_error as round_error


class Event(str, enum.Enum):
    """The stable vocabulary of eop's log events."""

    def __str__(self) -> str:
        return str(self.value)

    WORKER_STARTING = "worker.starting"
    WORKER_STARTED = "worker.started"
    WORKER_STOPPING = "worker.stopping"
    WORKER_STOPPED = "worker.stopped"
    WORKER_EXIT_FORCED = "worker.exit_forced"
    WORKER_FAILED = "worker.failed"
    WORKER_STARTUP_RETRY = "worker.startup_retry"
    WORKER_STARTUP_STOPPED = "worker.startup_stopped"
    PROCESSES_STARTED = "processes.started"
    PROCESS_EXITED = "processes.exited"
    COMMAND_FAILED = "command.failed"
    SUBSCRIPTION_BOUND = "subscription.bound"
    FETCH_FAILED = "fetch.failed"
    PARTITION_ACQUIRED = "partition.acquired"
    PARTITION_RELEASED = "partition.released"
    PARTITION_LOST = "partition.lost"
    PARTITION_FAILED = "partition.failed"
    PARTITION_KEY_HELD = "partition.key_held"
    MESSAGE_PROCESSED = "message.processed"
    BATCH_PROCESSED = "batch.processed"
    BATCH_FAILED = "batch.failed"
    ON_COMMIT_FAILED = "transaction.on_commit_failed"
    TRANSACTION_ENDED_BY_HANDLER = "transaction.ended_by_handler"
    """A handler committed or rolled back eop's transaction past its session's guard."""
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
    ACK_FENCED = "ack.fenced"
    """An ack, nak or term not sent: its delivery is of an earlier incarnation of its
    stream, and nats-server would apply it to the new one's message at the same
    sequence."""
    HEARTBEAT_FAILED = "heartbeat.failed"
    DELIVERY_STUCK = "delivery.stuck"
    """A consumer's oldest delivery has waited unacknowledged past ``stuck_after_ack_waits``."""
    DELIVERY_UNSTUCK = "delivery.unstuck"
    """The stuck delivery was acknowledged at last (the consumer's ack floor moved past it)."""
    UNACKED_WATCH_FAILED = "delivery.watch_failed"
    INBOX_COMPACTED = "inbox.compacted"
    COMPACTION_FAILED = "inbox.compaction_failed"
    COMPACTION_DEFERRED = "inbox.compaction_deferred"
    """Compaction's raise of the watermark waited its lock bound for the claims sharing the
    row (held up on hot rows) and gave way: the next round tries again."""
    SUPERSEDED_EPOCH_SWEPT = "inbox.superseded_epoch_swept"
    """Compaction swept an earlier incarnation of a recreated stream: its watermark past
    every sequence, the rows that may go deleted."""
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
    RELAY_ABANDONED = "relay.abandoned"
    RELAY_STOPPED = "relay.stopped"
    OUTBOX_PUBLISHED = "outbox.published"
    OUTBOX_REFUSED = "outbox.refused"
    OUTBOX_PARKED = "outbox.parked"
    OUTBOX_PURGED = "outbox.purged"
    WRITES_THROUGH_SESSION = "writes.through_session"
    """An engine's ``eop.Writes`` go through the SQLAlchemy session, not asyncpg's own
    connection (:mod:`eop.pg.direct`): said once per engine, with the reason."""
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
    LIBRARY_LOG = "library.log"
    """A record a library logged through the stdlib's :mod:`logging` (asyncio, nats-py,
    SQLAlchemy, asyncpg, alembic, ...): its ``logger`` and unformatted ``message`` only."""


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
    *,
    libraries: bool = True,
) -> None:
    """Configure structlog for eop's processes (the worker and the CLI).

    Also routes the records libraries log through the stdlib's :mod:`logging`
    into the same lines (``library.log``, :func:`library_fields`), instead of
    the plain text Python prints for them otherwise. Calling it again
    reconfigures; it never adds a second handler. ``libraries`` False leaves
    them to the handlers the host put on the root logger (:func:`host_logging`).
    """
    renderer: Any
    _Rendering.json = log_format == "json"
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
    if libraries:
        _route_library_records(getattr(logging, level.upper()))
    else:
        _leave_library_records()


class _Rendering:
    json = False


def renders_json() -> bool:
    """Whether :func:`configure` last chose JSON lines: a command's last words follow suit."""
    return _Rendering.json


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


# --- The records libraries log through the stdlib's logging -----------------


def _route_library_records(level: int) -> None:
    """Send the stdlib's log records of this process through structlog, once."""
    # Only configure() installs it, never an import: an application embedding
    # eop keeps the logging it sets up. The root logger's level is left as it
    # is (WARNING, unless someone set it): lowering it to eop's (info by
    # default) would let through the INFO lines libraries write as a matter
    # of course (alembic's "Context impl %s." at every worker's schema check,
    # its "Running %s" at every step of `eop db upgrade`), which say nothing
    # without their arguments. A library's logger set lower on purpose gets
    # through, down to eop's level.
    _LIBRARY_RECORDS.setLevel(level)
    root = logging.getLogger()
    if _LIBRARY_RECORDS not in root.handlers:
        root.addHandler(_LIBRARY_RECORDS)
    # Python's warnings (SQLAlchemy's about a connection the garbage collector found
    # checked out, a DeprecationWarning) print as two plain lines otherwise.
    warnings.showwarning = _show_warning


def _leave_library_records() -> None:
    """Take back what :func:`_route_library_records` installed, if it did."""
    logging.getLogger().removeHandler(_LIBRARY_RECORDS)
    if warnings.showwarning is _show_warning:
        warnings.showwarning = STDLIB_SHOWWARNING


def host_logging() -> bool:
    """Whether something other than eop put handlers on the root logger: a Django
    project's ``LOGGING`` under ``manage.py eop worker``, an application's own set-up.
    Its handlers then print the libraries' records in its format, and eop's command
    leaves them to it (one line a record, not two)."""
    return any(h is not _LIBRARY_RECORDS for h in logging.getLogger().handlers)


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """Log a Python warning as a ``library.log`` line of logger ``py.warnings`` (the name
    :func:`logging.captureWarnings` gives them): its category, where it was raised, and
    its text masked as a library's own message is; not the source line."""
    structlog.get_logger("eop").warning(
        Event.LIBRARY_LOG,
        logger="py.warnings",
        category=category.__name__,
        source=f"{filename}:{lineno}",
        message=_template(str(message)),
    )


class _LibraryRecords(logging.Handler):
    """Logs each stdlib record as a ``library.log`` line of eop's structlog pipeline."""

    def emit(self, record: logging.LogRecord) -> None:
        """Log ``record``'s logger, level and message template, and its error sanitised."""
        try:
            logger: Any = structlog.get_logger("eop")
            log_at = getattr(logger, _level_name(record.levelno))
            log_at(Event.LIBRARY_LOG, **library_fields(record))
        except RecursionError:  # as the stdlib's handlers do
            raise
        except Exception:
            # A log line that cannot be written must not fail the library's call.
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:
        """Say nothing: the stdlib's report of a failed emit prints the record's arguments."""


def library_fields(record: logging.LogRecord) -> dict[str, Any]:
    """What a ``library.log`` line says of a stdlib log ``record``.

    Its logger's name and, for a library's logger (:data:`LIBRARIES`), its
    message *template* (``record.msg``, ``%s`` and all), not the formatted
    message: libraries pass what they log about as the template's arguments
    (a connection, a row, a statement's parameters, a URL with its password),
    and nothing tells those apart from harmless ones. The application's own
    record keeps its formatted message, masked as below: it is what the
    application chose to say.
    A message built beforehand (an f-string, asyncio's report of a failed
    task, which quotes the exception's repr) is the template itself: it gets
    its quoted values, and the passwords of URLs in it, masked as a database
    error's are. Its exception is described as eop's own errors are
    (:func:`brief_error`; :func:`format_traceback` from level ERROR up);
    ``exc_text``, a traceback another handler may have formatted, and the
    stack are left out.
    """
    if record.name.split(".", 1)[0] in LIBRARIES:
        message = _template(record.msg)
    else:
        # The application's own record: what it chose to say, formatted, its quoted
        # values and URL passwords masked as a library's own message is.
        message = _template(_formatted(record))
    fields: dict[str, Any] = {"logger": record.name, "message": message}
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, BaseException):
        fields["error"] = brief_error(exc)
        # Not for warnings: asyncpg's pool repeats its own at every retry.
        if record.levelno >= logging.ERROR:
            fields["exception"] = format_traceback(exc)
    return fields


def _formatted(record: logging.LogRecord) -> object:
    try:
        return record.getMessage() if isinstance(record.msg, str) else record.msg
    except Exception:  # arguments that do not fit the template
        return record.msg


def _template(msg: object) -> str:
    if isinstance(msg, BaseException):  # logger.error(exc)
        text = describe_error(msg)
    elif isinstance(msg, str):
        text = redaction.scrub_values(redaction.redact_text(msg))
    else:
        text = f"({type(msg).__name__})"  # a dict, an object: its str() could hold anything
    return text[:BRIEF_ERROR_CHARS]


def _level_name(levelno: int) -> str:
    # structlog has a method per standard level: a custom level takes the one below it.
    return next((name for n, name in _LEVELS if levelno >= n), "debug")


_LEVELS = (
    (logging.CRITICAL, "critical"),
    (logging.ERROR, "error"),
    (logging.WARNING, "warning"),
    (logging.INFO, "info"),
)

#: The one handler configure() puts on the root logger, whatever the calls.
_LIBRARY_RECORDS = _LibraryRecords()

#: How Python shows a warning before configure() routes them (for tests to put back).
STDLIB_SHOWWARNING = warnings.showwarning

#: The top-level loggers of libraries, whose records keep only their message template
#: (:func:`library_fields`); any other logger is the application's own.
LIBRARIES = frozenset(
    [
        "aiohttp",
        "alembic",
        "asyncio",
        "asyncpg",
        "concurrent",
        "django",
        "eop",
        "fastapi",
        "httpcore",
        "httpx",
        "nats",
        "prometheus_client",
        "psycopg",
        "psycopg2",
        "psycopg_pool",
        "py4j",
        "pyspark",
        "sqlalchemy",
        "starlette",
        "structlog",
        "tenacity",
        "urllib3",
        "uvicorn",
        "uvloop",
    ]
)
