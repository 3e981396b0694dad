"""The CI-size chaos run: exactly-once under hundreds of seeded faults (eop chaos).

Set EOP_CHAOS_SEED to replay a failing run's fault schedule; the report
(printed on failure) names the seed and keeps the workers' logs.
"""

from __future__ import annotations

import os

import pytest

from eop import errors
from eop.tools.chaos import Config, run

from ..conftest import unavailable

pytestmark = pytest.mark.integration


@pytest.mark.timeout(290)
def test_every_message_takes_effect_exactly_once_under_fire() -> None:
    """Workers SIGKILLed at every fault point, stopped past AckWait, servers restarted,
    backends terminated, COMMIT and ack replies lost, the consumer recreated: after
    healing, the run drains, every good message has exactly one effect, every poison
    one exactly one dead letter, balances add up, and no secret reaches a log line.
    """
    raw_seed = os.environ.get("EOP_CHAOS_SEED")
    config = Config(seed=int(raw_seed) if raw_seed else None)
    try:
        report = run(config)
    except errors.ServerBinaryNotFound as exc:
        unavailable(str(exc))
    print(report.render())
    assert report.ok, report.render()
    assert report.fault_count >= 200


@pytest.mark.timeout(200)
@pytest.mark.parametrize("handler", ["notes", "orm_notes"])
def test_a_users_own_handler_is_checked_the_same_way(handler: str) -> None:
    """Pointed at another app, handler, payload factory and effects query, the harness
    runs that handler under fire and checks its effects per key (a short run): one
    queuing ``eop.Writes``, one adding ORM objects to its session as the README does.
    """
    from eop.tools.chaos import Target

    from . import userapp

    target = Target(
        app="tests.chaos.userapp:app",
        handler=handler,
        effects_sql=userapp.EFFECTS_SQL,
        payloads=userapp.payload,
        setup=userapp.setup,
        invariant_sql="SELECT note FROM notes WHERE note LIKE 'poison%'",
    )
    config = Config(target=target, messages=300, workers=2, duration_s=8, require_evidence=False)
    try:
        report = run(config)
    except errors.ServerBinaryNotFound as exc:
        unavailable(str(exc))
    assert report.ok, report.render()
    assert report.outcomes.exactly_once == 294
    assert report.outcomes.poison_dead_lettered == 6


# The hunt each scenario must have applied (the scenario's signature fault).
_SIGNATURE = {
    "sync-hot-rows": "worker_term",
    "transfers": "worker_term",
    "pg-outage": "pg_outage_long",
    "read-only": "pg_read_only",
    "lock-timeouts": "row_lock_hold",
    "long-msg-id": "long_msg_id",
    "bad-subject": "raw_bad_subject",
    "poison-flood": "poison_flood",
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(_SIGNATURE))
def test_a_good_message_is_never_dead_lettered_and_no_worker_stalls(name: str) -> None:
    """Each "never zero times" scenario, briefly: after its fault (an outage or
    read-only window or held lock longer than the attempts budget, hot rows at
    default settings, deadlocking transfers, a 5,000-character msg-id, a subject
    that is not UTF-8, a poison flood) and mid-run SIGTERMs, every good message
    has exactly one effect (none dead-lettered), the run drains, and every worker
    exits within shutdown_grace_s + 5 s of its SIGTERM.
    """
    from eop.tools.chaos import scenarios

    assert set(_SIGNATURE) == set(scenarios.HUNTS)
    raw_seed = os.environ.get("EOP_CHAOS_SEED")
    config = Config(
        scenario=name,
        seed=int(raw_seed) if raw_seed else None,
        messages=150,
        workers=2,
        duration_s=6,
        # A liveness bound, not a timing: 301 poison messages each run to the end
        # of their attempts take longer than 20 s on a busy 2-core machine (the
        # same on code from before it passed), while a stalled worker never drains.
        drain_deadline_s=60,
        flood=(300, 50),
    )
    try:
        report = run(config)
    except errors.ServerBinaryNotFound as exc:
        unavailable(str(exc))
    print(report.render())
    assert report.faults[_SIGNATURE[name]] >= 1, report.render()
    assert report.ok, report.render()
    assert any(stop.when == "mid-run" for stop in report.stops), report.render()


@pytest.mark.timeout(240)
def test_a_pipeline_through_the_outbox_takes_effect_once_in_each_handler() -> None:
    """Stream A -> handler (effect + eop.outbox.add) -> stream B -> handler (effect), and a
    writer committing orders with outbox messages as a web service does, under the
    classic mix: workers (and so their relays) SIGKILLed at delivery points and after
    publishing, during the mark or after it; NATS and PostgreSQL restarted; a 2 s window
    on stream B. Every message has exactly one effect in each handler from the stage it
    enters at, every outbox row is published and in its stream, none is parked, every
    copy sent again after the window is absorbed by the msg-id guard, and no worker
    stalls. (A run this short cannot promise a kill at each of the ten spots: only the
    relay that leads passes the relay's, and a takeover waits for the lease. The long
    run demands them all.)
    """
    raw_seed = os.environ.get("EOP_CHAOS_SEED")
    config = Config(
        scenario="pipeline",
        seed=int(raw_seed) if raw_seed else None,
        messages=400,
        workers=3,
        duration_s=20,
        drain_deadline_s=60,
        require_evidence=False,
    )
    try:
        report = run(config)
    except errors.ServerBinaryNotFound as exc:
        unavailable(str(exc))
    print(report.render())
    assert report.ok, report.render()
    second = report.stages["chaos-pipe-2"]
    assert second.exactly_once == second.good > report.outcomes.good
    assert report.outbox is not None
    assert report.outbox.rows == report.outbox.published > 0
    assert report.outbox.absorbed == len(report.outbox.copies)
    assert report.faults["nats_restart"] >= 1, report.render()
    assert report.faults["pg_restart"] >= 1, report.render()
    relay_kills = sum(report.evidence[f"kills at {s}"] for s in _RELAY_SPOTS)
    assert relay_kills >= 1, report.render()


_RELAY_SPOTS = ("relay_after_publish", "relay_during_mark", "relay_after_mark")


@pytest.mark.timeout(240)
def test_leaders_of_a_replicated_stream_and_its_consumer_die_and_nothing_is_lost() -> None:
    """Three clustered nats-servers and an R3 stream; the stream's leader and the
    consumer's leader SIGKILLed in turn (one at a time, restarted on their store) while
    workers connected to all three run and the publisher retries with its Nats-Msg-Id:
    every good message has exactly one effect, none is dead-lettered, nothing is lost,
    the run drains and no worker stalls."""
    raw_seed = os.environ.get("EOP_CHAOS_SEED")
    config = Config(
        scenario="cluster",
        seed=int(raw_seed) if raw_seed else None,
        messages=600,
        workers=2,
        duration_s=36,
        drain_deadline_s=60,
    )
    try:
        report = run(config)
    except errors.ServerBinaryNotFound as exc:
        unavailable(str(exc))
    print(report.render())
    assert report.ok, report.render()
    assert report.outcomes.exactly_once == report.outcomes.good > 0
    assert report.faults["stream_leader_kill"] >= 1, report.render()
    assert report.faults["consumer_leader_kill"] >= 1, report.render()


@pytest.mark.timeout(280)
def test_an_ordered_handler_commits_each_keys_messages_in_stream_order_under_fire() -> None:
    """An order_by="subject:1" ledger of 40 accounts, steps published in order in bursts
    per account, one step in ten failing its first delivery, garbage dead-lettered in
    between; one worker command, then three, then two (the second with --processes 2);
    workers SIGKILLed (once while alone), SIGSTOPped past AckWait, SIGTERMed; NATS and
    PostgreSQL restarted. Every step has exactly one effect, every garbage message one
    dead letter, and each account's steps commit as 1, 2, 3... (no step before an earlier
    one's outcome, none before the dead letter ahead of it): order violations 0, and the
    run drains with no stall."""
    raw_seed = os.environ.get("EOP_CHAOS_SEED")
    config = Config(
        scenario="ordered",
        seed=int(raw_seed) if raw_seed else None,
        messages=800,
        duration_s=20,
        drain_deadline_s=60,
    )
    try:
        report = run(config)
    except errors.ServerBinaryNotFound as exc:
        unavailable(str(exc))
    print(report.render())
    assert report.order is not None
    assert report.order.effects == report.outcomes.good > 0, report.render()
    assert report.order.violations == [], report.render()
    assert report.ok, report.render()
    assert report.outcomes.poison_dead_lettered == report.outcomes.poison > 0
    for kind in ("scale_workers", "worker_kill", "worker_stop_long", "nats_restart", "pg_restart"):
        assert report.faults[kind] >= 1, report.render()
