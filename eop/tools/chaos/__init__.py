"""Proof under fire: a seeded chaos harness for exactly-once processing.

:func:`run` starts its own nats-server and PostgreSQL, real worker processes
behind fault proxies, publishes logical messages while injecting seeded
faults (crashes, stops, server restarts, lost replies, a recreated consumer),
heals, drains, and checks that every message took effect exactly once. Run
it as ``eop chaos`` or ``python -m eop.tools.chaos``; point it at your own handler
with a :class:`Target`. ``Config(scenario=...)`` (``--scenario``) picks one of
:mod:`eop.tools.chaos.scenarios`: besides the classic mix, hunts for good messages
dead-lettered by infrastructure failures and for workers that stall;
``scenario="cluster"`` runs three clustered nats-servers and kills the
leaders of a replicated stream and of its consumer (:mod:`eop.tools.chaos.cluster`);
``scenario="ordered"`` checks an ``order_by`` handler's per-key order as well
(:mod:`eop.tools.chaos.ordered`).
"""

from __future__ import annotations

from eop.tools.chaos import cluster, harness, scenarios
from eop.tools.chaos.harness import Config
from eop.tools.chaos.report import Report
from eop.tools.chaos.target import Payload, Target

__all__ = ["Config", "Payload", "Report", "Target", "run"]


def run(config: Config) -> Report:
    """Run a chaos test; the report says whether exactly-once held.

    On one nats-server (:func:`eop.tools.chaos.harness.run`), or on a cluster for a
    scenario that runs one (:func:`eop.tools.chaos.cluster.run`).
    """
    if scenarios.get(config.scenario).nats_nodes > 1:
        return cluster.run(config)
    return harness.run(config)
