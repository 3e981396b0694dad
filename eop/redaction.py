"""Keeping credentials out of what eop shows: URLs, header values, settings.

Log lines, error messages, dead-letter rows and ``repr`` of settings pass
what they show through here; secrets become ``***``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

REDACTED = "***"

# Header names that may carry credentials; matched case-insensitively anywhere
# in the name, so "X-Api-Key" and "Proxy-Authorization" are caught too.
_SECRET_HEADER = re.compile(
    r"auth|token|secret|passw|api[-_]?key|cookie|credential|signature|session|nkey|jwt",
    re.IGNORECASE,
)


def redact_url(url: str) -> str:
    """The URL without its password (and without a token in the user part).

    ``nats://tok@host`` carries a token where a user would be, and nothing
    tells a token from a user name, so a user part without a password is
    hidden whole. The user part is taken up to the *last* ``@``, since
    drivers accept passwords holding ``/``, ``?``, ``#`` or ``@``: better to
    hide too much than to leak.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return _redact_query(url)
    userinfo, _, hostpart = rest.rpartition("@")
    user, colon, _password = userinfo.partition(":")
    userinfo = f"{user}:{REDACTED}" if colon else REDACTED
    return _redact_query(f"{scheme}://{userinfo}@{hostpart}")


def redact_urls(urls: str) -> str:
    """:func:`redact_url` over a comma-separated list of URLs."""
    return ",".join(redact_url(u.strip()) for u in urls.split(","))


_SECRET_QUERY = re.compile(r"((?:password|passwd|token|secret|sslpassword)=)[^&]*", re.IGNORECASE)


def _redact_query(url: str) -> str:
    return _SECRET_QUERY.sub(lambda m: m.group(1) + REDACTED, url)


def redact_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers with credential-bearing values replaced by ``***``."""
    return {k: (REDACTED if _SECRET_HEADER.search(k) else v) for k, v in headers.items()}
