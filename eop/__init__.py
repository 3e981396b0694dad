"""eop: exactly-once processing of NATS JetStream messages into PostgreSQL.

Register handlers on an :class:`App`, run ``eop db upgrade`` once and
``eop worker module:app`` as many times as you like (or a :class:`Worker`
inside your own application's event loop): every message stored in the
stream ends in exactly one committed outcome in PostgreSQL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eop import outbox  # after the names it builds on: eop.outbox.add
from eop.app import App
from eop.broker.publish import publish
from eop.errors import (
    AmbiguousCommit,
    ConfigurationError,
    DatabaseLoginRefused,
    DatabaseUnavailable,
    EopError,
    MigrationFailed,
    NatsAuthenticationFailed,
    NatsTlsError,
    NatsUnavailable,
    PayloadTooLarge,
    Reject,
    Retry,
    SchemaNotReady,
    UndecodableMessage,
    UnpublishableMessage,
)
from eop.message import Message
from eop.settings import Settings
from eop.writes import Writes

if TYPE_CHECKING:
    from eop.runtime.worker import Worker

__version__ = "0.1.0"

__all__ = [
    # the application
    "App",
    "Message",
    "Settings",
    "Writes",
    "Worker",
    "publish",
    "outbox",
    # what handlers raise
    "Reject",
    "Retry",
    "UndecodableMessage",
    # what eop raises
    "EopError",
    "AmbiguousCommit",
    "ConfigurationError",
    "DatabaseLoginRefused",
    "DatabaseUnavailable",
    "NatsAuthenticationFailed",
    "NatsTlsError",
    "NatsUnavailable",
    "PayloadTooLarge",
    "MigrationFailed",
    "SchemaNotReady",
    "UnpublishableMessage",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # The worker's modules (the protocol, the fetcher, telemetry) are imported when
    # eop.Worker is first used, not by every `import eop` of a web view.
    if name == "Worker":
        from eop.runtime.worker import Worker

        return Worker
    raise AttributeError(f"module 'eop' has no attribute {name!r}")
