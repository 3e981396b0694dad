"""The fake session and write queue a handler gets from :class:`~eop.testing.store.MemoryStore`."""

from __future__ import annotations

import json
from collections.abc import Generator, Iterable, Mapping
from typing import Any

import sqlalchemy as sa

from eop import writes
from eop.outbox import table as outbox
from eop.outbox.outgoing import Outgoing
from eop.pg import session_guard

Statement = tuple[sa.Executable, dict[str, Any]]
"""A statement an ``eop.Writes`` handler queued, with its parameters."""


class FakeSession:
    """The session a handler gets from :class:`MemoryStore`: it records ``add()`` calls.

    What is added becomes :attr:`MemoryStore.effects` when the transaction
    commits, and is discarded when it rolls back.
    """

    def __init__(self) -> None:
        self.added: list[object] = []
        """Objects added in this transaction, in order."""
        self.statements: list[Statement] = []
        """Statements queued through :class:`FakeWrites` in this transaction, in order."""
        self.flushes = 0
        """``flush()`` calls."""
        self.outbox: list[Outgoing] = []
        """Messages ``eop.outbox.add``-ed in this transaction, in order."""
        self.info: dict[str, object] = {outbox.WRITES_KEY: _OutboxRecorder(self.outbox)}
        """As a session's ``info``: where ``eop.outbox.add`` finds this transaction's queue."""

    commit = session_guard.Refusal("commit")
    rollback = session_guard.Refusal("rollback")
    close = session_guard.Refusal("close")
    """A handler ends no transaction, here as on eop's real session (``eop.pg.session_guard``)."""

    def add(self, instance: object) -> None:
        """Record ``instance`` as a write of this transaction."""
        self.added.append(instance)

    def add_all(self, instances: Iterable[object]) -> None:
        """Record each of ``instances``."""
        self.added.extend(instances)

    def flush(self) -> _Done:
        """Do nothing, as ``session.flush()`` or ``await session.flush()``: a key the
        database would assign stays None (test a handler that reads one with a database)."""
        self.flushes += 1
        return _Done()

    def __getattr__(self, name: str) -> Any:
        # execute, scalar, get...: a handler that reads or runs SQL needs a database.
        raise InMemoryOnly(
            f"the in-memory test session has no {name!r}: it records add() and add_all() "
            "only; test a handler that runs SQL on a database: TestApp(app, database=...)"
        )


class InMemoryOnly(AttributeError):
    """What the in-memory session cannot do: the test's limit, not the handler's failure,
    so it is raised to the test even with ``raise_errors=False``."""


class FakeWrites:
    """The ``eop.Writes`` a handler gets from :class:`MemoryStore`: it records the statements.

    :meth:`add` refuses what ``eop.Writes.add`` refuses (a Core ``select()``, a
    ``.returning()``) and records the rest in :attr:`FakeSession.statements`; they become
    :attr:`MemoryStore.statements` when the transaction commits. There is no
    database: :attr:`session` is the :class:`FakeSession`, which runs no queries.
    """

    def __init__(self, session: FakeSession) -> None:
        self._session = session
        # eop.Writes itself checks each statement; its queue is emptied after.
        self._check = writes.Writes(session)  # type: ignore[arg-type]  # it only keeps it

    @property
    def session(self) -> FakeSession:
        """The transaction's fake session."""
        return self._session

    @property
    def info(self) -> dict[str, object]:
        """The session's ``info`` (where ``eop.outbox.add`` finds the transaction's outbox)."""
        return self._session.info

    def add(self, statement: sa.Executable, params: Mapping[str, Any] | None = None) -> None:
        """Record ``statement`` with ``params`` as a write of this transaction."""
        self._check.add(statement, params)
        self._check.discard()
        self._session.statements.append((statement, dict(params or {})))


class _OutboxRecorder:
    """Takes the rows ``eop.outbox.add`` queues, as the messages they stand for."""

    def __init__(self, messages: list[Outgoing]) -> None:
        self.messages = messages

    def add(self, statement: object, params: Mapping[str, Any] | None = None) -> None:
        """Record the outbox row ``params`` as a message."""
        row = dict(params or {})
        self.messages.append(
            Outgoing(
                subject=row["subject"],
                data=row["payload"],
                headers=json.loads(row["headers"]),
                msg_id=row["msg_id"],
            )
        )


class _Done:
    """An awaitable that is already done."""

    def __await__(self) -> Generator[None, None, None]:
        yield from ()
