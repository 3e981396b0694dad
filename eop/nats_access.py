"""Where NATS is and how eop authenticates to it: :class:`NatsAccess`.

Everything needed to open a NATS connection (servers, one way to
authenticate, TLS files), checked once and picklable, so Spark tasks carry it
to executors. :mod:`eop.broker.connection` opens connections with it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import ssl
import urllib.parse
from typing import Any

from eop import errors, redaction

_SECRETS = frozenset({"password", "token"})
_FILES = ("nkey_seed_file", "creds_file", "tls_ca_file", "tls_cert_file", "tls_key_file")


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

    def __repr__(self) -> str:
        shown = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value != field.default or field.name == "url":
                if field.name in _SECRETS:
                    value = redaction.REDACTED
                elif field.name == "url":
                    value = redaction.redact_urls(value)
                shown.append(f"{field.name}={value!r}")
        return f"NatsAccess({', '.join(shown)})"

    @property
    def where(self) -> str:
        """The server URLs, fit for messages and logs."""
        return redaction.redact_urls(self.url)

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
        url_user, _ = url_credentials(self.url)
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
        url_user, url_password = url_credentials(self.url)
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


def url_credentials(urls: str) -> tuple[str | None, str | None]:
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
