"""The protocol's statements in one inbox transaction, whatever runs them.

:class:`Statements` implements the bookkeeping half of
:class:`eop.pg.contract.Transaction` (the claim, the look-ups, the dead letters,
the retries' counts) with eop's statements (:mod:`eop.pg.sql`) over two
primitives, :meth:`Statements._rows` and :meth:`Statements._execute`; a
subclass says how a statement reaches the database (a SQLAlchemy session in
:mod:`eop.pg.transactions`, Django's connection in :mod:`eop.contrib.django`)
and how the handler runs.
"""

from __future__ import annotations

import abc
import json
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from eop import message as message_mod
from eop import redaction
from eop.pg import failures, models
from eop.pg.contract import DeadLetter, Existing
from eop.pg.sql import claim as claim_sql
from eop.pg.sql import inbox as inbox_sql
from eop.pg.sql import retries as retries_sql
from eop.pg.sql import turns as turns_sql

if TYPE_CHECKING:
    from eop.handler import HandlerSpec
    from eop.message import Message


class Statements(abc.ABC):
    """The protocol's statements over a connection a subclass provides."""

    def __init__(self, tables: models.Tables, spec: HandlerSpec) -> None:
        self.tables = tables
        self.spec = spec
        self.committed = False

    @abc.abstractmethod
    async def _rows(
        self, stmt: sa.Executable, params: dict[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        """The rows of ``stmt``, run with ``params`` for its bind parameters."""

    @abc.abstractmethod
    async def _execute(self, stmt: sa.Executable, params: dict[str, Any] | None = None) -> None:
        """Run ``stmt`` with ``params`` for its bind parameters."""

    async def _execute_many(self, stmt: sa.Executable, params: list[dict[str, Any]]) -> None:
        """Run ``stmt`` once for each of ``params`` (one call each, unless overridden)."""
        for one in params:
            await self._execute(stmt, one)

    async def select(self, stmt: sa.Executable) -> list[tuple[Any, ...]]:
        """The rows of one of eop's own statements (:mod:`eop.pg.sql`), run in this transaction."""
        return await self._rows(stmt)

    @abc.abstractmethod
    async def run(self, message: Message, *, flush: bool = True) -> None:
        """Run the handler inside this transaction.

        With ``flush=False`` the handler's queued writes (:class:`eop.Writes`)
        and pending ORM objects stay queued, to be sent with the rest of the
        batch's by :meth:`flush`.
        """

    @abc.abstractmethod
    async def flush(self) -> None:
        """Send the handlers' queued writes, then their pending ORM objects."""

    @abc.abstractmethod
    async def commit(self) -> None:
        """COMMIT; :class:`eop.AmbiguousCommit` when the connection drops during it."""

    @abc.abstractmethod
    async def rollback(self) -> None:
        """ROLLBACK (never raises)."""

    @abc.abstractmethod
    async def run_many(self, messages: list[Message], *, flush: bool = True) -> None:
        """Run a batch handler on ``messages`` inside this transaction."""

    @abc.abstractmethod
    async def run_isolated(self, messages: list[Message]) -> Exception | None:
        """Run the handler on ``messages`` inside a savepoint; its error, rolled back, or None.

        Failures of the database (:data:`INFRASTRUCTURE`: conflicts, lock and
        statement timeouts, a lost connection) are raised, not returned: they
        are no handler's failure, and the transaction is retried whole.
        """

    async def claim(self, message: Message, outcome: str) -> bool:
        """Insert the inbox row; False when the key or the msg-id is taken, or below the
        watermark. A lock timeout or a refused row is raised in eop's terms
        (:func:`eop.pg.failures.translate_claim_errors`)."""
        return bool(await failures.translate_claim_errors(self.claim_many([message], outcome)))

    async def claim_many(self, messages: list[Message], outcome: str) -> set[int]:
        """Claim a batch in one statement; returns the claimed stream sequences.

        The messages of one batch share a subscription and a stream, so the
        sequence identifies each one. A message whose epoch has no watermark row
        yet (so no lane) is not claimed by the statement: when some were not,
        the missing rows are made here and the claim runs again, in this
        transaction (:func:`eop.pg.sql.inbox.create_lanes`).
        """
        if not messages:
            return set()
        arguments = self.claim_arguments(messages, outcome)
        claimed = await self._claim(arguments)
        if len(claimed) < len(messages) and await self._create_lanes(messages):
            claimed |= await self._claim(arguments)
        return claimed

    async def _claim(self, arguments: tuple[Any, ...]) -> set[int]:
        """Run the claim with ``arguments`` (:meth:`claim_arguments`); the claimed sequences.
        A driver's transaction sends it its own way."""
        return {int(row[0]) for row in await self._rows(claim_sql.claim(self.tables, arguments))}

    async def _create_lanes(self, messages: list[Message]) -> bool:
        """Make the watermark rows of the epochs of ``messages`` that have none; True when
        this made any."""
        first = messages[0]
        epochs = sorted({m.stream_epoch for m in messages})
        bound = inbox_sql.create_lanes(self.tables, first.subscription, first.stream, epochs)
        return bool(await self._rows(*bound))

    def claim_arguments(self, messages: list[Message], outcome: str) -> tuple[Any, ...]:
        """The claim's parameters for ``messages`` (:func:`eop.pg.sql.claim.claim_arguments`): the
        values of :meth:`claim_row`, shared ones once."""
        first = messages[0]
        subscriptions = [m.subscription for m in messages]
        streams = [m.stream for m in messages]
        if subscriptions.count(first.subscription) != len(messages) or streams.count(
            first.stream
        ) != len(messages):
            raise ValueError("a batch claim takes the messages of one subscription and stream")
        return claim_sql.claim_arguments(
            first.subscription,
            first.stream,
            outcome,
            [m.seq for m in messages],
            [m.fingerprint for m in messages],
            [m.stream_epoch for m in messages],
            [m.num_delivered for m in messages],
            [m.msg_id for m in messages] if self.spec.msg_id_guard else [None] * len(messages),
        )

    def claim_row(self, m: Message, outcome: str) -> dict[str, Any]:
        """The inbox row that claims ``m`` with ``outcome``: its key as the message names it
        (the claim finds the lane of its subscription, stream and epoch) and its values."""
        return {
            "subscription": m.subscription,
            "stream": m.stream,
            "stream_epoch": m.stream_epoch,
            "stream_seq": m.seq,
            "fingerprint": m.fingerprint,
            "msg_id": m.msg_id if self.spec.msg_id_guard else None,
            "outcome": outcome,
            "delivery_count": m.num_delivered,
        }

    async def take_turn(self) -> None:
        """Wait for this transaction's turn among the fleet's contended ones
        (:func:`eop.pg.sql.turns.turn`), held until it ends."""
        await self._execute(*turns_sql.turn(self.tables))

    async def unclaim(self, message: Message) -> None:
        """Drop this transaction's claim of ``message`` (its handler failed in a batch)."""
        await self._rows(*inbox_sql.unclaim(self.tables, *_key(message)))

    async def find(self, message: Message) -> Existing | None:
        """What the inbox holds under the message's key, else under its msg-id."""
        rows = await self._rows(*inbox_sql.find_by_key(self.tables, *_key(message)))
        if rows:
            return Existing(by="key", fingerprint=rows[0][0], outcome=rows[0][1])
        if message.msg_id is not None and self.spec.msg_id_guard:
            rows = await self._rows(
                *inbox_sql.find_by_msg_id(self.tables, message.subscription, message.msg_id)
            )
            if rows:
                return Existing(by="msg_id", fingerprint=None, outcome=rows[0][3])
        rows = await self._rows(
            inbox_sql.watermark(
                self.tables, message.subscription, message.stream, message.stream_epoch
            )
        )
        if rows and message.seq <= rows[0][0]:
            # Compacted: its outcome committed before the consumer's ack floor passed it.
            return Existing(by="watermark", fingerprint=None, outcome=models.OUTCOME_PROCESSED)
        return None

    async def has_dead_letter(self, message: Message) -> bool:
        """Whether a dead letter for this message (key and fingerprint) is recorded."""
        bound = inbox_sql.find_dead_letter(self.tables, *_key(message), message.fingerprint)
        return bool(await self._rows(*bound))

    async def count_failure(
        self, message: Message, error: str, *, parked: bool, due_in_s: float
    ) -> int:
        """Add one handler failure to the message's count, keeping the message; the new count."""
        row = {
            "subscription": message.subscription,
            "stream": message.stream,
            "stream_epoch": message.stream_epoch,
            "stream_seq": message.seq,
            "last_error": message_mod.pg_text(error),
            "parked": parked,
            "due_in_s": due_in_s,
            "subject": message.subject,
            # The handler needs the headers as they were (secrets included) on its
            # retry; JSON in bytea keeps any character, NUL too.
            "headers": json.dumps(dict(message.headers)).encode(),
            "payload": message.data,
            "stored_at": message.timestamp,
        }
        rows = await self._rows(*retries_sql.count_failure(self.tables, row))
        return int(rows[0][0])

    async def count_run(self, message: Message) -> int:
        """Count a run of the redelivered ``message``; its runs without an outcome (0 when
        it has its outcome already)."""
        rows = await self._rows(*retries_sql.count_run(self.tables, _run_row(message)))
        return int(rows[0][0]) if rows else 0

    async def count_first_run(self, message: Message) -> bool:
        """Count the run of the redelivered ``message`` if it is its first without an
        outcome (no ``retries`` row, no inbox row); False, nothing written, otherwise."""
        rows = await self._rows(*retries_sql.count_first_run(self.tables, _run_row(message)))
        return bool(rows)

    async def forget_failures(self, message: Message) -> None:
        """Drop the message's failure count and parked copy (it has its outcome)."""
        await self._execute(*retries_sql.forget_failures(self.tables, *_key(message)))

    async def forget_runs(self, message: Message) -> None:
        """Drop the message's run count, unless it is parked
        (:func:`eop.pg.sql.retries.forget_runs`)."""
        await self._execute(*retries_sql.forget_runs(self.tables, *_key(message)))

    async def reschedule(self, message: Message, due_in_s: float) -> None:
        """Run a parked message again ``due_in_s`` from now."""
        await self._execute(*retries_sql.reschedule(self.tables, *_key(message), due_in_s))

    async def lock_run(self, message: Message, runs: int) -> bool:
        """Lock a parked message for its run number ``runs``; False if another run took it."""
        return bool(await self._rows(*retries_sql.lock_run(self.tables, *_key(message), runs)))

    async def settle_retrying(self, message: Message, outcome: str) -> bool:
        """Give a retrying message its outcome; False when it is not retrying (any more)."""
        bound = retries_sql.settle_retrying(self.tables, *_key(message), outcome)
        return bool(await self._rows(*bound))

    async def lock_runs(self, messages: list[Message], runs: list[int]) -> set[int]:
        """Lock a poll's parked messages for their runs in one statement; the sequences locked."""
        if not messages:
            return set()
        bound = retries_sql.lock_runs(
            self.tables, *_epoch_of(messages), [m.seq for m in messages], runs
        )
        return {int(row[0]) for row in await self._rows(*bound)}

    async def count_parked_failures(
        self, messages: list[Message], errors: list[str], due_in_s: list[float]
    ) -> dict[int, int]:
        """Count one more failure of each locked parked message; the new counts by sequence."""
        if not messages:
            return {}
        bound = retries_sql.count_parked_failures(
            self.tables,
            *_epoch_of(messages),
            [m.seq for m in messages],
            [message_mod.pg_text(error) for error in errors],
            due_in_s,
        )
        return {int(row[0]): int(row[1]) for row in await self._rows(*bound)}

    async def settle_retrying_many(self, messages: list[Message], outcomes: list[str]) -> set[int]:
        """Give retrying messages their outcomes; the sequences of those that were retrying."""
        if not messages:
            return set()
        seqs = [m.seq for m in messages]
        bound = retries_sql.settle_retrying_many(self.tables, *_epoch_of(messages), seqs, outcomes)
        return {int(row[0]) for row in await self._rows(*bound)}

    async def forget_failures_many(self, messages: list[Message]) -> None:
        """Drop the failure counts and parked copies of ``messages``."""
        if messages:
            seqs = [m.seq for m in messages]
            await self._execute(
                *retries_sql.forget_failures_many(self.tables, *_epoch_of(messages), seqs)
            )

    async def add_dead_letters(self, messages: list[Message], dead: list[DeadLetter]) -> None:
        """Record each message's dead letter, as one executemany where the connection can."""
        rows = [
            inbox_sql.insert_dead_letter(self.tables, self._dead_letter_row(m, d))[1]
            for m, d in zip(messages, dead, strict=True)
        ]
        if rows:
            await self._execute_many(retries_sql.insert_dead_letters(self.tables), rows)

    async def add_dead_letter(self, message: Message, dead: DeadLetter) -> None:
        """Record the dead letter: reason, error, headers without secrets, payload."""
        await self._rows(
            *inbox_sql.insert_dead_letter(self.tables, self._dead_letter_row(message, dead))
        )

    def _dead_letter_row(self, message: Message, dead: DeadLetter) -> dict[str, Any]:
        """The dead letter's columns: the message, headers without secrets, why."""
        return {
            "subscription": message.subscription,
            "stream": message.stream,
            "stream_epoch": message.stream_epoch,
            "stream_seq": message.seq,
            "fingerprint": message.fingerprint,
            "msg_id": message.msg_id,
            "subject": message.subject,
            "headers": json.loads(json.dumps(redaction.redact_headers(message.headers))),
            "payload": message.data,
            "reason": dead.reason,
            "error": dead.error,
            "traceback": dead.traceback,
            "delivery_count": message.num_delivered,
        }


def _key(message: Message) -> tuple[str, str, str, int]:
    return (message.subscription, message.stream, message.stream_epoch, message.seq)


def _epoch_of(messages: list[Message]) -> tuple[str, str, str]:
    """The subscription, stream and epoch all of ``messages`` share (a poll's statements
    take one's messages)."""
    first = messages[0]
    shared = (first.subscription, first.stream, first.stream_epoch)
    if any((m.subscription, m.stream, m.stream_epoch) != shared for m in messages):
        raise ValueError("these statements take the messages of one subscription, stream, epoch")
    return shared


def _run_row(message: Message) -> dict[str, object]:
    """The ``retries`` row of a redelivered message's counted run."""
    return {
        "subscription": message.subscription,
        "stream": message.stream,
        "stream_epoch": message.stream_epoch,
        "stream_seq": message.seq,
        "subject": message.subject,
        "headers": json.dumps(dict(message.headers)).encode(),
        "payload": message.data,
        "stored_at": message.timestamp,
    }
