"""A chaos run's checks: whether it drained once healed (liveness), then, once its workers
stopped, what it came to: each message's effects and dead letters stage by stage, the
target's invariant and order, the logs and the evidence of the faults, and the outbox
against the streams its relays published to. :mod:`eop.tools.chaos.checker` judges;
this module reads the database and the streams for it, and fills the report.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import sqlalchemy as sa
from nats.js import JetStreamContext

from eop.handler import HandlerSpec
from eop.ordering import partitions
from eop.tools.chaos import checker, relayed, scenarios, workers
from eop.tools.chaos.report import Report
from eop.tools.chaos.target import Payload, Target


async def describe_pending(js: JetStreamContext, specs: list[HandlerSpec]) -> str:
    """What each handler's consumers still hold, for a liveness failure's message."""
    found = []
    for spec in specs:
        try:
            infos = await partitions.handler_consumers(js, spec)
        except Exception as exc:  # only for the message of a liveness failure
            found.append(f"{spec.name}: unknown ({type(exc).__name__})")
            continue
        pending = sum(i.num_pending or 0 for i in infos)
        unacked = sum(i.num_ack_pending or 0 for i in infos)
        found.append(f"{spec.name}: {pending} undelivered, {unacked} awaiting ack")
    return "; ".join(found)


async def consumers_quiet(js: JetStreamContext, specs: list[HandlerSpec]) -> bool:
    """Whether every consumer of the handlers has nothing undelivered and nothing unacked."""
    for spec in specs:
        infos = await partitions.handler_consumers(js, spec)
        if not infos or any(i.num_pending or i.num_ack_pending for i in infos):
            return False
    return True


async def wait_drained(
    js: JetStreamContext,
    specs: list[HandlerSpec],
    deadline_s: float,
    waiting: Callable[[], Awaitable[int]],
) -> bool:
    """Wait until every consumer has nothing undelivered and nothing unacked, and nothing
    waits in the database (a parked retry, an outbox row), twice in a row."""
    end = time.monotonic() + deadline_s
    streak = 0
    while time.monotonic() < end:
        try:
            quiet = await consumers_quiet(js, specs) and await waiting() == 0
        except Exception:  # a liveness probe: anything but "drained" means "not yet"
            quiet = False
        streak = streak + 1 if quiet else 0
        if streak >= 2:
            return True
        await asyncio.sleep(0.5)
    return False


def check(
    report: Report,
    target: Target,
    scenario: scenarios.Scenario,
    *,
    database_url: str,
    pool: workers.WorkerPool,
    payloads: list[Payload],
    late_keys: set[str],
    canaries: dict[str, str],
    require_evidence: bool,
) -> dict[str, dict[str, int]]:
    """Once the workers stopped: each message's effects and dead letters (of every stage),
    the target's invariant and order, every log line and the evidence the faults left, into
    ``report``; returns the effects per key of each of the target's handlers."""
    r = report
    effects_by_handler: dict[str, dict[str, int]] = {}
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            effects, dead = read_effects(conn, target.handler, target.effects_sql)
            effects_by_handler[target.handler] = effects
            for index, stage in enumerate(target.downstream, 1):
                # Dead letters are keyed by msg-id: downstream, a forwarded message's
                # is the one its outbox row got, so one shows as unexpected, and its
                # message as lost. None is expected there.
                stage_effects, stage_dead = read_effects(conn, stage.handler, stage.effects_sql)
                effects_by_handler[stage.handler] = stage_effects
                r.stages[stage.handler] = checker.check_outcomes(
                    checker.planned_at(payloads, index), stage_effects, stage_dead
                )
            if target.invariant is not None:
                r.invariant_problems += target.invariant(conn, payloads)
            if target.invariant_sql:
                violations = conn.execute(sa.text(target.invariant_sql)).all()
                r.invariant_problems += [f"invariant_sql row {tuple(v)}" for v in violations]
            if target.order_sql:
                r.order = checker.check_order(conn.execute(sa.text(target.order_sql)))
    finally:
        engine.dispose()
    r.outcomes = checker.check_outcomes(checker.planned_at(payloads, 0), effects, dead)
    # Say which duplicates were republished after the server's window: it
    # tells a msg-id guard failure from a protocol one at a glance.
    r.outcomes.duplicated = [
        f"{item} (republished after the duplicate window)"
        if item.split(":")[0] in late_keys
        else item
        for item in r.outcomes.duplicated
    ]
    r.logs = checker.scan_logs(pool.logs(), canaries)
    spots = (*scenario.kill_spots, *scenario.relay_spots)
    r.evidence = checker.evidence(r.logs, spots)
    if require_evidence:
        r.missing_evidence = checker.missing_evidence(
            r.evidence, spots, races=scenario.evidence_races
        )
    r.worker_exits = pool.exits
    r.incarnations = len(pool.incarnations)
    r.stops = list(pool.stops)
    r.stop_limit_s = pool.stop_limit_s
    return effects_by_handler


async def check_outbox(
    report: Report,
    target: Target,
    specs: list[HandlerSpec],
    effects_by_handler: dict[str, dict[str, int]],
    *,
    database_url: str,
    js: JetStreamContext,
) -> None:
    """Every outbox row against the streams it went to (:mod:`eop.tools.chaos.relayed`), given
    the effects per key of each of the target's handlers (:func:`check`'s)."""
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = relayed.read_rows(conn, target.key_header)
    finally:
        engine.dispose()
    names = sorted({row.stream for row in rows if row.stream is not None})
    streams = {name: await relayed.read_stream(js, name) for name in names}
    effects = {
        name: [effects_by_handler.get(s.name, {}) for s in specs if s.stream == name]
        for name in names
    }
    report.outbox = found = relayed.check(rows, streams, effects)
    guarded = report.logs.guard_skips
    for name in names:
        skips = sum(guarded[spec.name] for spec in specs if spec.stream == name)
        report.figures[f"msg-id guard in {name}"] = (
            f"{found.copied_in.get(name, 0)} outbox messages stored more than once; "
            f"{skips} deliveries skipped by the guard (as logged, the publisher's "
            "republishes included; a worker killed right after its ack logs none)"
        )


def read_effects(
    conn: sa.Connection, handler: str, effects_sql: str
) -> tuple[dict[str, int], dict[str | None, list[str]]]:
    """A handler's effects per key, and its dead letters' reasons per msg-id."""
    effects = {str(k): int(n) for k, n in conn.execute(sa.text(effects_sql))}
    dead: dict[str | None, list[str]] = {}
    rows = conn.execute(
        sa.text("SELECT msg_id, reason FROM eop.dead_letters WHERE subscription = :s"),
        {"s": handler},
    )
    for msg_id, reason in rows:
        dead.setdefault(msg_id, []).append(str(reason))
    return effects, dead
