"""Retries held in the database: a failed message waits in the retries table, not in NATS.

A message whose handler failed (and may be retried) is *parked*: in one
transaction its failure is counted, its copy kept in the retries table and
its inbox row written as ``retrying``; after COMMIT it is acked. It then no
longer occupies the consumer's ack-pending window (MaxAckPending), where
backing-off failures would keep good messages from being delivered at all.
A worker's retry loop takes the parked messages that are due and runs them as
:class:`ParkedDelivery` deliveries through the same protocol; their claim is
the ``retrying`` row, turned into the outcome in the transaction of the run.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Awaitable, Callable
from typing import Any

from eop import message
from eop.handler import HandlerSpec
from eop.pg import store
from eop.pg.sql import retries as retries_sql


@dataclasses.dataclass(frozen=True)
class _Sequence:
    stream: int
    consumer: int = 0


@dataclasses.dataclass(frozen=True)
class _Metadata:
    """The part of nats-py's ``Msg.Metadata`` the protocol reads."""

    stream: str
    sequence: _Sequence
    num_delivered: int
    timestamp: datetime.datetime | None
    consumer: str = ""
    """Empty: a parked run goes to no consumer; it is settled in the database alone."""


class ParkedDelivery:
    """One run of a parked message, taken from the retries table.

    It quacks like a JetStream delivery for the protocol (:class:`eop.types.Delivery`),
    but there is nothing to tell NATS: the message was acked when it was
    parked, and its outcome lives in the database alone.
    """

    reply = ""
    """No reply subject: nothing is sent to NATS for a parked message."""

    def __init__(
        self,
        msg: message.Message,
        *,
        failures: int,
        runs: int,
        renew: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.message = msg
        """The message as it was stored, ``num_delivered`` being this run's attempt."""
        self.failures = failures
        """The handler failures counted before this run."""
        self.runs = runs
        """Runs taken so far, this one included (the lease: a later run changes it)."""
        self.subject = msg.subject
        self.data = msg.data
        self.headers: dict[str, str] | None = dict(msg.headers)
        self._renew = renew

    @property
    def metadata(self) -> _Metadata:
        """Stream and sequence of the parked message, as a delivery's metadata."""
        m = self.message
        return _Metadata(m.stream, _Sequence(m.seq), m.num_delivered, m.timestamp)

    async def ack_sync(self, timeout: float = 1.0) -> None:
        """Nothing to confirm: the outcome committed is the whole settlement."""

    async def nak(self, delay: float | None = None) -> None:
        """Nothing to do: an unsettled parked message is run again when its lease ends."""

    async def term(self) -> None:
        """Nothing to do: the dead letter committed is the whole settlement."""

    @property
    def is_acked(self) -> bool:
        """Never: nothing is sent to NATS, and the run's lease is renewed until released."""
        return False

    async def in_progress(self) -> None:
        """Move the run's lease ahead in the retries table, as ``in_progress()`` does a
        delivery's: a run waiting (for a lock, a pooled connection, a thread) is not
        taken again by another poll, which would count one more run."""
        if self._renew is not None:
            await self._renew()


async def take_due(
    store: store.PostgresStore, spec: HandlerSpec, limit: int, lease_s: float
) -> list[ParkedDelivery]:
    """Lease up to ``limit`` parked messages of ``spec`` whose retry is due."""
    stmt, params = retries_sql.take_due(store.tables, spec.name, limit, lease_s)
    async with store.session() as session, session.begin():
        rows = (await session.execute(stmt, params)).all()
    return [_delivery(store, spec, tuple(row), lease_s) for row in rows]


def _renewal(
    store: store.PostgresStore, spec: HandlerSpec, msg: message.Message, runs: int, lease_s: float
) -> Callable[[], Awaitable[None]]:
    stmt, params = retries_sql.renew_run(
        store.tables, spec.name, msg.stream, msg.stream_epoch, msg.seq, runs, lease_s
    )

    async def renew() -> None:
        async with store.session() as session, session.begin():
            await session.execute(stmt, params)

    return renew


def _delivery(
    store: store.PostgresStore, spec: HandlerSpec, row: tuple[Any, ...], lease_s: float
) -> ParkedDelivery:
    stream, epoch, seq, failures, runs, subject, headers, payload, stored_at = row
    msg = message.Message(
        subscription=spec.name,
        subject=subject,
        data=bytes(payload),
        headers=json.loads(bytes(headers)),
        stream=stream,
        stream_epoch=epoch,
        seq=int(seq),
        num_delivered=int(failures) + 1,
        timestamp=stored_at,
    )
    renew = _renewal(store, spec, msg, int(runs), lease_s)
    return ParkedDelivery(msg, failures=int(failures), runs=int(runs), renew=renew)
