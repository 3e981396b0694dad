"""Keeping credentials out of what eop shows: URLs, header values, settings.

Log lines, error messages, dead-letter rows and ``repr`` of settings pass
what they show through here; secrets become ``***``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

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


# A URL inside a text runs from its scheme to the next blank.
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://\S+")


def redact_text(text: str) -> str:
    """``text`` with every URL in it as :func:`redact_url` shows it, and the values
    of ``password=``, ``token=``, ``secret=`` (a query, a libpq keyword string) masked."""
    return _redact_query(_URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text))


# A value ends at the next ``&`` or blank, or is quoted (a libpq keyword string's
# ``password='a b'``): inside a traceback, masking to the end would hide the rest of it.
_SECRET_QUERY = re.compile(
    r"((?:password|passwd|token|secret|sslpassword)=)(?:'[^']*'|\"[^\"]*\"|[^&\s]*)",
    re.IGNORECASE,
)


def _redact_query(url: str) -> str:
    return _SECRET_QUERY.sub(lambda m: m.group(1) + REDACTED, url)


def redact_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers with credential-bearing values replaced by ``***``."""
    return {k: (REDACTED if _SECRET_HEADER.search(k) else v) for k, v in headers.items()}


# -- bound values in database error text
#
# PostgreSQL's messages quote the value they refuse (`invalid input syntax for
# type integer: "..."`, `value "..." is out of range`), asyncpg's quote the
# argument it cannot encode (`invalid input for query argument $1: '...'`),
# DETAIL lines quote keys and rows. Names of relations, constraints, columns,
# types and encodings are quoted the same way and worth keeping: a quoted text
# is kept only after one of these words (or, in Python's messages, before
# "object" or "codec": `'str' object`, `'utf-8' codec`); everything else
# quoted is masked.
_NAME_BEFORE = (
    r"relation|constraint|column|table|index|schema|type|function|procedure|sequence|"
    r"database|role|user|view|trigger|encoding|extension|domain|collation|operator|"
    r"cursor|savepoint|statement|tablespace|parameter|publication|subscription|policy|"
    r"rule|attribute|enum|channel|portal|server|language|aggregate|conversion|"
    r"identifier|name|module|option|setting|configuration parameter"
)
_QUOTED = re.compile(
    r"(?P<before>\b(?:" + _NAME_BEFORE + r")\s+)?"
    r"(?<!\w)(?P<q>[\"'])(?P<text>[^\"'\n]*?)(?:(?P=q)(?!\w)|$)"
    r"(?P<after>\s+(?:object|codec)\b)?",
    re.IGNORECASE | re.MULTILINE,
)
# asyncpg: `invalid input for query argument $1: <repr, cut at 40> (<encoder's reason>)`.
# Greedy up to 43 characters: a " (" inside the value is taken as part of it.
_ARGUMENT = re.compile(r"(query argument \$\d+): (?:.{0,43} \((?P<why>.*)\)|.*)$", re.MULTILINE)
# DETAIL lines, should one get through: `Key (k)=(v) already exists`, `Failing row contains (...)`.
_KEY = re.compile(r"(Key \([^)]*\)=)\(.*\)")
_ROW = re.compile(r"(Failing row contains )\(.*\)")
# Bytes of the value PostgreSQL could not convert (`invalid byte sequence ...: 0xe2 0x28`);
# a lone 0x00 says "a NUL byte" and nothing of the rest.
_BYTES = re.compile(r"0x(?!00\b)[0-9a-fA-F]{2}(?:\s+0x[0-9a-fA-F]{2})*")
# Shorter bound values are not searched for: masking every "1" or "ok" in a
# message would garble it, and the quoting rules above cover them.
_SHORTEST_VALUE = 4


def scrub_values(text: str, values: Iterable[object] = ()) -> str:
    """``text`` (a database or driver error message) without the values it may quote.

    Masks with ``***``: every quoted text that is not a name (see above),
    asyncpg's quoted argument, key and row values of DETAIL lines, bytes of an
    undecodable value, and any occurrence of ``values`` (a statement's bound
    values, when known) of at least 4 characters.
    """
    for value in sorted(_texts(values), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    text = _ARGUMENT.sub(_argument, text)
    text = _KEY.sub(rf"\1({REDACTED})", text)
    text = _ROW.sub(rf"\1({REDACTED})", text)
    text = _BYTES.sub(f"0x{REDACTED}", text)
    return _QUOTED.sub(_quoted, text)


def _argument(match: re.Match[str]) -> str:
    why = match.group("why")
    return f"{match.group(1)}: {REDACTED}" + (f" ({why})" if why else "")


def _quoted(match: re.Match[str]) -> str:
    if match.group("before") or match.group("after"):
        return match.group(0)
    quote = match.group("q")
    closed = match.group(0).rstrip().endswith(quote) and len(match.group(0)) > 1
    return f"{quote}{REDACTED}{quote}" if closed else f"{quote}{REDACTED}"


def _texts(values: Iterable[object]) -> set[str]:
    """The text forms of ``values`` and of what they hold (dicts, lists, tuples)."""
    found: set[str] = set()
    pending = list(values)
    while pending:
        value = pending.pop()
        if isinstance(value, Mapping):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            pending.extend(value)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            pending.append(bytes(value).decode("utf-8", "replace"))
        elif value is not None and not isinstance(value, bool):
            shown = str(value)
            if len(shown) >= _SHORTEST_VALUE:
                found.update({shown, repr(value)[1:-1] if isinstance(value, str) else shown})
    return found
