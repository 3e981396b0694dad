"""eop's settings from Django's: the ``EOP`` dict of settings.py and ``DATABASES[alias]``.

::

    EOP = {
        "APP": "myproject.handlers:app",  # the eop.App whose handlers the worker runs
        "DATABASE": "default",            # the DATABASES alias handlers write through
        "NATS_URL": "nats://127.0.0.1:4222",
        "SCHEMA": "eop",
        # ...any other eop setting, by its EOP_* name without the prefix
    }

Precedence: ``EOP_*`` environment variables, then the ``EOP`` dict, then the
flags of ``manage.py eop ...``. The database URL is always Django's:
eop's own engines (its bookkeeping, the relay, migrations) reach the database
Django's handlers write to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from eop import errors
from eop import settings as settings_mod

#: The keys of ``settings.EOP`` that are not eop settings.
OWN_KEYS = ("APP", "DATABASE")

# Django's PostgreSQL backends: both talk to PostgreSQL through psycopg.
_ENGINES = ("django.db.backends.postgresql", "django.contrib.gis.db.backends.postgis")

# libpq connection parameters Django passes on from OPTIONS that change where or
# how eop's connections go; psycopg's URL takes them all, asyncpg's the TLS ones
# (eop.pg.engines turns those into an ssl context).
_LIBPQ = (
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslcrl",
    "connect_timeout",
    "target_session_attrs",
    "options",
    "passfile",
    "service",
)
_ASYNCPG = ("sslmode", "sslrootcert", "sslcert", "sslkey")


def eop_dict() -> dict[str, Any]:
    """``settings.EOP`` (empty when unset), checked to be a dict."""
    from django.conf import settings

    found = getattr(settings, "EOP", {})
    if not isinstance(found, Mapping):
        raise errors.ConfigurationError(f"settings.EOP must be a dict, not {type(found).__name__}")
    return dict(found)


def alias() -> str:
    """The ``DATABASES`` alias eop's handlers and engines use (``EOP["DATABASE"]``)."""
    return str(eop_dict().get("DATABASE", "default"))


def database_url(
    database: Mapping[str, Any], driver: str = "asyncpg", *, name: str | None = None
) -> sa.URL:
    """The SQLAlchemy URL of a ``DATABASES`` entry, for ``driver`` (asyncpg or psycopg).

    ``name`` replaces the database's NAME (Django's test database). A HOST that
    is a directory is a Unix socket: it goes in the query, as libpq reads it.
    """
    engine = database.get("ENGINE", "")
    if engine not in _ENGINES:
        raise errors.ConfigurationError(
            f"eop needs a PostgreSQL database; DATABASES has ENGINE {engine!r}"
        )
    options = dict(database.get("OPTIONS") or {})
    kept = _LIBPQ if driver == "psycopg" else _ASYNCPG
    query = {key: str(options[key]) for key in kept if key in options}
    host = str(database.get("HOST") or "") or None
    if host is not None and host.startswith("/"):
        query["host"] = host
        host = None
    port = database.get("PORT")
    return sa.URL.create(
        f"postgresql+{driver}",
        username=str(database.get("USER") or "") or None,
        password=str(database.get("PASSWORD") or "") or None,
        host=host,
        port=int(port) if port not in (None, "") else None,
        database=name or str(database.get("NAME") or "") or None,
        query=query,
    )


def settings(
    overrides: Mapping[str, object] | None = None, *, database: Mapping[str, Any] | None = None
) -> settings_mod.Settings:
    """eop's Settings: the environment's, then ``settings.EOP``'s, then ``overrides``.

    The database URL is the one of ``database`` (default: ``DATABASES`` of
    :func:`alias`), whatever the other sources say.
    """
    from django.db import connections

    cli = {k: v for k, v in (overrides or {}).items() if v is not None}
    if database is None:
        name = alias()
        if name not in connections.databases:
            raise errors.ConfigurationError(
                f'settings.EOP["DATABASE"] is {name!r}, which DATABASES does not define'
            )
        database = connections.databases[name]
    url = database_url(database).render_as_string(hide_password=False)
    return _built(eop_given(), {**cli, "database_url": url})


def checked() -> settings_mod.Settings:
    """eop's Settings from the environment and ``settings.EOP``, without the database's:
    an unknown key or a refused value is a :class:`~eop.errors.ConfigurationError`, a
    value of ``settings.EOP`` named by its key there."""
    return _built(eop_given(), {})


def _built(given: Mapping[str, object], overrides: Mapping[str, object]) -> settings_mod.Settings:
    """``Settings.from_env`` with ``given`` (``settings.EOP``'s, by its keys) then
    ``overrides`` over the environment. An error about a value of ``settings.EOP`` names
    its key there, not the ``EOP_*`` variable the same error names otherwise."""
    values = {key.lower(): value for key, value in given.items()}
    try:
        return settings_mod.Settings.from_env(overrides={**values, **overrides})
    except errors.ConfigurationError as exc:
        text = str(exc)
        for key in given:
            name = key.lower()
            if name not in overrides:
                named = f"{name} ({settings_mod.env_var(name)})"
                text = text.replace(named, f'{name} (settings.EOP["{key}"])')
        if text == str(exc):
            raise
        raise errors.ConfigurationError(text) from None


def eop_given() -> dict[str, object]:
    """The entries of ``settings.EOP`` that set eop's settings, keyed as written; an
    unknown key is an error."""
    fields = {f.name for f in dataclasses.fields(settings_mod.Settings)}
    given: dict[str, object] = {}
    for key, value in eop_dict().items():
        if key in OWN_KEYS:
            continue
        name = key.lower()
        if name == "database_url":
            raise errors.ConfigurationError(
                f"settings.EOP cannot set {key!r}: eop uses the database of DATABASES "
                '(settings.EOP["DATABASE"] names its alias, "default" if unset)'
            )
        if name not in fields:
            known = ", ".join(
                sorted(OWN_KEYS + tuple(f.upper() for f in fields if f != "database_url"))
            )
            raise errors.ConfigurationError(
                f"settings.EOP has an unknown key {key!r} (known: {known}); the database "
                "comes from DATABASES"
            )
        given[key] = value
    return given


def check_settings(**_: object) -> list[Any]:
    """Django's system check of ``settings.EOP`` (``eop.E001``): what eop refuses in it, in
    a line, where Django's commands (``check``, ``runserver``, ``migrate``) show it."""
    from django.core import checks

    try:
        checked()
    except errors.ConfigurationError as exc:
        return [checks.Error(str(exc), id="eop.E001")]
    return []


def app_path() -> str:
    """``EOP["APP"]``: where the eop.App with the project's handlers is."""
    path = eop_dict().get("APP")
    if not isinstance(path, str) or ":" not in path:
        raise errors.ConfigurationError(
            'settings.EOP["APP"] must name the eop.App of your handlers, e.g. '
            '"myproject.handlers:app"'
        )
    return path
