"""Statements of the test kit (:mod:`eop.testing`): hurrying parked retries, reading
what a run dead-lettered."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from eop.pg import models

# --- The test kit (eop.testing.TestApp) -------------------------------------


def hurry_parked(t: models.Tables, subscription: str) -> sa.Update:
    """Make every parked message of a subscription due now: a test runs its retries at once."""
    c = t.retries.c
    return (
        sa.update(t.retries)
        .where(c.subscription == subscription, c.parked)
        .values(due_at=sa.func.now())
    )


def dead_letters_after(t: models.Tables, after_id: int) -> sa.Select[Any]:
    """Dead letters with an id above ``after_id``, oldest first: the message, why, and its id."""
    c = t.dead_letters.c
    return (
        sa.select(
            c.id,
            c.subscription,
            c.stream,
            c.stream_epoch,
            c.stream_seq,
            c.fingerprint,
            c.msg_id,
            c.subject,
            c.headers,
            c.payload,
            c.reason,
            c.error,
            c.traceback,
            c.delivery_count,
        )
        .where(c.id > after_id)
        .order_by(c.id)
    )


def max_ids(t: models.Tables) -> sa.Select[Any]:
    """The highest dead letter and outbox ids (0 when empty): where a test's reading starts."""
    return sa.select(
        sa.select(sa.func.coalesce(sa.func.max(t.dead_letters.c.id), 0)).scalar_subquery(),
        sa.select(sa.func.coalesce(sa.func.max(t.outbox.c.id), 0)).scalar_subquery(),
    )
