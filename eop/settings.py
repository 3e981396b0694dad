"""Settings: one typed, frozen object, read once.

Every field can come from an ``EOP_*`` environment variable (see
:meth:`Settings.from_env`); durations carry their unit in the field name.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Literal, get_type_hints

from eop import errors, nats_access, redaction, rules

LogFormat = Literal["console", "json"]
LogLevel = Literal["debug", "info", "warning", "error"]
DbPooler = Literal["auto", "none", "session", "transaction", "transaction_prepared"]

DEFAULT_DATABASE_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def _field(default: Any, help_text: str, **rule: Any) -> Any:
    """A field with its help text and the rules :func:`eop.rules.check_fields` applies
    beyond its type: ``minimum``, ``maximum``, ``check``."""
    return dataclasses.field(default=default, metadata={"help": help_text, **rule})


@dataclasses.dataclass(frozen=True)
class Settings:
    """Runtime settings of an eop app and its workers.

    The defaults fit a local NATS and PostgreSQL; every field can be set from
    the environment as ``EOP_<FIELD>`` (for example ``EOP_ACK_WAIT_S=60``).
    """

    database_url: str = _field(
        DEFAULT_DATABASE_URL,
        "SQLAlchemy URL of the database (``postgresql+asyncpg://...``).",
        check=rules.postgres_url,
    )
    nats_url: str = _field(
        DEFAULT_NATS_URL, "NATS server URL(s), comma separated.", check=rules.nats_urls
    )
    schema: str = _field(
        "eop",
        "PostgreSQL schema that holds eop's tables: a lowercase name (a-z, 0-9, _), "
        "at most 63 bytes.",
        check=rules.schema_name,
    )
    processes: int = _field(
        0,
        "Worker processes of one ``eop worker`` (0: one per CPU the worker may use, at most "
        "4). Each runs every handler; an ordered handler's partitions are shared out among all "
        "the processes that run it, on every machine (docs/ordering.md).",
    )
    concurrency: int = _field(
        128, "Messages in flight at the same time in one worker process.", minimum=1
    )
    db_pool_size: int = _field(
        0,
        "The most connections one worker process opens to PostgreSQL, both of eop's pools "
        "included, never more (0: min(concurrency, 16), shared out among the processes, at least "
        "4 each). Sync handlers share the async pool (and get as many threads); with a sync "
        "pool of eop's (Spark, Django's store), it gets half (or all but 1-2 when every "
        "handler is sync); pools passed to App are not counted.",
    )
    db_pooler: DbPooler = _field(
        "auto",
        "What stands between eop and PostgreSQL (docs/pgbouncer.md): ``transaction``, a "
        "transaction-mode pooler (PgBouncer's pool_mode=transaction): no prepared statement "
        "outlives its transaction and the relay polls instead of LISTEN; "
        "``transaction_prepared``, one that keeps prepared statements (PgBouncer 1.21+ with "
        "max_prepared_statements): the relay polls; ``session`` (a session-mode pooler) and "
        "``none``: as a direct connection; ``auto``: ``transaction`` if the first connection "
        "shows a pooler (its backend pid is not PostgreSQL's), else ``none``.",
    )
    db_connect_timeout_s: float = _field(
        10.0,
        "How long opening one connection to PostgreSQL may take (TCP, TLS and the server's "
        "start-up answer) before the attempt fails and is retried, for the connections eop "
        "opens from ``database_url``; a ``timeout`` (asyncpg) or ``connect_timeout`` (libpq) "
        "in the URL wins. 0: the driver's own, under which a host that drops packets holds "
        "each attempt about a minute (asyncpg) or for ever (libpq).",
    )
    batch: int = _field(64, "Messages fetched per pull request (and per transaction).", minimum=1)
    batch_transactions: bool = _field(
        True, "One transaction (and one multi-row claim) per fetched batch, not per message."
    )
    fetch_timeout_s: float = _field(1.0, "How long one pull request waits for messages.")
    ack_wait_s: float = _field(30.0, "The consumer's AckWait: a delivery's lease.")
    max_ack_pending: int = _field(
        1000,
        "The consumer's MaxAckPending (used when eop creates the consumer).",
        minimum=1,
    )
    max_attempts: int = _field(
        5,
        "Handler failures of a message before it is dead-lettered (failures of the database "
        "or NATS never count).",
        minimum=1,
    )
    max_deliveries: int = _field(
        100,
        "Deliveries (or retry runs) of one message that end without any outcome, its worker "
        "dying in each, before it is dead-lettered as a crash loop.",
        minimum=1,
    )
    backoff_base_s: float = _field(0.5, "First retry delay; doubles with each failure.")
    backoff_max_s: float = _field(60.0, "Upper bound of the retry delay.")
    retry_poll_s: float = _field(
        1.0, "How often a worker looks for failed messages whose retry is due."
    )
    ack_timeout_s: float = _field(1.0, "How long one confirmed ack waits for the server's reply.")
    ack_give_up_s: float = _field(
        10.0,
        "How long a confirmed ack is retried before giving up (redelivery is then skipped); "
        "one that no server answers (no responders), or any once the worker stops, at "
        "most 2 s.",
    )
    lock_timeout_s: float = _field(
        5.0, "``lock_timeout`` of the message's transaction (waiting on a concurrent claim)."
    )
    statement_timeout_s: float = _field(60.0, "``statement_timeout`` of the message's transaction.")
    tx_retries: int = _field(
        5,
        "Spark only: in-process retries of a partition's transaction after 40001, 40P01 or a "
        "lost connection (a worker retries those until they succeed or it stops).",
    )
    lease_margin_s: float = _field(
        2.0, "A delivery with less lease left than this is not started (it will be redelivered)."
    )
    stuck_after_ack_waits: float = _field(
        3.0,
        "A delivery unacknowledged for longer than this many AckWaits is stuck: the workers' "
        "metric and log, ``eop status`` and ``eop audit`` report it (docs/operations.md).",
        minimum=1,
    )
    compaction_interval_s: float = _field(
        5.0, "How often the inbox rows below the consumer's ack floor are deleted (0: never)."
    )
    compaction_after_messages: int = _field(
        1000,
        "Also compact once this many messages were processed since the last round, so the "
        "inbox stays near the in-flight window whatever the rate (0: by interval only).",
    )
    msg_id_retention_s: float = _field(
        3600.0,
        "How long compaction keeps inbox rows that carry a Nats-Msg-Id (the guard against "
        "republishes after the server's duplicate window).",
    )
    epoch_sweep_after_s: float = _field(
        3600.0,
        "How long after a stream is recreated compaction deletes the inbox rows left in its "
        "earlier incarnations, whose messages are gone: rows carrying a Nats-Msg-Id still "
        "stay msg_id_retention_s, retrying ones until their retry ends. From then on a "
        "delivery of an earlier incarnation still in a worker's hands is taken as processed: "
        "keep it above your longest handler run.",
        minimum=0,
    )
    shutdown_grace_s: float = _field(
        30.0,
        "How long a stopping worker waits for in-flight messages before cancelling them; "
        "the process ends at most ack_give_up_s + 5 s later, stuck handlers or not.",
    )
    create: bool = _field(
        True, "Create streams and consumers that do not exist (else bind to existing ones only)."
    )
    # -- the outbox and its relay
    relay: bool = _field(
        True,
        "Run the outbox relay in ``eop worker``: one relay at a time publishes (it holds the "
        "lease), the others stand by.",
    )
    outbox_max_payload: int = _field(
        1024 * 1024,
        "Largest message (payload and headers) ``eop.outbox.add`` accepts: the NATS "
        "server's max_payload (1 MiB unless raised).",
        minimum=1,
    )
    outbox_batch: int = _field(
        1000,
        "Outbox rows one relay round publishes at once (asynchronous PubAcks).",
        minimum=1,
    )
    outbox_poll_s: float = _field(
        1.0, "How often the relay looks for rows when no NOTIFY woke it (LISTEN is down)."
    )
    outbox_keep_s: float = _field(
        60.0, "How long published outbox rows are kept (for `eop outbox list`) before deletion."
    )
    outbox_max_attempts: int = _field(
        10,
        "Refused publishes to a subject (JetStream says no stream holds it) before its "
        "pending outbox rows are parked, the subject held back 1 s, doubling to 60 s, in "
        "between (about 4 minutes); NATS outages never count.",
        minimum=1,
    )
    relay_lease_s: float = _field(
        10.0,
        "The relay lease: a standby takes over at most this long after the publishing relay died.",
    )
    partition_lease_s: float = _field(
        10.0,
        "An ordered handler's partition lease: when the process owning a partition dies, "
        "another takes the partition over within about this long and a third of it "
        "(docs/ordering.md). Give every process of a handler the same value: each ranks "
        "the others by how lately they renewed, measured in its own lease.",
    )
    publish_timeout_s: float = _field(
        5.0, "How long the relay waits for the PubAcks of one round before sending it again."
    )
    # metrics, health and tracing (obs)
    metrics_port: int = _field(
        0, "Port of the worker's HTTP endpoint: /metrics, /healthz, /readyz (0: off)."
    )
    metrics_host: str = _field(
        "127.0.0.1",
        "Address the metrics and health endpoint listens on: this machine only by default "
        "(the endpoint has no authentication); in a container, its pod or container IP, "
        "or 0.0.0.0.",
        check=rules.listen_address,
    )
    tracing: bool = _field(
        True, "An OpenTelemetry span per message, when opentelemetry-api (eop[otel]) is installed."
    )
    # -- bad input (start-up retries)
    startup_attempts: int = _field(
        0,
        "Tries of each step of a worker's or relay's start (the schema check, the "
        "connection, each stream and consumer) while PostgreSQL or NATS is unreachable, "
        "waiting 0.5 s, doubled each time up to 5 s, before it exits with an error "
        "(4: after 3.5 s). 0: until they answer or the process is stopped, alive and "
        "not ready meanwhile.",
        minimum=0,
    )
    nats_auth_refusals: int = _field(
        3,
        "Refused authentications in a row while a running worker reconnects to NATS "
        "(credentials changed, revoked or expired) before it stops and exits with an error.",
        minimum=1,
    )
    # Throughput.
    uvloop: bool = _field(
        True, "Run the worker on uvloop when it is installed (the ``fast`` extra)."
    )
    log_format: LogFormat = _field("console", "``console`` for people, ``json`` for machines.")
    log_level: LogLevel = _field("info", "Lowest level logged.")

    # -- NATS authentication and TLS (eop.nats_access; PostgreSQL's TLS is in database_url).
    nats_user: str = _field("", "NATS user name (with nats_password); or nats://USER:PASS@host.")
    nats_password: str = _field("", "NATS password (a secret: set it in the environment).")
    nats_token: str = _field("", "NATS authentication token (a secret); or nats://TOKEN@host.")
    nats_nkey_seed_file: str = _field("", "File holding the user's NKey seed (SU...).")
    nats_creds_file: str = _field("", "Credentials file (.creds: user JWT and NKey seed).")
    nats_tls_ca_file: str = _field(
        "", "CA certificate(s) that sign NATS's certificate (PEM); turns TLS on and requires it."
    )
    nats_tls_cert_file: str = _field("", "Client certificate for mutual TLS (PEM).")
    nats_tls_key_file: str = _field("", "Private key of nats_tls_cert_file (PEM).")
    nats_tls_hostname: str = _field(
        "", "Name to expect in NATS's certificate, when it is not the URL's host."
    )
    nats_tls_handshake_first: bool = _field(
        False, "TLS handshake before NATS's INFO (the server's handshake_first option)."
    )

    def __post_init__(self) -> None:
        rules.check_fields(self, SECRET_FIELDS)
        self._check_leases()
        self.nats_access.check()

    def _check_leases(self) -> None:
        if self.lease_margin_s >= self.ack_wait_s:
            raise errors.ConfigurationError(
                f"lease_margin_s ({self.lease_margin_s}) must be below ack_wait_s "
                f"({self.ack_wait_s}), or no delivery would ever be started"
            )
        if self.partition_lease_s < 1.0:
            raise errors.ConfigurationError(
                "partition_lease_s must be at least 1 s: a process renews its leases a few "
                "times per lease"
            )
        if self.relay_lease_s < 1.0:
            raise errors.ConfigurationError(
                "relay_lease_s must be at least 1 s: the relay renews it a few times per lease"
            )

    @property
    def nats_access(self) -> nats_access.NatsAccess:
        """The NATS access the ``nats_*`` fields describe."""
        fields = dataclasses.fields(nats_access.NatsAccess)
        return nats_access.NatsAccess(**{f.name: getattr(self, f"nats_{f.name}") for f in fields})

    def db_connections(self, processes: int = 1) -> int:
        """The most connections one worker process opens, its pools together:
        ``db_pool_size``, or when that is 0, ``min(concurrency, 16)``, shared out
        among ``processes`` (at least 4 each). See :meth:`eop.App.connection_shares`."""
        if self.db_pool_size:
            return self.db_pool_size
        whole = min(self.concurrency, 16)
        return whole if processes == 1 else max(4, whole // processes)

    def __repr__(self) -> str:
        # Settings get printed and logged: no passwords, tokens or URL credentials.

        shown = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in SECRET_FIELDS and value:
                value = redaction.REDACTED
            elif field.name == "database_url":
                value = redaction.redact_url(value)
            elif field.name == "nats_url":
                value = redaction.redact_urls(value)
            shown.append(f"{field.name}={value!r}")
        return f"Settings({', '.join(shown)})"

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        overrides: Mapping[str, object] | None = None,
    ) -> Settings:
        """Build settings from ``EOP_*`` variables; ``overrides`` (not None) win."""
        environ = os.environ if environ is None else environ
        hints = get_type_hints(cls)
        values: dict[str, object] = {}
        for field in dataclasses.fields(cls):
            raw = environ.get(env_var(field.name))
            if raw is not None:
                values[field.name] = _parse(field.name, hints[field.name], raw)
        from_environ = set(values)
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        try:
            return cls(**values)  # type: ignore[arg-type]  # keys are field names, checked above
        except errors.ConfigurationError as exc:
            # Name the variables the user set, not only the fields they feed.
            named = sorted(
                env_var(name)
                for name in from_environ
                if name in str(exc) and env_var(name) not in str(exc)
            )
            if not named:
                raise
            raise errors.ConfigurationError(f"{exc} (set by {', '.join(named)})") from None

    def replace(self, **changes: object) -> Settings:
        """A copy with ``changes`` applied (None values are ignored)."""
        kept = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **kept)  # type: ignore[arg-type]  # field names


#: Fields whose values are secrets: redacted in reprs, never offered as command-line flags.
SECRET_FIELDS = frozenset({"nats_password", "nats_token"})


env_var = rules.env_var


def parse_value(field_name: str, hint: object, raw: str) -> object:
    """``raw``, read from :func:`env_var` of ``field_name``, as a ``hint`` (bool, int, float, str).

    Booleans are 1/true/yes/on or 0/false/no/off; anything else that does not
    parse raises :class:`eop.errors.ConfigurationError` naming the variable.
    """
    return _parse(field_name, hint, raw)


_PARSE_RULES: dict[object, str] = {
    bool: "must be true or false (1/true/yes/on, 0/false/no/off)",
    int: "must be a whole number",
    float: "must be a number",
}


def _parse(name: str, hint: object, raw: str) -> object:
    try:
        if hint is bool:
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if hint is int:
            return int(raw)
        if hint is float:
            return float(raw)
    except ValueError:
        shown = redaction.REDACTED if name in SECRET_FIELDS else repr(raw)
        raise errors.ConfigurationError(
            f"{name} ({env_var(name)}) {_PARSE_RULES.get(hint, 'is not valid')}, not {shown}"
        ) from None
    return raw
