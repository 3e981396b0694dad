"""A griffe extension: eop's docstrings, written with Sphinx roles, as Markdown.

eop's docstrings use reST's inline markup (``:class:`eop.Writes` ``, a paragraph
ending in ``::`` before an indented example), which the API reference renders
with Markdown. This rewrites each docstring as it is loaded: a role becomes a
code span (``:class:`~eop.testing.store` `` shows ``store``, as Sphinx would),
and ``::`` becomes ``:``, its indented block a code block. Docstrings in eop/
stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# :class:`eop.Writes`, :meth:`~Settings.from_env`, :mod:`text <target>`
_ROLE = re.compile(r":(?:py:)?[a-z]+:`(~?)([^`<]*?)\s*(?:<([^`>]+)>)?`")
# "... as follows::" at the end of a line, or "::" alone on a line
_LITERAL = re.compile(r"(?m)(\S)::$|^\s*::$")


def _role(match: re.Match[str]) -> str:
    short, text, target = match.group(1), match.group(2), match.group(3)
    if target and text:
        return f"`{text}`"
    name = text or target or ""
    return f"`{name.rsplit('.', 1)[-1] if short else name}`"


def _literal(match: re.Match[str]) -> str:
    return f"{match.group(1)}:" if match.group(1) else ""


def markdown(text: str) -> str:
    """``text``, a docstring with reST roles and literal markers, as Markdown."""
    return _LITERAL.sub(_literal, _ROLE.sub(_role, text))


class SphinxRoles(griffe.Extension):
    """Rewrites every loaded docstring with :func:`markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
