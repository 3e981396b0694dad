"""Engines for eop's database URL: libpq's TLS parameters for asyncpg too.

:func:`asyncpg_url` lets a database URL carry libpq's TLS parameters
(``sslmode``, ``sslrootcert``, ``sslcert``, ``sslkey``) for both drivers:
psycopg (libpq) reads them as they are, asyncpg gets an ``ssl`` context made
from them.
"""

from __future__ import annotations

import os
import ssl
from typing import Any

import sqlalchemy as sa

from eop import errors

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


#: How eop's own connections show in ``pg_stat_activity`` (unless the URL names them).
APPLICATION_NAME = "eop"


def named(connect_args: dict[str, Any]) -> dict[str, Any]:
    """asyncpg ``connect_args`` that name the connection :data:`APPLICATION_NAME`.

    A ``server_settings`` entry already there wins.
    """
    server_settings = {
        "application_name": APPLICATION_NAME,
        **connect_args.get("server_settings", {}),
    }
    return {**connect_args, "server_settings": server_settings}


def named_url(url: sa.URL) -> sa.URL:
    """A libpq (psycopg) URL with ``application_name``, unless it has one."""
    if "application_name" in url.query:
        return url
    return url.update_query_dict({"application_name": APPLICATION_NAME})
