"""How eop reaches NATS: credentials, TLS, and refused connections.

:class:`NatsAccess` is everything needed to open a NATS connection (servers,
one way to authenticate, TLS files), checked once and picklable, so Spark
tasks carry it to executors. :func:`connect_nats` is the one place where eop
opens a NATS connection: it fails fast, with an error naming the cause, when
the server refuses the credentials or the TLS handshake fails, instead of
retrying a connection that can never succeed. (PostgreSQL's side, TLS
parameters in a database URL, is :mod:`eop.pg.engines`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS

from eop import errors
from eop.broker import client, server
from eop.nats_access import NatsAccess, url_credentials

#: What nats-py raises when the server cannot be reached or does not answer.
NATS_ERRORS = (OSError, asyncio.TimeoutError, nats.errors.Error)


class _Client(client.Client):
    """nats-py's client, refusing a server that skips TLS when TLS is required.

    nats-py upgrades to TLS only when the server's INFO asks for it, so a
    server (or a man in the middle) that does not ask would get the
    credentials in the clear. Protocol input that is not UTF-8 is survived
    (see :class:`eop.broker.client.Client`).
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
    url_user, url_password = url_credentials(access.url)
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
) -> client.Client:
    """A nats-py connection, or an eop error that says why there is none.

    Unreachable servers are tried ``max_reconnect_attempts`` more times, then
    :class:`~eop.errors.NatsUnavailable`; refused credentials and failed TLS
    handshakes end the attempt at once (:class:`~eop.errors.NatsAuthenticationFailed`,
    :class:`~eop.errors.NatsTlsError`); a server older than eop supports is refused
    (:func:`eop.broker.server.check_supported`). ``callbacks`` go to nats-py as they
    are, except that ``disconnected_cb`` is not called for a close of eop's own.
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

    disconnected_cb = callbacks.pop("disconnected_cb", None)
    if disconnected_cb is not None:

        async def on_disconnected() -> None:
            # Closing the connection (a refused server, a command done) is no news.
            if not nc.eop_closing:
                await disconnected_cb()

        callbacks["disconnected_cb"] = on_disconnected

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
    except asyncio.CancelledError:
        # A worker stopped while it waits for NATS: no connection left reconnecting.
        await close_quietly(nc)
        raise
    except NATS_ERRORS as exc:
        await close_quietly(nc)
        cause = last[0] if last else exc
        raise errors.NatsUnavailable(
            f"NATS is unreachable at {access.where}: {type(cause).__name__} {cause}".strip()
        ) from exc
    connected = True
    try:
        server.check_supported(nc, access.where)
    except errors.ConfigurationError:
        await close_quietly(nc)
        raise
    return nc


async def close_quietly(nc: NATS) -> None:
    """Close a nats-py connection, ignoring how that fails (within 2 s).

    Closing a connection that is down can fail writing what it still had
    pending; there is nothing left to do about it but let go.
    """
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), timeout=2)
