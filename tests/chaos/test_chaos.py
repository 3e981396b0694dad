"""The CI-size chaos run: exactly-once under hundreds of seeded faults (eop chaos).

Set EOP_CHAOS_SEED to replay a failing run's fault schedule; the report
(printed on failure) names the seed and keeps the workers' logs.
"""

from __future__ import annotations

import os

import pytest

from eop import errors
from eop.chaos import Config, run

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
def test_a_users_own_handler_is_checked_the_same_way() -> None:
    """Pointed at another app, handler, payload factory and effects query, the harness
    runs that handler under fire and checks its effects per key (a short run).
    """
    from eop.chaos import Target

    from . import userapp

    target = Target(
        app="tests.chaos.userapp:app",
        handler="notes",
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
