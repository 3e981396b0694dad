"""The scenarios of ``eop chaos``: which target, which worker settings, which faults.

The promise is never twice *and never zero times*. ``classic`` hunts for
duplicates and losses under crashes and lost replies. The others hunt for the
ways a good message ends with no effect although nothing was wrong with it
(dead-lettered because the infrastructure failed under it), and for workers
that stall or do not stop:

- ``sync-hot-rows``: a sync handler (SQLAlchemy ``Session``) updating one of
  10 hot rows, at eop's default throughput settings;
- ``transfers``: debit/credit transfers between 4 accounts in random order
  (the classic deadlock shape), 2 workers x concurrency 32 in batch mode;
- ``pg-outage``: PostgreSQL down for longer than a message's whole attempts
  budget;
- ``read-only``: the database read-only (``default_transaction_read_only``)
  for as long;
- ``lock-timeouts``: a row the handlers update held locked for as long, so
  their statements hit ``lock_timeout`` (even slots) or ``statement_timeout``
  (odd slots);
- ``long-msg-id``: a message whose ``Nats-Msg-Id`` is 5,000 characters;
- ``bad-subject``: a raw-protocol publish whose subject is not UTF-8;
- ``poison-flood``: hundreds of always-failing messages just ahead of good
  ones (the time until the good ones are done is reported);
- ``mixed``: the classic mix with every hunt above that fits the bank mixed in;
- ``cluster``: three clustered nats-servers and an R3 stream; the stream's
  leader and the consumer's leader SIGKILLed (one at a time, then restarted
  on the same store) while the workers, connected to all three, run and the
  publisher retries (:mod:`eop.tools.chaos.cluster`);
- ``pipeline``: two handlers chained through the outbox (stream A, handler,
  ``eop.outbox.add``, stream B, handler) and a writer committing orders with
  outbox messages as a web service does, under the classic mix; the workers,
  whose relays publish the outbox, are also killed after publishing, during
  the mark and after it, and stream B's duplicate window is 2 s, so that the
  relays' re-sends must be absorbed by the second handler's msg-id guard;
- ``ordered``: an ``order_by="subject:1"`` ledger of 40 accounts whose steps are
  published in order (:mod:`eop.tools.chaos.ordered`), some failing their first
  delivery, some garbage among them; one worker command, then three, then two
  (the second with ``--processes 2``), SIGKILLed, SIGSTOPped past AckWait,
  NATS and PostgreSQL restarted. Besides exactly once, each account's steps
  must commit in order (``order violations``, :func:`eop.tools.chaos.checker.check_order`).

Every scenario also SIGTERMs workers mid-run and times each stop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from eop import errors
from eop.tools.chaos import bank, hot, ordered, pipeline, schedule
from eop.tools.chaos.target import Target

# The hunts' own worker settings: a small attempts budget, so that an outage
# that outlasts it is short enough for a CI run.
_BUDGET_ENV: dict[str, str | None] = {
    "EOP_MAX_ATTEMPTS": "5",
    "EOP_BACKOFF_MAX_S": "1",
    "EOP_TX_RETRIES": "2",
}
# eop's defaults for everything that sizes a worker's work (concurrency, batch,
# pool, timeouts, attempts): None removes the harness's value.
_DEFAULTS_ENV: dict[str, str | None] = {
    name: None
    for name in (
        "EOP_CONCURRENCY",
        "EOP_BATCH",
        "EOP_FETCH_TIMEOUT_S",
        "EOP_MAX_ATTEMPTS",
        "EOP_BACKOFF_BASE_S",
        "EOP_BACKOFF_MAX_S",
        "EOP_ACK_TIMEOUT_S",
        "EOP_ACK_GIVE_UP_S",
        "EOP_LOCK_TIMEOUT_S",
        "EOP_STATEMENT_TIMEOUT_S",
    )
}


def _timeouts_by_slot(slot: int) -> dict[str, str | None]:
    """Even slots: a held lock ends in lock_timeout; odd: in statement_timeout."""
    if slot % 2:
        return {"EOP_LOCK_TIMEOUT_S": "60", "EOP_STATEMENT_TIMEOUT_S": "1"}
    return {"EOP_LOCK_TIMEOUT_S": "1", "EOP_STATEMENT_TIMEOUT_S": "60"}


def _no_slot_env(slot: int) -> dict[str, str | None]:
    return {}


def _no_slot_args(slot: int) -> tuple[str, ...]:
    return ()


def _two_processes_in_slot_1(slot: int) -> tuple[str, ...]:
    """The second worker command runs under eop's supervisor (``--processes 2``)."""
    return ("--processes", "2") if slot == 1 else ()


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One way to run the harness: a target, worker settings and a fault mix."""

    name: str
    summary: str
    target: Callable[[], Target] = bank.target
    weights: Mapping[schedule.Kind, float] = dataclasses.field(
        default_factory=lambda: dict(schedule.WEIGHTS)
    )
    required: tuple[schedule.Kind, ...] = ()
    """Faults that happen once early in every run, whatever the seed draws."""
    env: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    """Worker environment on top of the harness's (None: unset, eop's default)."""
    slot_env: Callable[[int], Mapping[str, str | None]] = _no_slot_env
    overrides: Mapping[str, object] = dataclasses.field(default_factory=dict)
    """:class:`~eop.tools.chaos.harness.Config` fields this scenario sets."""
    require_evidence: bool = False
    """Whether the classic evidence (kills at every fault point...) is demanded."""
    arm_workers: bool = False
    """Whether workers get fault points (kills, raises, stalls, freezes). The hunts run
    unarmed, so that a stall or a dead letter is eop's, not an injected one."""
    kill_spots: tuple[schedule.KillSpot, ...] = schedule.HANDLER_SPOTS
    """Where armed workers die, one spot each (the least hit so far)."""
    relay_spots: tuple[schedule.KillSpot, ...] = ()
    """Where armed workers' relays die besides, one spot each (the least hit so far)."""
    evidence_races: bool = True
    """With ``require_evidence``: demand the hard races (ambiguous commits, lost ack
    replies, overlapping deliveries) too, not only the kills at every spot."""
    nats_nodes: int = 1
    """nats-servers: 3 runs a cluster (:mod:`eop.tools.chaos.cluster`), whose leaders are the
    faults; the fault mix (``weights``) is then unused."""
    slot_args: Callable[[int], tuple[str, ...]] = _no_slot_args
    """Extra ``eop worker`` arguments of the worker command in each slot."""
    initial_workers: int | None = None
    """Worker commands running at the start (None: all of ``Config.workers``); a
    ``scale_workers`` step of the ``timeline`` changes it."""
    timeline: tuple[tuple[float, schedule.Kind, int], ...] = ()
    """Faults at fixed points, besides the seeded draw: ``(fraction of the phase, kind,
    target)`` (:func:`eop.tools.chaos.schedule.timeline`)."""

    def worker_env(self, slot: int) -> dict[str, str | None]:
        """The environment changes of the worker in ``slot``."""
        return {**self.env, **self.slot_env(slot)}


# Few crashes and SIGTERMs (a fault a second, on average): a worker that is
# always stopping or restarting would leave the hunt's fault nothing to hit.
_AROUND: dict[schedule.Kind, float] = {
    "worker_term": 0.2,
    "worker_kill": 0.2,
    "drop_ack_reply": 1.0,
}
_HUNT_PACE = {"mean_fault_gap_s": 1.0}


# Worker deaths and freezes in every spell; server restarts in the storms only
# (schedule.CALM_EVERY_S); a retry on some keys comes from the target itself.
_ORDERED_WEIGHTS: dict[schedule.Kind, float] = {
    "worker_kill": 1.0,
    "worker_stop_long": 0.6,
    "worker_stop": 0.4,
    "worker_term": 0.3,
    "nats_restart": 0.15,
    "pg_restart": 0.15,
}


def _focused(kind: schedule.Kind) -> dict[schedule.Kind, float]:
    """One hunt, plus crashes, lost ack replies and mid-run SIGTERMs around it."""
    return {kind: 0.05, **_AROUND}


def _hunt(
    name: str,
    summary: str,
    kind: schedule.Kind,
    *,
    weights: Mapping[schedule.Kind, float] | None = None,
    slot_env: Callable[[int], Mapping[str, str | None]] = _no_slot_env,
) -> Scenario:
    """A focused hunt for ``kind``: once early in every run, then as the seed draws it
    (``weights``: :func:`_focused` by default), on the small attempts budget, at the
    hunts' pace."""
    return Scenario(
        name,
        summary,
        weights=_focused(kind) if weights is None else weights,
        required=(kind, "worker_term"),
        env=_BUDGET_ENV,
        slot_env=slot_env,
        overrides=_HUNT_PACE,
    )


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "classic",
            "crashes, outages, lost replies (the default)",
            require_evidence=True,
            arm_workers=True,
        ),
        Scenario(
            "mixed",
            "the classic mix with every hunt that fits the bank mixed in",
            weights={**schedule.WEIGHTS, **schedule.HUNT_WEIGHTS},
            env=_BUDGET_ENV,
            arm_workers=True,
        ),
        Scenario(
            "sync-hot-rows",
            "a sync handler updating one of 10 hot rows, at eop's default settings",
            target=hot.target,
            weights=_AROUND,
            required=("worker_term",),
            env=_DEFAULTS_ENV,
            # A backlog: many deliveries at once on the same few rows.
            overrides={"workers": 3, "messages": 2000, **_HUNT_PACE},
        ),
        Scenario(
            "transfers",
            "random-order debit/credit between 4 accounts, 2 workers x 32, batch mode",
            target=bank.few_accounts_target,
            weights=_AROUND,
            required=("worker_term",),
            overrides={
                "workers": 2,
                "concurrency": 32,
                "batch_mode": "on",
                "messages": 2000,
                **_HUNT_PACE,
            },
        ),
        _hunt("pg-outage", "PostgreSQL down for longer than the attempts budget", "pg_outage_long"),
        _hunt(
            "read-only",
            "the database read-only for longer than the attempts budget",
            "pg_read_only",
        ),
        _hunt(
            "lock-timeouts",
            "a handler's row held locked past lock_timeout / statement_timeout",
            "row_lock_hold",
            slot_env=_timeouts_by_slot,
        ),
        _hunt("long-msg-id", "a good message with a 5,000-character Nats-Msg-Id", "long_msg_id"),
        _hunt(
            "bad-subject",
            "a raw-protocol publish with a subject that is not UTF-8",
            "raw_bad_subject",
        ),
        Scenario(
            "pipeline",
            "A -> handler -> outbox -> B -> handler, an order writer, relays killed",
            target=pipeline.target,
            weights={**schedule.WEIGHTS, "worker_term": 0.5},
            # Both servers restart in every run, however short: relays and the
            # writer lose them mid-publish, mid-mark, mid-COMMIT.
            required=("worker_term", "nats_restart", "pg_restart"),
            env={
                # A takeover after a relay's death waits for its lease: 3 s, past
                # stream B's 2 s window, so its re-sends are stored again.
                "EOP_RELAY_LEASE_S": "3",
                # Every row stays, to be checked against stream B after the run.
                "EOP_OUTBOX_KEEP_S": "86400",
                # Rounds of 20 rows: a backlog fills them, and a full round's mark
                # runs beside the next round, where the relays are killed too.
                "EOP_OUTBOX_BATCH": "20",
            },
            require_evidence=True,
            arm_workers=True,
            relay_spots=schedule.RELAY_SPOTS,
            evidence_races=False,
        ),
        Scenario(
            "cluster",
            "3 clustered nats-servers, an R3 stream, its and its consumer's leaders killed",
            weights={},
            # eop's own ack timings: an ack must outlast a leader election by itself.
            env={"EOP_ACK_TIMEOUT_S": None, "EOP_ACK_GIVE_UP_S": None},
            # The gap between a kill's recovery and the next kill.
            overrides={"mean_fault_gap_s": 2.0},
            kill_spots=(),
            nats_nodes=3,
        ),
        Scenario(
            "ordered",
            "order_by ledger of 40 accounts; workers 1 -> 3 -> 2, kills, stops, restarts",
            target=ordered.target,
            weights=_ORDERED_WEIGHTS,
            required=("worker_stop_long", "nats_restart", "pg_restart"),
            # Wide lanes: many keys wait behind a retried message at any time.
            overrides={"workers": 3, "concurrency": 16, "mean_fault_gap_s": 1.5},
            slot_args=_two_processes_in_slot_1,
            initial_workers=1,
            timeline=(
                # Alone, a restarted worker meets the later messages of its keys first.
                (0.1, "worker_kill", 0),
                (0.25, "scale_workers", 3),
                (0.65, "scale_workers", 2),
            ),
        ),
        _hunt(
            "poison-flood",
            "always-failing messages just ahead of good ones (time to good reported)",
            "poison_flood",
            weights=_AROUND,
        ),
    )
}
HUNTS = tuple(
    name for name in SCENARIOS if name not in ("classic", "mixed", "pipeline", "cluster", "ordered")
)
"""The focused scenarios, each one class of "zero times" failure."""


def get(name: str) -> Scenario:
    """The scenario called ``name``; a clear error for an unknown one."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise errors.ConfigurationError(
            f"--scenario must be one of {', '.join(SCENARIOS)}, not {name!r}"
        ) from None


def attempts_budget_s(env: Mapping[str, str]) -> float:
    """How long a message's deliveries last at most before it is dead-lettered.

    Each of ``max_attempts`` deliveries may wait ``backoff_max_s``, wait out a
    lock or statement timeout, and retry its transaction ``tx_retries`` times
    (sleeping 0.1, 0.2, ... s up to 2 s each): a fault that lasts longer than
    this outlasts every delivery.
    """
    attempts = int(env.get("EOP_MAX_ATTEMPTS") or 5)
    backoff_max = float(env.get("EOP_BACKOFF_MAX_S") or 60.0)
    retries = int(env.get("EOP_TX_RETRIES") or 5)
    retry_sleep = sum(min(0.05 * 2.0**a, 2.0) for a in range(1, retries + 1))
    timeout = min(
        float(env.get("EOP_LOCK_TIMEOUT_S") or 5.0),
        float(env.get("EOP_STATEMENT_TIMEOUT_S") or 60.0),
    )
    return attempts * (backoff_max + retry_sleep + timeout) + 2.0
