"""A database error that only a change of configuration can end stops the worker, loudly.

Some failures of the database answer the same on every attempt of every
message until someone changes the deployment (:data:`eop.pg.failures.DbFailure.MISCONFIGURED`):
prepared statements lost or doubled by a transaction-mode pooler that
``db_pooler`` does not know about, a table or column that no migration has
created yet, a login the server refuses since the worker started. They are
never a message's fault: dead-lettering would cost good messages, and
retrying them for ever, as an outage is, would stall the worker without a
word. So they are retried uncounted, as an outage is, and counted
here: the same kind :data:`STRIKES` times within :data:`WINDOW_S` seconds, in
the process's handler transactions (fetched or parked), parked-retry polls or
outbox relay rounds, and the worker stops as on SIGTERM (every message left
for redelivery, none dead-lettered) with one error naming the fix.

A transaction that succeeds in between does not reset the count: through a
mismatched pooler some transactions land where their statements happen to
be, and a handler may reach a missing table for some messages only.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

from eop import errors, log, redaction
from eop.pg import failures
from eop.settings import Settings

#: Failures of one kind within :data:`WINDOW_S` that stop the worker.
STRIKES = 3
#: How far back :data:`STRIKES` are counted, in seconds.
WINDOW_S = 60.0


@dataclasses.dataclass
class Watch:
    """Counts the misconfigured failures of one worker process; calls ``stop`` once."""

    stop: Callable[[errors.ConfigurationError], None] | None = None
    """Stops the worker with the error (None: only log it)."""
    clock: Callable[[], float] = time.monotonic
    error: errors.ConfigurationError | None = None
    """The error the worker stopped with, once it did."""
    _seen: dict[failures.Misconfiguration, collections.deque[float]] = dataclasses.field(
        default_factory=dict
    )

    def note(self, exc: BaseException, where: str, settings: Settings) -> None:
        """A transaction failed with ``exc`` and will be retried; ``where`` names its
        owner for the error (``handler 'orders'``, ``the outbox relay``)."""
        kind = failures.misconfiguration(exc)
        if kind is None or self.error is not None:
            return
        now = self.clock()
        seen = self._seen.setdefault(kind, collections.deque())
        seen.append(now)
        while seen and seen[0] < now - WINDOW_S:
            seen.popleft()
        if len(seen) < STRIKES:
            return
        self.error = errors.ConfigurationError(described(kind, exc, where, settings))
        log.get_logger().error(
            log.Event.DB_MISCONFIGURED,
            problem=kind.value,
            where=where,
            action=log.Action.LEFT,
            error=str(self.error),
        )
        if self.stop is not None:
            self.stop(self.error)

    def noting(self, where: str, settings: Settings) -> Callable[[BaseException], None]:
        """:meth:`note` for the failures of one background task (``where`` names it), as
        the callback a compaction round, the stuck-delivery watch or an ordered handler's
        ownership tick tells of each failure: an idle worker has no other."""
        return lambda exc: self.note(exc, where, settings)

    def reset(self) -> None:
        """Forget what was counted and the error (the test kit goes on after raising it)."""
        self.error = None
        self._seen.clear()


def described(
    kind: failures.Misconfiguration, exc: BaseException, where: str, settings: Settings
) -> str:
    """The one line a worker stops with: what failed, and the fix."""
    left = "every message is left for redelivery, none dead-lettered"
    if kind is failures.Misconfiguration.POOLER:
        found = (
            f"PostgreSQL at {redaction.redact_url(settings.database_url)} is reached through "
            "a transaction-mode pooler (PgBouncer?) that lost or doubled a prepared statement"
        )
        engines = (
            "an engine you gave eop.App (engine=, sessionmaker=, sync_sessionmaker=) needs "
            'connect_args={"statement_cache_size": 0, "prepared_statement_cache_size": 0} '
            'on asyncpg, {"prepare_threshold": None} on psycopg'
        )
        if settings.db_pooler in ("auto", "transaction"):
            # eop's own engines prepare nothing then: the statement came from the app's.
            return (
                f"{found}; EOP_DB_POOLER is {settings.db_pooler!r}, so eop's own engines "
                f"prepare none: {engines}, see docs/pgbouncer.md; {left}"
            )
        return (
            f"{found}, but EOP_DB_POOLER is {settings.db_pooler!r}: set "
            f"EOP_DB_POOLER=transaction (or auto), and {engines}, see docs/pgbouncer.md; {left}"
        )
    if kind is failures.Misconfiguration.LOGIN:
        return (
            f"PostgreSQL at {redaction.redact_url(settings.database_url)} refuses new "
            f"connections of {where}: {failures.database_message(exc)}, on every attempt: "
            "fix the role, password or database name in EOP_DATABASE_URL (under Django, "
            "in DATABASES) or the server's pg_hba.conf, role or database, then start the "
            f"worker again; {left}"
        )
    return (
        f"{where}: {failures.database_message(exc)}, on every attempt: run the "
        "migration that creates it (or check the database URL, schema and search_path), "
        "then start the worker again; if a newer eop migrated its tables, replace this "
        f"worker by that version; {left}"
    )
