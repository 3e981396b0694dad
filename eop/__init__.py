"""eop: exactly-once processing of NATS JetStream messages into PostgreSQL.

Register handlers on an :class:`App`, run ``eop db upgrade`` once and
``eop worker module:app`` as many times as you like: every message stored in
the stream ends in exactly one committed outcome in PostgreSQL.
"""

from __future__ import annotations

from eop import outbox  # after the names it builds on: eop.outbox.add
from eop.app import App
from eop.broker.publish import publish
from eop.errors import (
    AmbiguousCommit,
    ConfigurationError,
    DatabaseUnavailable,
    EopError,
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

__version__ = "0.1.0"

__all__ = [
    # the application
    "App",
    "Message",
    "Settings",
    "Writes",
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
    "DatabaseUnavailable",
    "NatsAuthenticationFailed",
    "NatsTlsError",
    "NatsUnavailable",
    "PayloadTooLarge",
    "SchemaNotReady",
    "UnpublishableMessage",
    "__version__",
]
