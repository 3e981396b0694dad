"""What a valid setting is: one pass over every field of a settings dataclass.

:func:`check_fields` reads each field's type hint and metadata, so a field added
to :class:`eop.settings.Settings` is checked without being listed here:

- its type (``bool``, ``int``, ``float``, ``str`` or a ``Literal`` of choices);
- numbers: finite, at least ``minimum`` (metadata; 0 by default) and at most
  ``maximum`` (metadata; 65535 for a ``*_port``);
- a ``check`` callable in the metadata, for values with a syntax (URLs, the
  schema name): it returns what is wrong, or None.

Every refusal is one :class:`eop.errors.ConfigurationError` naming the field,
its ``EOP_*`` variable and the rule, never echoing a secret.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import math
import re
import urllib.parse
from collections.abc import Callable
from typing import Any, Literal, get_args, get_origin, get_type_hints

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from eop import errors, redaction

#: A check of one value: what is wrong with it, or None.
Check = Callable[[Any], "str | None"]

_PORT_MAX = 65535


def env_var(field_name: str) -> str:
    """The environment variable that sets a field: ``ack_wait_s`` -> ``EOP_ACK_WAIT_S``."""
    return "EOP_" + field_name.upper()


def check_fields(obj: Any, secrets: frozenset[str] = frozenset()) -> None:
    """Check every field of the dataclass instance ``obj`` by its type and metadata.

    ``secrets`` are the fields whose values are never shown in the message.
    """
    hints = get_type_hints(type(obj))
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        problem = _type_problem(hints[field.name], value)
        if problem is None and isinstance(value, (int, float)) and not isinstance(value, bool):
            problem = _range_problem(field, value)
        check: Check | None = field.metadata.get("check")
        if problem is None and check is not None:
            problem = check(value)
        if problem is not None:
            shown = redaction.REDACTED if field.name in secrets else _shown(field.name, value)
            raise errors.ConfigurationError(
                f"{field.name} ({env_var(field.name)}) {problem}, not {shown}"
            )


def _shown(name: str, value: Any) -> str:
    if isinstance(value, str) and name.endswith("_url"):
        return repr(redaction.redact_urls(value))
    return repr(value)


def _type_problem(hint: Any, value: Any) -> str | None:
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        return None if value in choices else f"must be one of {', '.join(map(str, choices))}"
    if hint is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else "must be a whole number"
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "must be a number"
    if hint is str:
        return None if isinstance(value, str) else "must be text"
    return None


def _range_problem(field: dataclasses.Field[Any], value: float) -> str | None:
    unit = " (seconds)" if field.name.endswith("_s") else ""
    minimum = field.metadata.get("minimum", 0)
    maximum = field.metadata.get("maximum", _PORT_MAX if field.name.endswith("_port") else None)
    if not math.isfinite(value):
        return f"must be a finite number{unit}"
    if value < minimum:
        return f"must be at least {minimum}{unit}" if minimum else f"must be 0 or more{unit}"
    if maximum is not None and value > maximum:
        return f"must be at most {maximum}{unit}"
    return None


# PostgreSQL folds unquoted names to lower case and cuts names at 63 bytes;
# eop's name goes into SQL text (search_path, Alembic's version table), so it
# is a plain unquoted identifier: nothing to quote, nothing to escape.
_SCHEMA = re.compile(r"[a-z_][a-z0-9_]*")
_NAME_BYTES = 63


def schema_name(value: str) -> str | None:
    """What is wrong with ``value`` as eop's schema name (None: nothing)."""
    if not _SCHEMA.fullmatch(value):
        return (
            "must be a lowercase PostgreSQL name: ASCII letters a-z, digits and _, "
            "not starting with a digit"
        )
    if len(value.encode()) > _NAME_BYTES:
        return f"must be at most {_NAME_BYTES} bytes long (PostgreSQL would cut it)"
    if value.startswith("pg_"):
        return "must not start with pg_ (reserved for PostgreSQL's own schemas)"
    return None


def postgres_url(value: str) -> str | None:
    """What is wrong with ``value`` as a SQLAlchemy URL of PostgreSQL (None: nothing)."""
    try:
        url = sa.make_url(value)
    except (sa_exc.ArgumentError, ValueError):
        return "must be a URL such as postgresql+asyncpg://user@host:5432/database"
    if url.get_backend_name() != "postgresql":
        return "must be a PostgreSQL URL (postgresql+asyncpg://user@host:5432/database)"
    try:
        dialect = url.get_dialect(_is_async=True)
    except sa_exc.NoSuchModuleError:
        dialect = None
    # The driver's module is only looked for, not imported: checking settings stays cheap.
    if dialect is None or not dialect.is_async or importlib.util.find_spec(dialect.driver) is None:
        return (
            "must name an installed asyncio driver (postgresql+asyncpg://...; "
            f"{url.get_driver_name()!r} is not one)"
        )
    return None


_NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def nats_urls(value: str) -> str | None:
    """What is wrong with ``value`` as comma-separated NATS server URLs (None: nothing)."""
    servers = [item.strip() for item in value.split(",")]
    rule = "must be NATS server URLs, comma separated (nats://host:4222)"
    if not all(servers):
        return rule
    for server in servers:
        parsed = urllib.parse.urlsplit(server if "://" in server else f"nats://{server}")
        try:
            port = parsed.port
        except ValueError:
            return rule
        host = parsed.hostname or ""
        if parsed.scheme not in _NATS_SCHEMES or listen_address(host) is not None or port == 0:
            return f"{rule}; schemes: {', '.join(_NATS_SCHEMES)}"
    return None


_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")


def listen_address(value: str) -> str | None:
    """What is wrong with ``value`` as an address to listen on (None: nothing)."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not _HOST_NAME.fullmatch(value):
            return "must be an IP address (127.0.0.1, 0.0.0.0, ::) or a host name"
    return None
