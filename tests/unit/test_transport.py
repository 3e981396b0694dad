"""NATS authentication/TLS settings and PostgreSQL TLS URLs: checks, redaction, URL plumbing."""

from __future__ import annotations

import contextlib
import io
import ssl
from pathlib import Path

import nats.errors
import pytest
import sqlalchemy as sa
from structlog.testing import capture_logs

import eop
from eop import cli, errors
from eop.app import App, sync_url
from eop.broker import connection
from eop.contrib.spark import offsets
from eop.nats_access import NatsAccess
from eop.pg import engines
from eop.runtime.worker import Worker
from eop.settings import Settings
from tests.integration.authbed import CertificateAuthority


def test_settings_repr_hides_passwords_tokens_and_url_credentials() -> None:
    """repr(Settings) shows no NATS password or token, and no password of either URL."""
    s = Settings(
        database_url="postgresql+asyncpg://app:db-pw@db/app?sslpassword=key-pw",
        nats_url="nats://bob:url-pw@n1:4222,nats://bob:url-pw@n2:4222",
        nats_tls_ca_file="/ca.pem",
    )
    text = repr(s)
    assert "db-pw" not in text
    assert "key-pw" not in text
    assert "url-pw" not in text
    assert "/ca.pem" in text
    for field in ("nats_password", "nats_token"):
        shown = repr(Settings(**{field: "hunter2", "nats_user": "u" if "pass" in field else ""}))
        assert "hunter2" not in shown
        assert f"{field}='***'" in shown


def test_nats_access_repr_hides_secrets() -> None:
    """NatsAccess (shipped to Spark tasks, printed in plans) never shows a secret."""
    access = NatsAccess(url="nats://tok@h:4222", user="", token="")
    assert "tok" not in repr(access)
    access = NatsAccess(url="nats://h:4222", user="u", password="hunter2")
    assert "hunter2" not in repr(access)
    assert "user='u'" in repr(access)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"nats_token": "t", "nats_user": "u", "nats_password": "p"}, "nats_token"),
        ({"nats_token": "t", "nats_creds_file": "/x.creds"}, "nats_creds_file"),
        ({"nats_nkey_seed_file": "/s.nk", "nats_creds_file": "/x.creds"}, "nats_nkey_seed_file"),
        ({"nats_url": "nats://u:p@h:4222", "nats_token": "t"}, "credentials in nats_url"),
        ({"nats_user": "u"}, "nats_password is missing"),
        ({"nats_password": "p"}, "nats_user is missing"),
        ({"nats_tls_cert_file": "/c.pem"}, "nats_tls_key_file"),
        ({"nats_tls_key_file": "/k.pem"}, "nats_tls_cert_file"),
        ({"nats_url": "nats://a@h1:4222,nats://b@h2:4222"}, "different credentials"),
    ],
)
def test_conflicting_nats_auth_settings_are_a_configuration_error(
    changes: dict[str, str], named: str
) -> None:
    """Two ways to authenticate, a user without password, a cert without key: named errors."""
    with pytest.raises(errors.ConfigurationError, match=named):
        Settings(**changes)  # type: ignore[arg-type]


def test_conflict_from_the_environment_names_the_variables() -> None:
    """Set through EOP_* variables, the error names the variables too."""
    env = {"EOP_NATS_TOKEN": "t", "EOP_NATS_USER": "u", "EOP_NATS_PASSWORD": "hunter2"}
    with pytest.raises(errors.ConfigurationError) as caught:
        Settings.from_env(env)
    assert "EOP_NATS_TOKEN" in str(caught.value)
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize(
    "field", ["nkey_seed_file", "creds_file", "tls_ca_file", "tls_cert_file", "tls_key_file"]
)
def test_missing_files_name_the_setting(field: str, tmp_path: Path) -> None:
    """A configured file that does not exist: a ConfigurationError naming setting and variable."""
    changes = {field: str(tmp_path / "absent")}
    if field in ("tls_cert_file", "tls_key_file"):
        other = "tls_key_file" if field == "tls_cert_file" else "tls_cert_file"
        (tmp_path / "other").write_text("")
        changes[other] = str(tmp_path / "other")
    access = NatsAccess(url="nats://h:4222", **changes)  # type: ignore[arg-type]
    with pytest.raises(errors.ConfigurationError, match=f"nats_{field}.*EOP_NATS_{field.upper()}"):
        access.connect_options()


def test_url_credentials_become_options_and_leave_the_urls() -> None:
    """user:password (quoted) or a token in a URL: unquoted into options, gone from servers."""
    options = NatsAccess(url="nats://alice:p%40ss%2Fw@h1:4222, tls://alice:p%40ss%2Fw@h2")
    opts = options.connect_options()
    assert opts["servers"] == ["nats://h1:4222", "tls://h2"]
    assert (opts["user"], opts["password"]) == ("alice", "p@ss/w")
    assert "tls" in opts  # a tls:// URL requires TLS
    opts = NatsAccess(url="nats://s3cret@h1:4222").connect_options()
    assert opts["token"] == "s3cret"
    assert "user" not in opts
    assert opts["servers"] == ["nats://h1:4222"]


def test_tls_files_give_a_verifying_context_with_the_client_certificate(tmp_path: Path) -> None:
    """CA and client certificate: a context that verifies the server and presents the cert."""
    ca = CertificateAuthority(tmp_path)
    client = ca.issue("client", client=True)
    access = NatsAccess(
        url="nats://h:4222",
        tls_ca_file=str(ca.path),
        tls_cert_file=str(client.cert),
        tls_key_file=str(client.key),
        tls_hostname="nats.internal",
    )
    opts = access.connect_options()
    context = opts["tls"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    assert opts["tls_hostname"] == "nats.internal"
    assert NatsAccess(url="nats://h:4222").connect_options().get("tls") is None


def test_settings_turn_into_spark_options_and_back() -> None:
    """The Spark source rebuilds the same access from its (lower-cased) options."""
    access = NatsAccess(
        url="nats://h:4222", user="u", password="p", tls_hostname="x", tls_handshake_first=True
    )
    spark = {k.lower(): v for k, v in {**access.spark_options(), "stream": "S"}.items()}
    assert spark["natspassword"] == "p"
    opts = offsets.SourceOptions.parse(spark)
    assert opts.nats == access
    assert opts.nats_url == "nats://h:4222"


def test_help_offers_no_password_or_token_flag_and_shows_no_environment_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`eop worker --help`: auth flags, but no secret flags and no secret from the environment."""
    monkeypatch.setenv("EOP_NATS_PASSWORD", "hunter2")
    monkeypatch.setenv("EOP_NATS_USER", "alice")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.build_parser().parse_args(["worker", "--help"])
    text = out.getvalue()
    assert "--nats-creds-file" in text
    assert "--nats-tls-ca-file" in text
    assert "--nats-password" not in text
    assert "--nats-token" not in text
    assert "hunter2" not in text


# -- PostgreSQL TLS through the URL ----------------------------------------------


def test_libpq_tls_parameters_reach_both_drivers(tmp_path: Path) -> None:
    """libpq's TLS parameters: an asyncpg ssl context, and the sync URL that libpq reads."""
    ca = CertificateAuthority(tmp_path)
    client = ca.issue("client", client=True)
    url = (
        "postgresql+asyncpg://app:pw@db.internal:5432/app?sslmode=verify-full"
        f"&sslrootcert={ca.path}&sslcert={client.cert}&sslkey={client.key}"
        "&application_name=eop"
    )
    async_url, connect_args = engines.asyncpg_url(url)
    assert dict(async_url.query) == {"application_name": "eop"}
    context = connect_args["ssl"]
    assert isinstance(context, ssl.SSLContext)
    assert context.check_hostname
    assert context.verify_mode == ssl.CERT_REQUIRED

    app = App(settings=Settings(database_url=url))
    assert app.engine.url.query.get("sslmode") is None
    sync_engine = app.sync_sessionmaker.kw["bind"]
    assert sync_engine.url.drivername == "postgresql+psycopg"
    assert sync_engine.url.query["sslmode"] == "verify-full"
    assert sync_engine.url.query["sslrootcert"] == str(ca.path)
    assert sync_engine.url.query["sslkey"] == str(client.key)


def test_asyncpg_ssl_mode_maps_to_sslmode_for_psycopg() -> None:
    """?ssl=require (asyncpg's spelling) stays for asyncpg and becomes sslmode for psycopg."""
    url = sa.make_url("postgresql+asyncpg://app@db/app?ssl=require")
    assert engines.asyncpg_url(url) == (url, {})
    assert sync_url(url).query == {"sslmode": "require"}
    plain, args = engines.asyncpg_url("postgresql+asyncpg://app@db/app?sslmode=require")
    assert (dict(plain.query), args) == ({}, {"ssl": "require"})


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("sslrootcert=/nope.pem&sslmode=verify-full", "does not exist"),
        ("sslrootcert=/nope.pem&sslmode=prefer", "need sslmode=require"),
        ("sslcert=/c.pem&sslmode=require", "sslcert and sslkey go together"),
    ],
)
def test_bad_database_tls_parameters_are_named(query: str, named: str) -> None:
    """Missing files, a mode that would ignore them, a cert without key: ConfigurationError."""
    with pytest.raises(errors.ConfigurationError, match=named):
        engines.asyncpg_url(f"postgresql+asyncpg://app@db/app?{query}")


def test_refusals_are_configuration_errors_and_nats_unavailable() -> None:
    """Callers catching either family see an authentication refusal."""
    assert issubclass(errors.NatsAuthenticationFailed, eop.ConfigurationError)
    assert issubclass(errors.NatsAuthenticationFailed, eop.NatsUnavailable)
    assert issubclass(errors.NatsTlsError, eop.ConfigurationError)


# -- refused reconnects --------------------------------------------------------

# What nats-py hands error_cb when a reconnect's CONNECT is refused.
_REFUSED = nats.errors.Error("nats: 'Authorization Violation'")
_ACCESS = NatsAccess(url="nats://n1:4222", user="alice", password="hunter2")


def test_refused_reconnects_give_up_at_the_limit_once_and_name_the_cause() -> None:
    """The limit-th refusal in a row gives the error (count, cause, no secret); later ones none."""
    refusals = connection.Refusals(_ACCESS, limit=3)
    assert refusals.error(_REFUSED) is None
    assert refusals.error(nats.errors.AuthorizationError()) is None
    error = refusals.error(_REFUSED)
    assert isinstance(error, errors.NatsReauthenticationFailed)
    assert isinstance(error, errors.NatsAuthenticationFailed)
    assert error.refusals == 3
    assert "NATS at nats://n1:4222 refused the authentication (user and password)" in str(error)
    assert "3 reconnects in a row" in str(error)
    assert "hunter2" not in str(error)
    assert refusals.error(_REFUSED) is None


def test_a_successful_reconnect_resets_the_refusal_count() -> None:
    """A server that refused for a moment, then let the worker in, is forgiven."""
    refusals = connection.Refusals(_ACCESS, limit=2)
    assert refusals.error(_REFUSED) is None
    refusals.connected()
    assert refusals.count == 0
    assert refusals.error(_REFUSED) is None
    assert refusals.error(_REFUSED) is not None


@pytest.mark.parametrize(
    "exc",
    [
        nats.errors.UnexpectedEOF(),
        ConnectionRefusedError(111, "Connection refused"),
        nats.errors.Error("nats: 'Authentication Timeout'"),
        nats.errors.Error("nats: 'Permissions Violation for Subscription to \"x\"'"),
    ],
    ids=["eof", "connection_refused", "authentication_timeout", "permissions"],
)
def test_errors_that_are_not_refusals_neither_count_nor_reset(exc: Exception) -> None:
    """An unreachable server or a slow CONNECT is not a refused credential; the count holds."""
    refusals = connection.Refusals(_ACCESS, limit=2)
    assert refusals.error(_REFUSED) is None
    assert refusals.error(exc) is None
    assert refusals.count == 1
    assert refusals.error(_REFUSED) is not None


def test_a_connection_the_server_closed_names_why() -> None:
    """nats-py gave up on the connection: an authorization error is a refusal, else unavailable."""
    refusals = connection.Refusals(_ACCESS, limit=3)
    revoked = refusals.closed(nats.errors.AuthorizationError())
    assert isinstance(revoked, errors.NatsReauthenticationFailed)
    assert "closed the connection" in str(revoked)
    other = refusals.closed(nats.errors.Error("nats: 'Maximum Connections Exceeded'"))
    assert type(other) is errors.NatsUnavailable
    assert "Maximum Connections Exceeded" in str(other)
    assert "closed the connection" in str(refusals.closed(None))


def test_nats_auth_refusals_must_be_at_least_one() -> None:
    """Zero would give up before the first refusal."""
    with pytest.raises(errors.ConfigurationError, match="nats_auth_refusals"):
        Settings(nats_auth_refusals=0)


async def test_a_worker_nats_gave_up_on_logs_once_and_stops() -> None:
    """on_lost: one nats.auth_refused error line (no secret), then the stop of a SIGTERM."""
    app = eop.App(settings=Settings(nats_password="hunter2", nats_user="alice"))

    @app.handler(stream="S", subject="s.x", name="h")
    async def handle(msg: eop.Message, session: object) -> None:
        """Never called: the worker is not run."""

    error = connection.Refusals(_ACCESS, limit=1).error(_REFUSED)
    assert error is not None
    with capture_logs() as logs:
        worker = Worker(app)
        worker._give_up(error)
        worker._give_up(errors.NatsUnavailable("later"))
    assert worker.draining
    assert [(e["event"], e["log_level"]) for e in logs] == [("nats.auth_refused", "error")]
    assert logs[0]["refusals"] == 1
    assert "hunter2" not in str(logs)


def test_a_bare_postgresql_url_has_a_sync_twin() -> None:
    """postgresql:// (psycopg under SQLAlchemy 2.1) gives sync handlers psycopg too."""
    assert sync_url(sa.make_url("postgresql://u@db/app")).drivername == "postgresql+psycopg"
