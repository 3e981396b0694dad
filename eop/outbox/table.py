"""Adding messages to the outbox, in the caller's own transaction.

A row added here commits with the caller's writes, or not at all; the relay
(:mod:`eop.outbox.relay`) publishes the committed ones. Where the row is
written depends on what the caller holds:

- an eop handler's session or :class:`eop.Writes`: queued with the handler's
  writes, sent before its COMMIT (together for a batch), and
  dropped with them when its savepoint is rolled back;
- a sync ``Session``: inserted at once, in its transaction;
- an ``AsyncSession``: inserted when the session commits (``add`` cannot
  await), and dropped when the transaction (or the savepoint) it was added
  in is rolled back;
- a DB-API connection on psycopg (:class:`Cursors`: Django's
  ``django.db.connection``, a ``psycopg.Connection``): inserted at once,
  through one of its cursors, in its open transaction.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

import sqlalchemy as sa
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncSession

from eop import errors, settings, writes
from eop.outbox import outgoing, sql
from eop.pg import models
from eop.pg.sql import base as base_sql

if TYPE_CHECKING:
    from sqlalchemy.orm import SessionTransaction

#: Where a session made by eop keeps its :class:`Context` (``Session.info``).
CONTEXT_KEY = "eop.outbox"
#: Where an eop handler transaction keeps its write queue, for rows added through its session.
WRITES_KEY = "eop.writes"
# An AsyncSession's rows waiting for its COMMIT.
_QUEUE_KEY = "eop.outbox.queue"


@dataclasses.dataclass(frozen=True)
class Context:
    """Where a session's outbox rows go, and how large a message may be."""

    tables: models.Tables
    max_payload: int

    @classmethod
    def of(cls, s: settings.Settings) -> Context:
        """The context ``s`` describes (its schema and ``outbox_max_payload``)."""
        return cls(models.tables(s.schema), s.outbox_max_payload)


_configured: list[Context | errors.ConfigurationError] = []


def configure_default(context: Context | errors.ConfigurationError) -> None:
    """Where rows added through a session or connection eop did not make go, in this process.

    Without it, the process's ``EOP_SCHEMA`` and ``EOP_OUTBOX_MAX_PAYLOAD``;
    :mod:`eop.contrib.django` sets it from Django's settings, or to the error
    its settings were refused with, which adding a row then raises (a row is
    never sent to a schema the settings did not mean).
    """
    _configured[:] = [context]


@functools.cache
def _env_context() -> Context:
    # Read once: a process's environment does not change under it.
    return Context.of(settings.Settings.from_env())


def _default_context() -> Context:
    if not _configured:
        return _env_context()
    configured = _configured[0]
    if isinstance(configured, errors.ConfigurationError):
        # A new exception each time: raising the stored one would grow its traceback
        # with every caller's frames (and keep them alive) in a long-running server.
        raise errors.ConfigurationError(str(configured))
    return configured


class Cursors(Protocol):
    """A DB-API connection on psycopg: what ``add`` needs of one (``cursor()``)."""

    def cursor(self) -> Any:
        """A cursor (a context manager) whose ``execute`` takes ``%(name)s`` parameters."""


def add(
    target: orm.Session | AsyncSession | writes.Writes | Cursors,
    subject: str,
    data: bytes | str,
    *,
    headers: Mapping[str, str] | None = None,
    msg_id: str | None = None,
    schema: str | None = None,
) -> str:
    """Add a message to the outbox in ``target``'s transaction; returns its ``Nats-Msg-Id``.

    The message is published after the transaction commits, and never if it
    rolls back. Without ``msg_id``, one is chosen now; every send of the
    message carries it, so the stream (inside its duplicate window) and an
    eop consumer's msg-id guard (after it) keep one copy. ``schema`` is the
    schema of eop's tables when ``target`` was not made by eop (default:
    ``EOP_SCHEMA``, else ``eop``). A bad subject, header or size raises
    :class:`eop.UnpublishableMessage` here, before anything is written.
    """
    connection = _connection(target)
    info = target.info if isinstance(target, writes.Writes) else _info(target, connection)
    queue: RowQueue | None = target if isinstance(target, writes.Writes) else info.get(WRITES_KEY)
    context = info.get(CONTEXT_KEY) or _default_context()
    if schema is not None and schema != context.tables.schema:
        context = dataclasses.replace(context, tables=models.tables(schema))
    message = outgoing.outgoing(
        subject, data, headers=headers, msg_id=msg_id, max_payload=context.max_payload
    )
    row = {
        "msg_id": message.msg_id,
        "subject": message.subject,
        "headers": json.dumps(dict(message.headers)).encode(),
        "payload": message.data,
    }
    statement = sql.insert(context.tables)
    if queue is not None:
        queue.add(statement, row)
    elif isinstance(target, AsyncSession):
        _queue_until_commit(target.sync_session, statement, row)
    elif isinstance(target, orm.Session):
        target.execute(statement, row)
    elif connection is not None:
        text, values = base_sql.for_psycopg(statement, row)
        with connection.cursor() as cursor:
            cursor.execute(text, values)
    return message.msg_id


def _connection(target: object) -> Cursors | None:
    """``target`` when it is a DB-API connection rather than a session or a write queue."""
    if isinstance(target, (orm.Session, AsyncSession, writes.Writes)):
        return None
    if isinstance(getattr(target, "info", None), dict):
        return None  # the test kit's fake sessions
    return cast("Cursors", target) if callable(getattr(target, "cursor", None)) else None


class RowQueue(Protocol):
    """Where a transaction that is not the caller's to run queues its rows (eop's own)."""

    def add(self, statement: sa.Executable, params: Mapping[str, Any] | None = None) -> None:
        """Queue ``statement`` with ``params`` for the transaction."""


def _info(session: object, connection: Cursors | None = None) -> dict[str, Any]:
    if connection is not None:
        return {}  # no queue: the row goes in at once
    info = getattr(session, "info", None)
    # eop's handler sessions (and the test kit's fakes) carry their queue in info.
    if isinstance(session, (orm.Session, AsyncSession)) or (
        isinstance(info, dict) and WRITES_KEY in info
    ):
        return info  # type: ignore[return-value]  # a Session's info is a dict
    raise errors.ConfigurationError(
        "eop.outbox.add takes a SQLAlchemy Session or AsyncSession, an eop.Writes, "
        "or a psycopg DB-API connection (django.db.connection), "
        f"not {type(session).__name__}"
    )


@dataclasses.dataclass
class _Queued:
    statement: sa.Executable
    row: dict[str, Any]
    transaction: SessionTransaction | None


def _queue_until_commit(
    session: orm.Session, statement: sa.Executable, row: dict[str, Any]
) -> None:
    queue: list[_Queued] | None = session.info.get(_QUEUE_KEY)
    if queue is None:
        queue = session.info[_QUEUE_KEY] = []
        sa.event.listen(session, "before_commit", _send_queued)
        sa.event.listen(session, "after_soft_rollback", _drop_rolled_back)
        sa.event.listen(session, "after_transaction_end", _forget_ended)
    # The innermost transaction: a savepoint rolled back drops only its own rows.
    # None (not begun yet): the rows belong to the transaction the session begins next.
    transaction = session.get_nested_transaction() or session.get_transaction()
    queue.append(_Queued(statement, row, transaction))


def _send_queued(session: orm.Session) -> None:
    queue: list[_Queued] = session.info.get(_QUEUE_KEY) or []
    if not queue:
        return
    session.info[_QUEUE_KEY] = []
    connection = session.connection()
    for item in queue:
        connection.execute(item.statement, item.row)


def _drop_rolled_back(session: orm.Session, previous: SessionTransaction) -> None:
    queue: list[_Queued] | None = session.info.get(_QUEUE_KEY)
    if queue:
        session.info[_QUEUE_KEY] = [q for q in queue if not _within(q.transaction, previous)]


def _forget_ended(session: orm.Session, transaction: SessionTransaction) -> None:
    # The root transaction ended: its rows were sent (COMMIT) or must not be (anything else).
    if transaction.parent is None and session.info.get(_QUEUE_KEY):
        session.info[_QUEUE_KEY] = []


def _within(transaction: SessionTransaction | None, ancestor: SessionTransaction) -> bool:
    while transaction is not None:
        if transaction is ancestor:
            return True
        transaction = transaction.parent
    return False
