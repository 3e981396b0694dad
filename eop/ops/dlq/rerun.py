"""A rerun: the handler runs here on the stored message, in one transaction with the
bookkeeping (``eop dlq replay --rerun``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from eop import errors, log, message
from eop.ops.dlq import dead_letters, state
from eop.pg import models, statements
from eop.pg.sql import dead_letters as dead_letters_sql

if TYPE_CHECKING:
    from eop.app import App
    from eop.pg.store import PostgresStore


async def rerun(app: App, dead_letter_id: int, *, again: bool = False) -> state.ReplayResult:
    """Run the handler on the stored message, in one transaction with the bookkeeping."""
    store = app.make_store()
    try:
        return await _rerun(store, app, dead_letter_id, again)
    finally:
        store.close()  # its sync threads (and their connections) with it


async def _rerun(
    store: PostgresStore, app: App, dead_letter_id: int, again: bool
) -> state.ReplayResult:
    tables = models.tables(app.settings.schema)
    # The row's subscription is not known before reading it; any spec of
    # the right kind opens the transaction, the real one is checked below.
    peek = await dead_letters.DeadLetters(app).get(dead_letter_id)
    spec = app.handlers.get(peek["subscription"])
    if spec is None:
        known = ", ".join(sorted(app.handlers)) or "none"
        raise errors.ConfigurationError(
            f"dead letter {dead_letter_id} belongs to handler {peek['subscription']!r}, "
            f"which this app does not register (registered: {known}); pass the app that does"
        )
    async with store.transaction(spec) as tx:
        assert isinstance(tx, statements.Statements)
        rows = await tx.select(dead_letters_sql.lock_dead_letter(tables, dead_letter_id))
        if not rows:
            raise state.not_found(dead_letter_id)
        row = dict(zip(tables.dead_letters.columns.keys(), rows[0], strict=True))
        done = state.already_done(row, again)
        if done is not None:
            return done
        if state.pending_publish(row):
            raise errors.ReplayRefused(
                f"dead letter {dead_letter_id} has a published replay in flight "
                f"(msg-id {row['replay_msg_id']}): finish it with `eop dlq replay "
                f"{dead_letter_id}` rather than running the handler a second time"
            )
        msg = _message_of(row)
        try:
            await tx.run(msg)
        except Exception as exc:
            await tx.rollback()
            return state.ReplayResult(
                id=dead_letter_id,
                status="failed",
                mode=models.REPLAY_RERUN,
                generation=row["replay_generation"],
                detail=log.brief_error(exc),
            )
        generation = row["replay_generation"] + 1
        await tx.select(
            dead_letters_sql.settle_rerun_inbox(
                tables,
                row["subscription"],
                row["stream"],
                row["stream_epoch"],
                row["stream_seq"],
                row["fingerprint"],
            )
        )
        await tx.select(
            dead_letters_sql.start_replay(
                tables,
                dead_letter_id,
                generation=generation,
                mode=models.REPLAY_RERUN,
                msg_id=None,
                done=True,
            )
        )
        try:
            await tx.commit()
        except errors.AmbiguousCommit:
            raise errors.AmbiguousCommit(
                f"the connection dropped while committing the rerun of dead letter "
                f"{dead_letter_id}: `eop dlq show {dead_letter_id}` tells whether it "
                "committed (replayed_at set); do not rerun it before checking"
            ) from None
    return state.ReplayResult(
        id=dead_letter_id, status="rerun", mode=models.REPLAY_RERUN, generation=generation
    )


def _message_of(row: Mapping[str, Any]) -> message.Message:
    """The message a rerun hands the handler: the stored one, as it was delivered."""
    return message.Message(
        subscription=row["subscription"],
        subject=row["subject"],
        data=bytes(row["payload"]),
        headers={str(k): str(v) for k, v in (row["headers"] or {}).items()},
        stream=row["stream"],
        stream_epoch=row["stream_epoch"],
        seq=int(row["stream_seq"]),
        num_delivered=int(row["delivery_count"]) + 1,
    )
