"""A MkDocs hook: the table of settings on configuration.md, made from eop.Settings.

The page holds the marker ``<!-- settings-table -->``; the build replaces it
with one row per field of :class:`eop.settings.Settings`, in the order of the
class: its ``EOP_*`` variable, type, default and the field's ``help``
metadata (the text ``eop worker --help`` shows). Adding, renaming or
re-documenting a setting therefore changes the page at the next build, and a
page without the marker fails the build.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from mkdocs.exceptions import PluginError

from eop import settings

PAGE = "configuration.md"
MARKER = "<!-- settings-table -->"


def _default(value: object) -> str:
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if value == "":
        return "unset"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def _type(hint: object) -> str:
    choices = typing.get_args(hint)
    if choices:
        return " \\| ".join(f"`{choice}`" for choice in choices)
    return f"`{getattr(hint, '__name__', hint)}`"


def table() -> str:
    """The Markdown table of every setting."""
    hints = typing.get_type_hints(settings.Settings)
    rows = [
        "| variable | type | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for field in dataclasses.fields(settings.Settings):
        meaning = str(field.metadata["help"]).replace("|", "\\|").replace("\n", " ")
        if field.name in settings.SECRET_FIELDS:
            meaning += " Environment only: never a flag."
        rows.append(
            f"| `{settings.env_var(field.name)}` | {_type(hints[field.name])} "
            f"| {_default(field.default)} | {meaning} |"
        )
    return "\n".join(rows) + "\n"


def on_page_markdown(markdown: str, *, page: Any, **kwargs: Any) -> str:
    """Put the table in place of the marker on the configuration page."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"{PAGE} lost its {MARKER} marker: the settings table has no place")
    return markdown.replace(MARKER, table())
