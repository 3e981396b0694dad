"""Where a :class:`~eop.testing.app.TestApp` keeps its inbox: in memory, or in PostgreSQL.

Both give the protocol its :class:`eop.pg.contract.Store` and read back what a
test asserts on: the outbox messages committed, the dead letters, and the
parked messages whose retry the test runs now.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from eop.outbox import sql as outbox_sql
from eop.outbox.outgoing import Outgoing
from eop.pg import retries
from eop.pg.sql import testkit as testkit_sql
from eop.pg.store import PostgresStore
from eop.testing.rows import DeadLetterRow, InboxKey
from eop.testing.store import MemoryStore

if TYPE_CHECKING:
    from eop.app import App
    from eop.handler import HandlerSpec
    from eop.message import Message
    from eop.pg import contract

_TAKE_LIMIT = 10_000


class Backend(Protocol):
    """An inbox for the protocol, and what a test reads back from it."""

    @property
    def store(self) -> contract.Store:
        """The store the processors run on."""

    async def start(self) -> None:
        """Note where this test's outbox and dead letters begin."""

    async def new_outbox(self) -> list[Outgoing]:
        """The outbox messages committed since the last call."""

    async def dead_letters(self) -> list[DeadLetterRow]:
        """The dead letters committed since :meth:`start`, oldest first."""

    async def take_parked(
        self, spec: HandlerSpec, known: Mapping[InboxKey, Message]
    ) -> list[retries.ParkedDelivery]:
        """Every parked message of ``spec``'s handler, due now, as the retry loop takes it."""

    async def close(self) -> None:
        """Let the connections go."""


class MemoryBackend:
    """The inbox of a :class:`~eop.testing.store.MemoryStore`: no database at all."""

    def __init__(self, store: MemoryStore | None = None) -> None:
        self.memory = store if store is not None else MemoryStore()
        self._outbox_seen = 0
        self._runs: dict[InboxKey, int] = {}

    @property
    def store(self) -> MemoryStore:
        """The memory store."""
        return self.memory

    async def start(self) -> None:
        """Nothing came before: the store is new."""
        self._outbox_seen = len(self.memory.outbox)

    async def new_outbox(self) -> list[Outgoing]:
        """The outbox messages committed since the last call."""
        new = self.memory.outbox[self._outbox_seen :]
        self._outbox_seen = len(self.memory.outbox)
        return list(new)

    async def dead_letters(self) -> list[DeadLetterRow]:
        """The committed dead letters."""
        return list(self.memory.dead_letters)

    async def take_parked(
        self, spec: HandlerSpec, known: Mapping[InboxKey, Message]
    ) -> list[retries.ParkedDelivery]:
        """The parked messages of ``spec``, rebuilt from the messages the test delivered."""
        taken = []
        for key in sorted(k for k in self.memory.parked if k[0] == spec.name):
            failures = self.memory.attempts.get(key, 0)
            self._runs[key] = self._runs.get(key, 0) + 1
            msg = dataclasses.replace(known[key], num_delivered=failures + 1)
            taken.append(retries.ParkedDelivery(msg, failures=failures, runs=self._runs[key]))
        return taken

    async def close(self) -> None:
        """Nothing to close."""


class PostgresBackend:
    """eop's tables in a real PostgreSQL database, through the real :class:`PostgresStore`."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.postgres = PostgresStore(app)
        self._tables = self.postgres.tables
        self._dead_after = 0
        self._outbox_after = 0

    @property
    def store(self) -> PostgresStore:
        """The PostgreSQL store."""
        return self.postgres

    async def start(self) -> None:
        """Skip what the database held before the test."""
        rows = await self._rows(testkit_sql.max_ids(self._tables))
        self._dead_after, self._outbox_after = int(rows[0][0]), int(rows[0][1])

    async def new_outbox(self) -> list[Outgoing]:
        """The outbox rows committed since the last call, as messages."""
        rows = await self._rows(outbox_sql.rows_after(self._tables, self._outbox_after))
        if rows:
            self._outbox_after = int(rows[-1][0])
        return [
            Outgoing(
                subject=subject,
                data=bytes(payload),
                headers=json.loads(bytes(headers)),
                msg_id=msg_id,
            )
            for _, msg_id, subject, headers, payload in rows
        ]

    async def dead_letters(self) -> list[DeadLetterRow]:
        """The dead letters written since :meth:`start`."""
        rows = await self._rows(testkit_sql.dead_letters_after(self._tables, self._dead_after))
        return [_dead_letter(row) for row in rows]

    async def take_parked(
        self, spec: HandlerSpec, known: Mapping[InboxKey, Message]
    ) -> list[retries.ParkedDelivery]:
        """Make ``spec``'s parked messages due, then lease them as the retry loop does."""
        async with self.postgres.session() as session, session.begin():
            await session.execute(testkit_sql.hurry_parked(self._tables, spec.name))
        ack_wait_s = spec.ack_wait_s or self.app.settings.ack_wait_s
        return await retries.take_due(self.postgres, spec, _TAKE_LIMIT, ack_wait_s)

    async def close(self) -> None:
        """Stop the sync threads and close the pools this test made."""
        self.postgres.close()
        await self.app.dispose()

    async def _rows(self, stmt: Any) -> list[Any]:
        async with self.postgres.session() as session:
            return list((await session.execute(stmt)).all())


def _dead_letter(row: Any) -> DeadLetterRow:
    (
        _,
        subscription,
        stream,
        epoch,
        seq,
        fingerprint,
        msg_id,
        subject,
        headers,
        payload,
        reason,
        error,
        traceback,
        delivery_count,
    ) = row
    return DeadLetterRow(
        subscription=subscription,
        stream=stream,
        stream_epoch=epoch,
        stream_seq=int(seq),
        fingerprint=bytes(fingerprint),
        msg_id=msg_id,
        subject=subject,
        headers=dict(headers),
        payload=bytes(payload),
        reason=reason,
        error=error,
        traceback=traceback,
        delivery_count=int(delivery_count),
    )
