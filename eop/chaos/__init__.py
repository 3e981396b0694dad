"""An alias of :mod:`eop.tools.chaos`, where the chaos harness moved: import that instead.

``eop.chaos.run(eop.chaos.Config(target=eop.chaos.Target(...)))`` and
``eop.chaos.Payload`` keep working (the same objects), as do ``python -m
eop.chaos`` and ``python -m eop.chaos.armed``; its other modules are only at
their new path.
"""

from __future__ import annotations

from eop.tools.chaos import Config, Payload, Report, Target, run

__all__ = ["Config", "Payload", "Report", "Target", "run"]
