"""An alias of :mod:`eop.tools.embedded`, where the embedded servers moved: import that instead.

``from eop.embedded import NatsServer, PostgresServer`` keeps working: the names
below are those of :mod:`eop.tools.embedded` (the same objects).
"""

from __future__ import annotations

from eop.tools.embedded import (
    HOST,
    NATS_SERVER_ENV,
    NatsServer,
    PostgresCluster,
    PostgresServer,
    free_port,
    nats_server_binary,
    postgres_bin_dir,
)

__all__ = [
    "HOST",
    "NATS_SERVER_ENV",
    "NatsServer",
    "PostgresCluster",
    "PostgresServer",
    "free_port",
    "nats_server_binary",
    "postgres_bin_dir",
]
