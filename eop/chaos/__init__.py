"""Proof under fire: a seeded chaos harness for exactly-once processing.

:func:`run` starts its own nats-server and PostgreSQL, real worker processes
behind fault proxies, publishes logical messages while injecting seeded
faults (crashes, stops, server restarts, lost replies, a recreated consumer),
heals, drains, and checks that every message took effect exactly once. Run
it as ``eop chaos`` or ``python -m eop.chaos``; point it at your own handler
with a :class:`Target`. ``Config(scenario=...)`` (``--scenario``) picks one of
:mod:`eop.chaos.scenarios`: besides the classic mix, hunts for good messages
dead-lettered by infrastructure failures and for workers that stall.
"""

from __future__ import annotations

from eop.chaos.harness import Config, run
from eop.chaos.report import Report
from eop.chaos.target import Payload, Target

__all__ = ["Config", "Payload", "Report", "Target", "run"]
