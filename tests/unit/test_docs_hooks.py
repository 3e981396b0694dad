"""The docs site's build hooks: the settings table and the docstring rewriting.

The strict build (``python3 run.py docs``, a step of ``run.py test``) checks
links and references; these tests pin what the build cannot see: that the
configuration page lists every setting exactly once, and that reST roles in
docstrings come out as Markdown.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
from pathlib import Path

from eop import settings

HOOKS = Path(__file__).resolve().parents[2] / "docs" / "hooks"


def load(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", HOOKS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_settings_table_has_one_row_per_field_with_its_help() -> None:
    """Every Settings field is a row (its EOP_* variable and help text), none twice."""
    table = load("settings_table").table()
    rows = [line for line in table.splitlines() if line.startswith("| `EOP_")]
    fields = dataclasses.fields(settings.Settings)
    assert [row.split("`")[1] for row in rows] == [settings.env_var(f.name) for f in fields]
    for field, row in zip(fields, rows, strict=True):
        assert str(field.metadata["help"]).replace("|", "\\|") in row


def test_configuration_page_keeps_the_marker_the_table_replaces() -> None:
    """docs/configuration.md holds the marker, so the build puts the table there."""
    hooks = load("settings_table")
    page = (HOOKS.parent / hooks.PAGE).read_text(encoding="utf-8")
    assert page.count(hooks.MARKER) == 1


def test_sphinx_roles_and_literal_markers_become_markdown() -> None:
    """:class:`x` becomes `x` (`~` keeps the last part), and `::` before a block becomes `:`."""
    markdown = load("griffe_roles").markdown
    text = "See :class:`eop.Writes` and :meth:`~eop.Settings.from_env`::\n\n    x = 1\n"
    assert markdown(text) == "See `eop.Writes` and `from_env`:\n\n    x = 1\n"
    assert markdown(":mod:`the store <eop.testing.store>`") == "`the store`"
