"""Griffe extensions for the API reference: eop's docstrings as Markdown, Settings' fields.

eop's docstrings use reST's inline markup (``:class:`eop.Writes` ``, a paragraph
ending in ``::`` before an indented example), which the API reference renders
with Markdown. This rewrites each docstring as it is loaded: a role becomes a
code span (``:class:`~eop.testing.store` `` shows ``store``, as Sphinx would),
and ``::`` becomes ``:``, its indented block a code block. Docstrings in eop/
stay as they are. :class:`SettingsFields` documents the fields of
``eop.Settings`` with their ``help`` metadata.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import griffe

from eop import settings

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


class SettingsFields(griffe.Extension):
    """Shows each field of ``eop.Settings`` with its default and its ``help`` text.

    The fields are declared as ``name: type = _field(default, help)``: without
    this, the reference would show the ``_field(...)`` call as the default and
    no text for the field.
    """

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Give a field of ``Settings`` its plain default and its help as a docstring."""
        if not obj.is_attribute or obj.parent is None or obj.parent.path != SETTINGS:
            return
        value = obj.value
        if not (isinstance(value, griffe.ExprCall) and str(value.function) == "_field"):
            return
        obj.value = value.arguments[0]
        help_text = _settings_help().get(obj.name)
        if help_text:
            obj.docstring = griffe.Docstring(markdown(help_text), parent=obj)


SETTINGS = "eop.settings.Settings"


def _settings_help() -> dict[str, str]:
    return {f.name: str(f.metadata["help"]) for f in dataclasses.fields(settings.Settings)}
