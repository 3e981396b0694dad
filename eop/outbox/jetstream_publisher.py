"""The relay's publisher to JetStream: a batch of outbox rows sent at once, PubAcks awaited.

Every row goes out with ``publish_async`` and its ``Nats-Msg-Id``, so a
re-send is dropped by the stream inside its duplicate window and by an eop
consumer's msg-id guard after it; the PubAcks are awaited together, up to
``publish_timeout_s``. What JetStream answers becomes a receipt per row
(:mod:`eop.outbox.publishing`): a PubAck published; too large or a header
nats-py rejects, parked; no stream for the subject (confirmed by JetStream
itself) or another 4xx refusal, refused; anything else, unanswered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from eop import errors
from eop.message import MSG_ID_HEADER
from eop.outbox import outgoing
from eop.outbox.publishing import (
    HELD,
    PARK_BAD_HEADER,
    PARK_NO_STREAM,
    PARK_REFUSED,
    PARK_TOO_LARGE,
    UNANSWERED,
    UNSENT,
    Fate,
    Receipt,
    Row,
)
from eop.settings import Settings

# nats-server's error code for a message above its max_payload.
_TOO_LARGE_CODES = frozenset({10054})


class JetStreamPublisher:
    """Publishes outbox rows through ``nc`` (a :class:`eop.outbox.publishing.Publisher`)."""

    target = "NATS"

    def __init__(self, nc: NATS, settings: Settings) -> None:
        self.nc = nc
        self.timeout_s = settings.publish_timeout_s
        """How long the PubAcks of a batch are waited for."""
        self._js = nc.jetstream(publish_async_max_pending=max(settings.outbox_batch, 1))

    async def publish(self, rows: Sequence[Row]) -> list[Receipt]:
        """Send ``rows`` and wait for their PubAcks; a receipt per row, in order."""
        # Each row's is set below; one sent gets its PubAck's, or stays unanswered.
        receipts = [UNANSWERED] * len(rows)
        limit = int(self.nc.max_payload)
        sent: list[tuple[int, asyncio.Future[Any]]] = []
        for i, row in enumerate(rows):
            headers = {**row.headers, MSG_ID_HEADER: row.msg_id}
            size = outgoing.wire_size(row.payload, headers)
            if size > limit:
                receipts[i] = Receipt.parked(
                    PARK_TOO_LARGE, f"{size} bytes, above the server's max_payload of {limit}"
                )
                continue
            refusal = _unframeable(row.subject, headers)
            if refusal is not None:
                receipts[i] = refusal
                continue
            if not self.nc.is_connected:
                # nats-py would buffer it until it reconnects and, its buffer full, refuse
                # it (as it does a row _unframeable catches) only after taking one of
                # publish_async's slots, for good: with all spent, the relay would wait
                # for ever. A later round sends it.
                receipts[i] = UNSENT
                continue
            try:
                future = await self._js.publish_async(row.subject, row.payload, headers=headers)
            except nats.errors.BadHeaderError as exc:
                receipts[i] = Receipt.parked(PARK_BAD_HEADER, str(exc)[:500])
                continue
            except Exception:
                for _, pending in sent:
                    pending.cancel()
                raise
            sent.append((i, future))
        if sent:
            await asyncio.wait([future for _, future in sent], timeout=self.timeout_s)
        for i, future in sent:
            receipts[i] = _receipt(rows[i], future)
        await self._confirm_no_stream(rows, receipts)
        return receipts

    async def _confirm_no_stream(self, rows: Sequence[Row], receipts: list[Receipt]) -> None:
        """Hold, rather than count, the subjects JetStream does not say no stream holds.

        'No responders' also answers a publish while JetStream restarts or a
        stream has no leader yet: for those, only JetStream's own "no stream
        matches" counts.
        """
        confirmed: dict[str, bool] = {}
        for i, receipt in enumerate(receipts):
            if receipt.fate is not Fate.REFUSED or receipt.reason != PARK_NO_STREAM:
                continue
            subject = rows[i].subject
            if subject not in confirmed:
                confirmed[subject] = await self._no_stream_holds(subject)
            if not confirmed[subject]:
                receipts[i] = HELD

    async def _no_stream_holds(self, subject: str) -> bool:
        try:
            await self._js.find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            return True
        except Exception:
            return False  # JetStream did not answer: not a refusal
        return False


def _receipt(row: Row, future: asyncio.Future[Any]) -> Receipt:
    if not future.done():
        future.cancel()
        return UNANSWERED
    exc = future.exception()
    if exc is None:
        ack = future.result()
        return Receipt.published(str(ack.stream), int(ack.seq))
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return Receipt.refused(PARK_NO_STREAM, f"no stream holds subject {row.subject}")
    if isinstance(exc, nats.js.errors.APIError) and exc.err_code in _TOO_LARGE_CODES:
        return Receipt.parked(PARK_TOO_LARGE, str(exc.description or exc)[:500])
    if isinstance(exc, nats.js.errors.APIError) and exc.code is not None and exc.code < 500:
        # A stream that is full (discard new), a limit per subject: maybe for a while
        # only, so counted and retried like a missing stream, not parked at once.
        return Receipt.refused(PARK_REFUSED, str(exc.description or exc)[:500])
    # A server error (503: no stream leader yet) or a dropped connection: try again.
    return UNANSWERED


def _unframeable(subject: str, headers: Mapping[str, str]) -> Receipt | None:
    """Why NATS cannot carry a row as it is (parked), else None.

    What eop.outbox.add refuses: rows written otherwise (plain SQL, another
    version) may hold anything, and nats-py refuses a bad subject or header
    only after it took a slot of publish_async that it never gives back.
    """
    try:
        outgoing.check_subject(subject)
    except errors.UnpublishableMessage as exc:
        return Receipt.parked(PARK_REFUSED, str(exc)[:500])
    try:
        for name, value in headers.items():
            outgoing.check_header(name, value)
    except errors.UnpublishableMessage as exc:
        return Receipt.parked(PARK_BAD_HEADER, str(exc)[:500])
    return None
