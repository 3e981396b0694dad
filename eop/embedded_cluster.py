"""An alias of :mod:`eop.tools.embedded_cluster`, where the NATS cluster moved: import that instead.

``from eop.embedded_cluster import NatsCluster`` keeps working (the same class).
"""

from __future__ import annotations

from eop.tools.embedded_cluster import CLUSTER_NAME, NatsCluster

__all__ = ["CLUSTER_NAME", "NatsCluster"]
