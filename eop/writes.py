"""Writes: a handler's statements, queued and sent together before its transaction commits.

Most handlers only write: an INSERT of the effect, an UPDATE of a balance.
Sent one by one, each such statement costs a round trip and SQLAlchemy's
per-call work, more than the rest of eop's protocol put together. A handler
that takes ``eop.Writes`` as its second parameter (instead of the session)
queues them instead::

    ADD = sa.text("INSERT INTO orders (id, total) VALUES (:id, :total)")

    @app.handler(stream="ORDERS", subject="ORDERS.created")
    async def save(msg: eop.Message, writes: eop.Writes) -> None:
        writes.add(ADD, {"id": msg.msg_id, "total": 10})

When several messages of a batch run in one transaction, eop sends each run
of consecutive writes of the same statement object, with the same parameter
names, together: as one ``executemany``, or on asyncpg, for an INSERT whose
VALUES hold one row of placeholders and nothing follows them, as one INSERT
of many rows (PostgreSQL then runs one statement for the batch, not one a
row; a ``FOR EACH STATEMENT`` trigger fires once for those rows). The
guarantees are those of the session:

- The statements run in the order they were added, inside the handler's
  transaction, before any later statement sent through the session (by the
  handler through :attr:`Writes.session`, or by eop) and before COMMIT, so a
  later read sees them.
- A write that fails fails its message: eop rolls the batch back and runs
  each message again in its own savepoint, its writes sent at its end, so the
  error is the message's own.

Only statements whose results nobody reads belong here (an INSERT, UPDATE or
DELETE without RETURNING); a handler that needs a row count or a returned row
executes that statement through :attr:`Writes.session`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from eop import errors

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

_Group = tuple[sa.Executable, list[dict[str, Any]]]


class Writes:
    """The statements a handler queues for its transaction; see :mod:`eop.writes`.

    An ``async def`` handler's :attr:`session` is an ``AsyncSession``; a plain
    ``def`` handler's (run in a worker thread) is a ``Session``.
    """

    __slots__ = ("_groups", "_session", "_watching")

    def __init__(self, session: AsyncSession | Session) -> None:
        self._session = session
        self._groups: list[_Group] = []
        self._watching = False

    @property
    def session(self) -> Any:
        """The transaction's session, for reads and for statements whose result matters.

        Any statement it executes first sends the queued writes, and so does
        ``begin_nested()``: writes queued before a savepoint are sent before it,
        so that rolling the savepoint back does not take them (this message's
        or, in a batch, an earlier message's) with it. Only handlers that ask
        for the session need those hooks, so they are set up here, on the first
        access, not for every transaction.
        """
        if not self._watching:
            self._watching = True
            given: Any = self._session
            sync_session: Session = getattr(given, "sync_session", given)
            sa.event.listen(sync_session, "do_orm_execute", self._before_execute)
            # On this instance only; an AsyncSession's begin_nested calls its sync face's.
            setattr(sync_session, "begin_nested", _SentFirst(self, sync_session))  # noqa: B010
        return self._session

    @property
    def info(self) -> dict[str, Any]:
        """The session's ``info`` (where eop keeps the transaction's outbox context)."""
        info: dict[str, Any] = self._session.info
        return info

    def _before_execute(self, state: Any) -> None:
        self.send(state.session)

    def add(self, statement: sa.Executable, params: Mapping[str, Any] | None = None) -> None:
        """Queue ``statement`` with one set of ``params``; it runs before the next read or COMMIT.

        Pass the parameters here rather than baked into the statement
        (``.values(...)``): only writes of one statement object with the same
        parameter names are sent together.
        """
        if not isinstance(statement, sa.Executable) or isinstance(statement, sa.Select):
            raise errors.ConfigurationError(
                f"Writes.add takes an INSERT, UPDATE or DELETE statement, not {statement!r}: "
                "run queries through writes.session"
            )
        if getattr(statement, "_returning", ()):
            raise errors.ConfigurationError(
                "Writes.add cannot return rows (RETURNING): execute the statement through "
                "writes.session to read them"
            )
        row = dict(params) if params is not None else {}
        groups = self._groups
        if groups:
            last_statement, rows = groups[-1]
            if last_statement is statement and rows[0].keys() == row.keys():
                rows.append(row)
                return
        _check_values(statement, row)
        groups.append((statement, [row]))

    def __len__(self) -> int:
        """How many writes are queued."""
        return sum(len(rows) for _, rows in self._groups)

    def __bool__(self) -> bool:
        return bool(self._groups)

    @property
    def session_used(self) -> bool:
        """Whether the handler asked for :attr:`session` (then eop's statements may not be the
        only ones on its connection)."""
        return self._watching

    def take(self) -> list[tuple[sa.Executable, list[dict[str, Any]]]]:
        """The queued writes as (statement, parameter sets) groups, in order; the queue empties.

        For the sender of an ``AsyncSession``'s writes (:mod:`eop.pg.direct`),
        which sends them itself where it can and the rest through :func:`send_groups`.
        """
        groups, self._groups = self._groups, []
        return groups

    def discard(self) -> None:
        """Forget the queued writes (their handler failed and its savepoint was rolled back)."""
        self._groups = []

    def send(self, session: Session) -> None:
        """Execute the queued writes on ``session``'s connection, in order; the queue empties.

        Called by eop (in SQLAlchemy's sync context, so for an ``AsyncSession``
        through ``run_sync`` or from a session event). The statements run as
        Core statements on the connection: a list of parameter sets is a plain
        ``executemany``, never an ORM bulk operation.
        """
        send_groups(session, self.take())


class _SentFirst:
    """A watched session's ``begin_nested``: the queued writes first, then the savepoint."""

    __slots__ = ("_session", "_writes")

    def __init__(self, writes: Writes, session: Session) -> None:
        self._writes = writes
        self._session = session

    def __call__(self) -> Any:
        self._writes.send(self._session)
        return type(self._session).begin_nested(self._session)


def send_groups(session: Session, groups: list[_Group]) -> None:
    """Execute ``groups`` (:meth:`Writes.take`) on ``session``'s connection, in order."""
    if not groups:
        return
    connection = session.connection()
    for statement, rows in groups:
        connection.execute(statement, rows[0] if len(rows) == 1 else rows)


def _check_values(statement: sa.Executable, row: Mapping[str, Any]) -> None:
    """Refuse a text statement's parameter left without a value, here rather than at
    its flush: the test kit, which runs no SQL, fails the handler as a database would."""
    if not isinstance(statement, sa.TextClause):
        return
    missing = [
        name for name, bind in statement._bindparams.items() if bind.required and name not in row
    ]
    if missing:
        names = ", ".join(repr(name) for name in missing)
        raise errors.ConfigurationError(
            f"Writes.add: no value for {names} of {str(statement)[:80]!r}: pass every "
            "parameter the statement names"
        )
