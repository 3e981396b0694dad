"""Handler failures and the retries held in the database: counting runs and failures,
taking due retries (one at a time or a poll's in one transaction), settling them."""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from eop.pg import models
from eop.pg.sql.base import (
    Bound,
    epoch_params,
    in_bound_epoch,
    in_bound_inbox_key,
    in_bound_key,
    in_bound_lane,
    key_params,
    lane_of,
)
from eop.pg.sql.inbox import DEAD_LETTER_COLUMNS

# --- Handler failures and retries held in the database ----------------------


_FAILURE_COLUMNS = (
    "subscription",
    "stream",
    "stream_epoch",
    "stream_seq",
    "last_error",
    "parked",
    "subject",
    "headers",
    "payload",
    "stored_at",
)


_RUN_COLUMNS = tuple(c for c in _FAILURE_COLUMNS if c not in ("last_error", "parked"))


def count_run(t: models.Tables, row: dict[str, Any]) -> Bound:
    """Count one run of a redelivered message before its handler starts; RETURNING its
    runs without an outcome (runs less failures), or no row when it has its outcome.

    Committed on its own, before the handler's transaction: a run that kills its
    process still counts (docs/design.md, 'The crash-loop bound'). ``row`` carries the key
    and the message (subject, headers, payload, stored_at), kept in the row as a
    failure's are.
    """
    if row.keys() != set(_RUN_COLUMNS):
        raise ValueError(f"a run row has exactly the columns {_RUN_COLUMNS}")
    return _count_run(t), {f"p_{name}": value for name, value in row.items()}


@functools.cache
def _count_run(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    return (
        _insert_run(t)
        .on_conflict_do_update(
            index_elements=["subscription", "stream", "stream_epoch", "stream_seq"],
            set_={"runs": c.runs + 1, "updated_at": sa.func.now()},
        )
        .returning(c.runs - c.failures)
    )


def _insert_run(t: models.Tables) -> postgresql.Insert:
    """A message's first counted run, inserted only while its inbox row is absent."""
    c, i = t.retries.c, t.inbox.c
    values = {name: sa.bindparam(f"p_{name}", type_=c[name].type) for name in _RUN_COLUMNS}
    lane = lane_of(t, values["subscription"], values["stream"], values["stream_epoch"])
    settled = sa.exists().where(i.lane == lane, i.stream_seq == values["stream_seq"])
    fresh = {
        **values,
        "failures": sa.literal(0),
        "runs": sa.literal(1),
        "parked": sa.false(),
        "due_at": sa.func.now(),
        "last_error": sa.literal(""),
    }
    return postgresql.insert(t.retries).from_select(
        list(fresh), sa.select(*fresh.values()).where(~settled)
    )


def count_first_run(t: models.Tables, row: dict[str, Any]) -> Bound:
    """:func:`count_run` for a message with no ``retries`` row and no outcome only:
    RETURNING its one run, or no row (nothing written) when it has either.

    A redelivery whose run is its first without an outcome runs beside the
    process's other such runs (docs/design.md, 'The crash-loop bound').
    """
    if row.keys() != set(_RUN_COLUMNS):
        raise ValueError(f"a run row has exactly the columns {_RUN_COLUMNS}")
    return _count_first_run(t), {f"p_{name}": value for name, value in row.items()}


@functools.cache
def _count_first_run(t: models.Tables) -> sa.Executable:
    insert = _insert_run(t)
    return insert.on_conflict_do_nothing(
        index_elements=["subscription", "stream", "stream_epoch", "stream_seq"]
    ).returning(t.retries.c.runs)


def count_failure(t: models.Tables, row: dict[str, Any]) -> Bound:
    """Add one handler failure to a message's count (the row holds the message); RETURNING it.

    ``row`` carries the key, ``last_error``, ``parked``, ``due_in_s`` and the
    message (subject, headers, payload, stored_at); a first failure inserts it.
    """
    if row.keys() != {*_FAILURE_COLUMNS, "due_in_s"}:
        raise ValueError(f"a failure row has exactly the columns {_FAILURE_COLUMNS}, due_in_s")
    return _count_failure(t), {f"p_{name}": value for name, value in row.items()}


def _due_in(parameter: str) -> sa.ColumnElement[Any]:
    """now() plus the seconds of ``parameter``."""
    seconds = sa.bindparam(parameter, type_=sa.Float)
    return sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, seconds)


@functools.cache
def _count_failure(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    values = {name: sa.bindparam(f"p_{name}", type_=c[name].type) for name in _FAILURE_COLUMNS}
    insert = postgresql.insert(t.retries).values(
        {**values, "failures": 1, "due_at": _due_in("p_due_in_s")}
    )
    return insert.on_conflict_do_update(
        index_elements=["subscription", "stream", "stream_epoch", "stream_seq"],
        set_={
            "failures": c.failures + 1,
            "last_error": insert.excluded.last_error,
            "parked": insert.excluded.parked,
            "due_at": insert.excluded.due_at,
            "updated_at": sa.func.now(),
        },
    ).returning(c.failures)


def reschedule(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int, due_in_s: float
) -> Bound:
    """Set when a parked message is next run."""
    params = key_params(subscription, stream, epoch, seq)
    return _reschedule(t), {**params, "p_due_in_s": due_in_s}


@functools.cache
def _reschedule(t: models.Tables) -> sa.Executable:
    return (
        sa.update(t.retries)
        .where(*in_bound_key(t.retries.c))
        .values(due_at=_due_in("p_due_in_s"), updated_at=sa.func.now())
    )


def forget_failures(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int
) -> Bound:
    """Delete a message's failure count (it has its outcome now)."""
    return _forget_failures(t), key_params(subscription, stream, epoch, seq)


@functools.cache
def _forget_failures(t: models.Tables) -> sa.Executable:
    return sa.delete(t.retries).where(*in_bound_key(t.retries.c))


def forget_runs(t: models.Tables, subscription: str, stream: str, epoch: str, seq: int) -> Bound:
    """Delete a message's run count (an ordered handler's failure count with it), found
    settled by a redelivery: not a parked row, whose retry is still to come.

    A redelivery of a parked message finds its ``retrying`` inbox row, a duplicate,
    and is acked; the parked row is that retry, settled by its own run. Any other
    row counts the runs (and an ordered handler's failures) of deliveries that ended
    without an outcome, which the message has now (docs/design.md, 'The crash-loop
    bound').
    """
    return _forget_runs(t), key_params(subscription, stream, epoch, seq)


@functools.cache
def _forget_runs(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    return sa.delete(t.retries).where(*in_bound_key(c), ~c.parked)


def forget_runs_below(
    t: models.Tables, subscription: str, stream: str, epoch: str, watermark: int
) -> Bound:
    """Delete the rows of an epoch's messages at or below its ``watermark`` that are not
    parked: compaction's sweep of the run counts no settlement forgot.

    A row not parked belongs to a delivery not acked yet (a redelivery's counted
    run, an ordered handler's nak'ed failure); at or below the watermark the
    message was acked or termed, so its outcome (or its parking) committed and the
    row counts nothing any more. A parked row's message was acked when it was
    parked, and its retry is still to come: it stays. One range of the primary
    key (subscription, stream, epoch, sequence).
    """
    params = {**epoch_params(subscription, stream, epoch), "p_value": watermark}
    return _forget_runs_below(t), params


@functools.cache
def _forget_runs_below(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    watermark = sa.bindparam("p_value", type_=sa.BigInteger)
    return sa.delete(t.retries).where(*in_bound_epoch(c), c.stream_seq <= watermark, ~c.parked)


def take_due(t: models.Tables, subscription: str, limit: int, lease_s: float) -> Bound:
    """Lease up to ``limit`` parked messages that are due; RETURNING them.

    Each one's ``runs`` goes up and its ``due_at`` moves a lease ahead, so
    another worker does not take it meanwhile, and a run that dies without an
    outcome is still counted (the crash-loop bound). SKIP LOCKED: workers
    taking at the same time never wait for each other.
    """
    return _take_due(t), {"p_subscription": subscription, "p_limit": limit, "p_lease_s": lease_s}


@functools.cache
def _take_due(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    due = (
        sa.select(c.subscription, c.stream, c.stream_epoch, c.stream_seq)
        .where(
            c.subscription == sa.bindparam("p_subscription", type_=sa.Text),
            c.parked,
            c.due_at <= sa.func.now(),
        )
        .order_by(c.due_at)
        .limit(sa.bindparam("p_limit", type_=sa.Integer))
        .with_for_update(skip_locked=True)
    )
    lease_s = sa.bindparam("p_lease_s", type_=sa.Float)
    lease = sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, lease_s)
    return (
        sa.update(t.retries)
        .where(sa.tuple_(c.subscription, c.stream, c.stream_epoch, c.stream_seq).in_(due))
        .values(runs=c.runs + 1, due_at=lease, updated_at=sa.func.now())
        .returning(
            c.stream,
            c.stream_epoch,
            c.stream_seq,
            c.failures,
            c.runs,
            c.subject,
            c.headers,
            c.payload,
            c.stored_at,
        )
    )


def renew_run(
    t: models.Tables,
    subscription: str,
    stream: str,
    epoch: str,
    seq: int,
    runs: int,
    lease_s: float,
) -> Bound:
    """Move a parked message's lease ahead while this run (``runs``) holds it.

    SKIP LOCKED: a row this run's own transaction has locked needs no renewal
    (:func:`take_due` skips it too), and the renewal must never wait on it.
    """
    params = {**key_params(subscription, stream, epoch, seq), "p_runs": runs}
    return _renew_run(t), {**params, "p_lease_s": lease_s}


@functools.cache
def _renew_run(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    runs = sa.bindparam("p_runs", type_=sa.Integer)
    held = (
        sa.select(c.subscription, c.stream, c.stream_epoch, c.stream_seq)
        .where(*in_bound_key(c), c.parked, c.runs == runs)
        .with_for_update(skip_locked=True)
    )
    lease_s = sa.bindparam("p_lease_s", type_=sa.Float)
    return (
        sa.update(t.retries)
        .where(sa.tuple_(c.subscription, c.stream, c.stream_epoch, c.stream_seq).in_(held))
        .values(due_at=sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, lease_s))
    )


def lock_run(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int, runs: int
) -> Bound:
    """Lock a parked message for this run; no row when another run took it since."""
    return _lock_run(t), {**key_params(subscription, stream, epoch, seq), "p_runs": runs}


@functools.cache
def _lock_run(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    runs = sa.bindparam("p_runs", type_=sa.Integer)
    return sa.select(c.failures).where(*in_bound_key(c), c.parked, c.runs == runs).with_for_update()


def settle_retrying(
    t: models.Tables, subscription: str, stream: str, epoch: str, seq: int, outcome: str
) -> Bound:
    """Turn a retrying inbox row into its outcome; RETURNING it only when it was retrying."""
    params = key_params(subscription, stream, epoch, seq)
    return _settle_retrying(t), {**params, "p_outcome": outcome}


@functools.cache
def _settle_retrying(t: models.Tables) -> sa.Executable:
    c = t.inbox.c
    return (
        sa.update(t.inbox)
        .where(*in_bound_inbox_key(t), c.outcome == models.OUTCOME_RETRYING)
        .values(outcome=sa.bindparam("p_outcome", type_=sa.Text), processed_at=sa.func.now())
        .returning(c.stream_seq)
    )


# --- The due retries of one poll, in one transaction (eop.protocol.retry_batch) -------
#
# Each statement takes the parked messages of one subscription, stream and epoch,
# one array element per message: one statement for the poll, not one per run.


def _seqs() -> sa.BindParameter[Any]:
    return sa.bindparam("p_seqs", type_=postgresql.ARRAY(sa.BigInteger))


def lock_runs(
    t: models.Tables, subscription: str, stream: str, epoch: str, seqs: list[int], runs: list[int]
) -> Bound:
    """Lock the parked messages ``seqs`` for the runs that took them (``runs``, element by
    element); RETURNING the sequences locked.

    :func:`lock_run` for a poll's runs at once: a message another run took
    since (its ``runs`` moved on) or that settled is not locked. A row another
    transaction holds is waited for, as :func:`lock_run` waits (``lock_timeout``
    bounds it), not skipped: the holder is mostly the next poll's
    :func:`take_due`, whose SKIP LOCKED scan locks a row it then finds not due
    for an instant, and a row skipped here would wait out its whole lease.
    """
    params = {**epoch_params(subscription, stream, epoch), "p_seqs": seqs, "p_runs": runs}
    return _lock_runs(t), params


@functools.cache
def _lock_runs(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    taken = (
        sa.func.unnest(_seqs(), sa.bindparam("p_runs", type_=postgresql.ARRAY(sa.Integer)))
        .table_valued("seq", "runs")
        .render_derived()
    )
    return (
        sa.select(c.stream_seq)
        .where(
            *in_bound_epoch(c),
            c.parked,
            c.stream_seq == sa.any_(_seqs()),
            sa.tuple_(c.stream_seq, c.runs).in_(sa.select(taken.c.seq, taken.c.runs)),
        )
        .with_for_update(of=t.retries)
    )


def count_parked_failures(
    t: models.Tables,
    subscription: str,
    stream: str,
    epoch: str,
    seqs: list[int],
    last_errors: list[str],
    due_in_s: list[float],
) -> Bound:
    """Add one handler failure to each of the parked messages ``seqs`` (locked by this
    transaction), with its error and its next run ``due_in_s`` from now; RETURNING each
    one's sequence and new count.

    :func:`count_failure` for rows that exist: a parked message's row is its
    copy, and the run holds its lock, so an UPDATE does.
    """
    params = {
        **epoch_params(subscription, stream, epoch),
        "p_seqs": seqs,
        "p_errors": last_errors,
        "p_due_in_s": due_in_s,
    }
    return _count_parked_failures(t), params


@functools.cache
def _count_parked_failures(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    failed = (
        sa.func.unnest(
            _seqs(),
            sa.bindparam("p_errors", type_=postgresql.ARRAY(sa.Text)),
            sa.bindparam("p_due_in_s", type_=postgresql.ARRAY(sa.Float)),
        )
        .table_valued("seq", "error", "due_in_s")
        .render_derived()
    )
    due_at = sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, failed.c.due_in_s)
    return (
        sa.update(t.retries)
        .where(*in_bound_epoch(c), c.stream_seq == failed.c.seq)
        .values(
            failures=c.failures + 1,
            last_error=failed.c.error,
            due_at=due_at,
            updated_at=sa.func.now(),
        )
        .returning(c.stream_seq, c.failures)
    )


def settle_retrying_many(
    t: models.Tables,
    subscription: str,
    stream: str,
    epoch: str,
    seqs: list[int],
    outcomes: list[str],
) -> Bound:
    """Turn the retrying inbox rows ``seqs`` into their ``outcomes``; RETURNING the
    sequences of those that were retrying (:func:`settle_retrying` for many)."""
    params = {**epoch_params(subscription, stream, epoch), "p_seqs": seqs, "p_outcomes": outcomes}
    return _settle_retrying_many(t), params


@functools.cache
def _settle_retrying_many(t: models.Tables) -> sa.Executable:
    c = t.inbox.c
    settled = (
        sa.func.unnest(_seqs(), sa.bindparam("p_outcomes", type_=postgresql.ARRAY(sa.Text)))
        .table_valued("seq", "outcome")
        .render_derived()
    )
    return (
        sa.update(t.inbox)
        .where(
            *in_bound_lane(t),
            c.stream_seq == settled.c.seq,
            c.outcome == models.OUTCOME_RETRYING,
        )
        .values(outcome=settled.c.outcome, processed_at=sa.func.now())
        .returning(c.stream_seq)
    )


def forget_failures_many(
    t: models.Tables, subscription: str, stream: str, epoch: str, seqs: list[int]
) -> Bound:
    """Delete the failure counts (and parked copies) of the messages ``seqs``."""
    return _forget_failures_many(t), {**epoch_params(subscription, stream, epoch), "p_seqs": seqs}


@functools.cache
def _forget_failures_many(t: models.Tables) -> sa.Executable:
    c = t.retries.c
    return sa.delete(t.retries).where(*in_bound_epoch(c), c.stream_seq == sa.any_(_seqs()))


def insert_dead_letters(t: models.Tables) -> sa.Executable:
    """:func:`insert_dead_letter` without RETURNING, to run with many rows (an executemany);
    each row's parameters are those :func:`insert_dead_letter` gives."""
    return _insert_dead_letters(t)


@functools.cache
def _insert_dead_letters(t: models.Tables) -> sa.Executable:
    c = t.dead_letters.c
    values = {name: sa.bindparam(f"p_{name}", type_=c[name].type) for name in DEAD_LETTER_COLUMNS}
    return postgresql.insert(t.dead_letters).values(values).on_conflict_do_nothing()


def count_parked(t: models.Tables, subscription: str) -> sa.Select[Any]:
    """Messages of a subscription whose retry is held in the database."""
    c = t.retries.c
    return sa.select(sa.func.count()).where(c.subscription == subscription, c.parked)
