"""How eop reaches NATS and PostgreSQL: credentials, TLS, and refused connections.

:class:`NatsAccess` is everything needed to open a NATS connection (servers,
one way to authenticate, TLS files), checked once and picklable, so Spark
tasks carry it to executors. :func:`connect_nats` is the one place where eop
opens a NATS connection: it fails fast, with an error naming the cause, when
the server refuses the credentials or the TLS handshake fails, instead of
retrying a connection that can never succeed.

:func:`asyncpg_url` lets a database URL carry libpq's TLS parameters
(``sslmode``, ``sslrootcert``, ``sslcert``, ``sslkey``) for both drivers:
psycopg (libpq) reads them as they are, asyncpg gets an ``ssl`` context made
from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import os
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import nats.errors
import sqlalchemy as sa

from eop import errors, log, wire

if TYPE_CHECKING:
    from eop.settings import Settings

_SECRETS = frozenset({"password", "token"})
_FILES = ("nkey_seed_file", "creds_file", "tls_ca_file", "tls_cert_file", "tls_key_file")
#: What nats-py raises when the server cannot be reached or does not answer.
NATS_ERRORS = (OSError, asyncio.TimeoutError, nats.errors.Error)


@dataclasses.dataclass(frozen=True)
class NatsAccess:
    """Where NATS is and how to authenticate to it; fields are the ``nats_*`` settings.

    At most one way to authenticate: ``user`` and ``password``, ``token``, an
    NKey seed file, or a credentials file (a user JWT and its seed). Either
    may also come from the URL (``nats://user:password@host``,
    ``nats://token@host``). The TLS files turn TLS on and make it mandatory:
    a server that does not offer TLS is refused before any credential is sent.
    """

    url: str
    user: str = ""
    password: str = ""
    token: str = ""
    nkey_seed_file: str = ""
    creds_file: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_hostname: str = ""
    tls_handshake_first: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> NatsAccess:
        """The access the settings' ``nats_*`` fields describe."""
        values = {f.name: getattr(settings, f"nats_{f.name}") for f in dataclasses.fields(cls)}
        return cls(**values)

    def __repr__(self) -> str:
        shown = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value != field.default or field.name == "url":
                if field.name in _SECRETS:
                    value = log.REDACTED
                elif field.name == "url":
                    value = log.redact_urls(value)
                shown.append(f"{field.name}={value!r}")
        return f"NatsAccess({', '.join(shown)})"

    @property
    def where(self) -> str:
        """The server URLs, fit for messages and logs."""
        return log.redact_urls(self.url)

    @property
    def tls(self) -> bool:
        """Whether TLS is required (TLS files, handshake-first, or a ``tls://`` URL)."""
        configured = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file, self.tls_hostname)
        schemes = {urllib.parse.urlsplit(u).scheme for u in _split(self.url)}
        return any(configured) or self.tls_handshake_first or "tls" in schemes

    def check(self) -> None:
        """Raise :class:`~eop.errors.ConfigurationError` on options that contradict each other.

        Pure: files are checked only by :meth:`connect_options`.
        """
        url_user, _ = _url_credentials(self.url)
        ways = [
            name
            for name, used in (
                ("nats_user/nats_password", self.user or self.password),
                ("nats_token", self.token),
                ("nats_nkey_seed_file", self.nkey_seed_file),
                ("nats_creds_file", self.creds_file),
                ("credentials in nats_url", url_user is not None),
            )
            if used
        ]
        if len(ways) > 1:
            raise errors.ConfigurationError(
                f"{' and '.join(ways)} are set: choose one way to authenticate to NATS"
            )
        if bool(self.user) != bool(self.password):
            missing = "nats_password" if self.user else "nats_user"
            raise errors.ConfigurationError(f"{missing} is missing: a NATS user needs a password")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            given, missing = (
                ("nats_tls_cert_file", "nats_tls_key_file")
                if self.tls_cert_file
                else ("nats_tls_key_file", "nats_tls_cert_file")
            )
            raise errors.ConfigurationError(
                f"{given} is set but {missing} is not: a client certificate needs its key"
            )

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for nats-py's ``connect``: servers without credentials, auth, TLS."""
        self.check()
        for name in _FILES:
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise errors.ConfigurationError(
                    f"nats_{name}: no such file {path!r} (EOP_NATS_{name.upper()})"
                )
        signing = "nats_creds_file" if self.creds_file else "nats_nkey_seed_file"
        if (self.creds_file or self.nkey_seed_file) and importlib.util.find_spec("nkeys") is None:
            raise errors.ConfigurationError(
                f"{signing} needs the nkeys package: pip install 'eop[nkeys]'"
            )
        url_user, url_password = _url_credentials(self.url)
        user, password, token = self.user, self.password, self.token
        if url_user is not None and url_password is not None:
            user, password = url_user, url_password
        elif url_user is not None:
            token = url_user
        options: dict[str, Any] = {"servers": [_without_userinfo(u) for u in _split(self.url)]}
        # Passed as options rather than left in the URLs: nats-py would not
        # unquote them, and they would show in its errors.
        if user:
            options.update(user=user, password=password)
        if token:
            options["token"] = token
        if self.nkey_seed_file:
            options["nkeys_seed"] = self.nkey_seed_file
        if self.creds_file:
            options["user_credentials"] = self.creds_file
        if self.tls:
            options["tls"] = self.ssl_context()
            options["tls_handshake_first"] = self.tls_handshake_first
            if self.tls_hostname:
                options["tls_hostname"] = self.tls_hostname
        return options

    def ssl_context(self) -> ssl.SSLContext:
        """A client TLS context: the CA file (else the system's CAs) and the client certificate."""
        try:
            context = ssl.create_default_context(cafile=self.tls_ca_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise errors.ConfigurationError(
                f"nats_tls_ca_file {self.tls_ca_file!r} holds no usable CA certificate: {exc}"
            ) from None
        if self.tls_cert_file:
            try:
                context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
            except (OSError, ssl.SSLError) as exc:
                raise errors.ConfigurationError(
                    f"nats_tls_cert_file/nats_tls_key_file {self.tls_cert_file!r}, "
                    f"{self.tls_key_file!r}: not a certificate and its key ({exc})"
                ) from None
        return context

    def spark_options(self) -> dict[str, str]:
        """These settings as ``jetstream`` data source options (``natsUrl``, ``natsUser``...)."""
        opts = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value != field.default:
                opts[_spark_key(field.name)] = str(value).lower() if value is True else str(value)
        return opts

    @classmethod
    def from_spark_options(cls, options: dict[str, str], base: NatsAccess) -> NatsAccess:
        """``base`` with the ``nats*`` options (lower-cased keys, as Spark gives them) applied."""
        changes: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = options.get(_spark_key(field.name).lower())
            if raw is None or raw == "":
                continue
            if field.type in (bool, "bool"):
                changes[field.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            else:
                changes[field.name] = raw
        return dataclasses.replace(base, **changes)


def _spark_key(field_name: str) -> str:
    return "nats" + "".join(part.capitalize() for part in field_name.split("_"))


def _split(urls: str) -> list[str]:
    return [u.strip() for u in urls.split(",") if u.strip()]


def _url_credentials(urls: str) -> tuple[str | None, str | None]:
    """The user (or token) and password the URLs carry; all must carry the same."""
    found = set()
    for url in _split(urls):
        parts = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
        user = urllib.parse.unquote(parts.username) if parts.username is not None else None
        password = urllib.parse.unquote(parts.password) if parts.password is not None else None
        found.add((user, password))
    if len(found) > 1:
        raise errors.ConfigurationError(
            "the URLs in nats_url carry different credentials: give them once, "
            "in nats_user/nats_password or nats_token"
        )
    return found.pop() if found else (None, None)


def _without_userinfo(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "nats", url
    host = rest.rpartition("@")[2]
    return f"{scheme}://{host}"


class _Client(wire.Client):
    """nats-py's client, refusing a server that skips TLS when TLS is required.

    nats-py upgrades to TLS only when the server's INFO asks for it, so a
    server (or a man in the middle) that does not ask would get the
    credentials in the clear. Protocol input that is not UTF-8 is survived
    (see :class:`eop.wire.Client`).
    """

    eop_require_tls = False

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if (
            self.eop_require_tls
            and initial_connection
            and not self.options.get("tls_handshake_first")
            and not info.get("tls_required")
        ):
            raise _TlsNotOffered("nats: TLS is required, but the server does not offer it")
        await super()._process_info(info, initial_connection=initial_connection)


class _TlsNotOffered(nats.errors.Error):
    pass


class _Refused(Exception):
    """Carries the eop error out of nats-py's connect loop."""

    def __init__(self, error: errors.EopError) -> None:
        super().__init__(str(error))
        self.error = error


def refusal(exc: BaseException, access: NatsAccess) -> errors.EopError | None:
    """The eop error for a connection attempt that retrying cannot fix, else None."""
    text = str(exc)
    lowered = text.lower()
    if isinstance(exc, nats.errors.AuthorizationError) or (
        isinstance(exc, nats.errors.Error)
        and ("authorization" in lowered or "authentication" in lowered)
    ):
        return errors.NatsAuthenticationFailed(
            f"NATS at {access.where} refused the authentication ({_how(access)}): "
            f"{text.removeprefix('nats: ').strip() or 'authorization violation'}"
        )
    if isinstance(exc, _TlsNotOffered):
        return errors.NatsTlsError(
            f"NATS at {access.where} does not offer TLS, which the settings require "
            "(credentials were not sent)"
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        return errors.NatsTlsError(
            f"the certificate of NATS at {access.where} failed verification "
            f"({exc.verify_message}): check nats_tls_ca_file, or nats_tls_hostname "
            "when the certificate names another host"
        )
    if isinstance(exc, ssl.SSLError):
        return errors.NatsTlsError(
            f"the TLS handshake with NATS at {access.where} failed ({exc.reason or exc}): "
            "does the server require a client certificate (nats_tls_cert_file) it trusts?"
        )
    return None


class Refusals:
    """Counts the server's refusals of the credentials while reconnecting; says when to give up.

    nats-py reconnects for ever, also to a server that now refuses the
    credentials it accepted at first (changed, revoked or expired since):
    each attempt ends in ``error_cb``. :meth:`error` is given every error
    nats-py reports; the ``limit``-th refusal with no successful connection
    in between returns the error to stop with. :meth:`connected` (a reconnect
    that went through) starts the count again, so a server that refused for
    a moment is forgiven. Other errors (an unreachable server between two
    refusals) neither count nor reset.
    """

    def __init__(self, access: NatsAccess, limit: int) -> None:
        self.access = access
        self.limit = limit
        self.count = 0
        """Refusals since the last successful connection."""

    def error(self, exc: BaseException) -> errors.NatsReauthenticationFailed | None:
        """Note an error of the connection; the error to give up with at the limit, once."""
        refused = refusal(exc, self.access)
        # 'Authentication Timeout' means the server waited too long for our
        # CONNECT (a loaded machine), not that it refused the credentials.
        timed_out = "timeout" in str(exc).lower()
        if not isinstance(refused, errors.NatsAuthenticationFailed) or timed_out:
            return None
        self.count += 1
        if self.count != self.limit:
            return None
        return errors.NatsReauthenticationFailed(
            f"{refused} ({self.count} reconnects in a row refused: were the credentials "
            "changed, revoked or expired since the worker connected?)",
            refusals=self.count,
        )

    def connected(self) -> None:
        """A (re)connection went through: the credentials work again."""
        self.count = 0

    def closed(self, cause: BaseException | None) -> errors.NatsUnavailable:
        """The error for a connection nats-py closed by itself (it never reconnects after that).

        The server ends a connection with an error, such as an authorization
        violation or an expired JWT, and nats-py gives up on it.
        """
        refused = refusal(cause, self.access) if cause is not None else None
        if isinstance(refused, errors.NatsAuthenticationFailed):
            return errors.NatsReauthenticationFailed(
                f"{refused} (the server closed the connection: were the credentials "
                "changed, revoked or expired since the worker connected?)",
                refusals=self.count + 1,
            )
        reason = f": {type(cause).__name__} {cause}".rstrip() if cause is not None else ""
        return errors.NatsUnavailable(
            f"NATS at {self.access.where} closed the connection{reason}; it is not reconnected"
        )


def _how(access: NatsAccess) -> str:
    url_user, url_password = _url_credentials(access.url)
    if access.creds_file:
        return "credentials file nats_creds_file"
    if access.nkey_seed_file:
        return "NKey seed nats_nkey_seed_file"
    if access.token or (url_user is not None and url_password is None):
        return "token"
    if access.user or url_user is not None:
        return "user and password"
    if access.tls_cert_file:
        return "client certificate"
    return "no credentials configured"


async def connect_nats(
    access: NatsAccess,
    *,
    name: str,
    max_reconnect_attempts: int = 2,
    error_cb: Callable[[Exception], Awaitable[None]] | None = None,
    **callbacks: Any,
) -> Any:
    """A nats-py connection, or an eop error that says why there is none.

    Unreachable servers are tried ``max_reconnect_attempts`` more times, then
    :class:`~eop.errors.NatsUnavailable`; refused credentials and failed TLS
    handshakes end the attempt at once (:class:`~eop.errors.NatsAuthenticationFailed`,
    :class:`~eop.errors.NatsTlsError`). ``callbacks`` go to nats-py as they are.
    """
    options = access.connect_options()
    nc = _Client()
    nc.eop_require_tls = access.tls
    connected = False
    last: list[BaseException] = []

    async def on_error(exc: Exception) -> None:
        if not connected:
            last[:] = [exc]
            refused = refusal(exc, access)
            if refused is not None:
                # Raised through nats-py's connect loop, which would retry.
                raise _Refused(refused)
        if error_cb is not None:
            await error_cb(exc)

    try:
        await nc.connect(
            name=name,
            connect_timeout=2,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]  # seconds; hinted int, any number works
            max_reconnect_attempts=max_reconnect_attempts,
            error_cb=on_error,
            **callbacks,
            **options,
        )
    except _Refused as exc:
        await close_quietly(nc)
        raise exc.error from None
    except NATS_ERRORS as exc:
        await close_quietly(nc)
        cause = last[0] if last else exc
        raise errors.NatsUnavailable(
            f"NATS is unreachable at {access.where}: {type(cause).__name__} {cause}".strip()
        ) from exc
    connected = True
    return nc


async def close_quietly(nc: Any) -> None:
    """Close a nats-py connection, ignoring how that fails (within 2 s).

    Closing a connection that is down can fail writing what it still had
    pending; there is nothing left to do about it but let go.
    """
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), timeout=2)


# -- PostgreSQL ---------------------------------------------------------------

_LIBPQ_TLS = ("sslmode", "sslrootcert", "sslcert", "sslkey")
_VERIFYING = ("require", "verify-ca", "verify-full")


def asyncpg_url(url: str | sa.URL) -> tuple[sa.URL, dict[str, Any]]:
    """An asyncpg URL without libpq's TLS parameters, and the ``connect_args`` replacing them.

    asyncpg takes ``ssl=<mode>`` but not ``sslmode``, ``sslrootcert``,
    ``sslcert`` or ``sslkey``; with those, eop builds the ``ssl`` context.
    ``sslmode=verify-full`` checks the server's name, ``verify-ca`` only its
    CA, ``require`` with ``sslrootcert`` verifies the CA as libpq does.
    """
    parsed = sa.make_url(url)
    query = dict(parsed.query)
    if not parsed.drivername.endswith("+asyncpg") or not any(k in query for k in _LIBPQ_TLS):
        return parsed, {}
    mode = str(query.pop("sslmode", "") or query.get("ssl", "") or "")
    files = {k: str(query.pop(k)) for k in ("sslrootcert", "sslcert", "sslkey") if k in query}
    rest = parsed.set(query={k: v for k, v in query.items() if k != "ssl"})
    if not files:
        return rest, {"ssl": mode} if mode else {}
    if mode not in _VERIFYING:
        raise errors.ConfigurationError(
            f"database_url: sslrootcert/sslcert/sslkey need sslmode=require, verify-ca or "
            f"verify-full, not {mode or 'none'!r}"
        )
    if ("sslcert" in files) != ("sslkey" in files):
        raise errors.ConfigurationError("database_url: sslcert and sslkey go together")
    for key, path in files.items():
        if not os.path.isfile(path):
            raise errors.ConfigurationError(f"database_url: {key} {path!r} does not exist")
    context = ssl.create_default_context(cafile=files.get("sslrootcert"))
    context.check_hostname = mode == "verify-full"
    if mode == "require" and "sslrootcert" not in files:
        context.verify_mode = ssl.CERT_NONE
    if "sslcert" in files:
        context.load_cert_chain(files["sslcert"], files["sslkey"])
    return rest, {"ssl": context}
