"""The docs' Python: the settings table of docs/configuration.md and the docstring rewriting.

The strict build (``python3 run.py docs``, a step of ``run.py test``) checks
links and references; these tests pin what the build cannot see: that the
configuration page's table is the one ``eop.Settings`` makes today, listing
every setting exactly once, and that reST roles in docstrings come out as
Markdown.
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
    """Every Settings field is a row (its EOP_* variable and help text), in order, none twice."""
    table = load("settings_table").table()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    fields = dataclasses.fields(settings.Settings)
    assert [row.split("`")[3] for row in rows] == [settings.env_var(f.name) for f in fields]
    for field, row in zip(fields, rows, strict=True):
        assert str(field.metadata["help"]).replace("|", "\\|") in row


def test_configuration_page_table_is_current() -> None:
    """docs/configuration.md holds the table eop.Settings makes now: a new, renamed or
    re-documented setting fails here until the table is regenerated."""
    maker = load("settings_table")
    page = maker.PAGE.read_text(encoding="utf-8")
    assert page.count(maker.START) == 1
    assert page.count(maker.END) == 1
    assert maker.current(page) == maker.table(), (
        f"the settings table in docs/configuration.md is not current: run `{maker.COMMAND}`"
    )


def test_settings_table_update_replaces_whatever_stands_between_the_markers() -> None:
    """Regenerating resolves a merge: conflict lines and stale rows between the markers go,
    the text around them stays, and a second run changes nothing."""
    maker = load("settings_table")
    page = f"intro\n{maker.START}\n<<<<<<< ours\n| stale |\n>>>>>>> theirs\n{maker.END}\nafter\n"
    fresh = maker.updated(page)
    assert fresh == f"intro\n{maker.START}\n{maker.table()}{maker.END}\nafter\n"
    assert maker.updated(fresh) == fresh


def test_settings_table_names_each_worker_flag_and_keeps_secrets_off_the_command_line() -> None:
    """A setting's flag column shows its ``eop worker`` flags; a secret has none."""
    rows = {
        row.split("`")[1]: row
        for row in load("settings_table").table().splitlines()
        if row.startswith("| `")
    }
    assert "| `--ack-wait-s` |" in rows["ack_wait_s"]
    assert "| `--create`, `--no-create` |" in rows["create"]
    for name in settings.SECRET_FIELDS:
        assert "| none: environment only |" in rows[name]


def test_sphinx_roles_and_literal_markers_become_markdown() -> None:
    """:class:`x` becomes `x` (`~` keeps the last part), and `::` before a block becomes `:`."""
    markdown = load("griffe_roles").markdown
    text = "See :class:`eop.Writes` and :meth:`~eop.Settings.from_env`::\n\n    x = 1\n"
    assert markdown(text) == "See `eop.Writes` and `from_env`:\n\n    x = 1\n"
    assert markdown(":mod:`the store <eop.testing.store>`") == "`the store`"
