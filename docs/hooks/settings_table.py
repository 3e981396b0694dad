"""The table of settings on docs/configuration.md, made from eop.Settings.

The table lives in the page itself, between two markers, so that it reads the
same on GitHub as on the site. ``python3 run.py docs --update`` runs this file
and rewrites it: one row per field of :class:`eop.settings.Settings`, in the
order of the class, with the field's name, its ``EOP_*`` variable, its
``eop worker`` flag, type, default and ``help`` metadata (the text
``eop worker --help`` shows). ``tests/unit/test_docs_hooks.py`` fails while
the page's table differs from what this makes.

The output depends on nothing but the code (no environment, no clock), so
after a merge in which two branches each added a setting, rerunning it is
the whole resolution of a conflict inside the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

from eop import settings
from eop.cli import build_parser

PAGE = Path(__file__).resolve().parents[1] / "configuration.md"
COMMAND = "python3 run.py docs --update"
START = f"<!-- settings-table: made from eop.Settings by `{COMMAND}`; do not edit -->"
END = "<!-- settings-table: end -->"


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


def _worker_flags() -> dict[str, list[str]]:
    """Each setting's flags on ``eop worker``, as its parser declares them."""
    parser = build_parser()
    commands = next(
        action
        for action in parser._actions  # argparse keeps its subparsers nowhere public
        if isinstance(action, argparse._SubParsersAction)
    )
    worker = commands.choices["worker"]
    return {action.dest: list(action.option_strings) for action in worker._actions}


def _flag(name: str, flags: dict[str, list[str]]) -> str:
    shown = flags.get(name)
    if not shown:
        return "none: environment only" if name in settings.SECRET_FIELDS else "none"
    return ", ".join(f"`{flag}`" for flag in shown)


def table() -> str:
    """The Markdown table of every setting, one row per field in the class's order."""
    hints = typing.get_type_hints(settings.Settings)
    flags = _worker_flags()
    rows = [
        "| setting | variable | flag | type | default | meaning |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for field in dataclasses.fields(settings.Settings):
        meaning = str(field.metadata["help"]).replace("|", "\\|").replace("\n", " ")
        rows.append(
            f"| `{field.name}` | `{settings.env_var(field.name)}` | {_flag(field.name, flags)} "
            f"| {_type(hints[field.name])} | {_default(field.default)} | {meaning} |"
        )
    return "\n".join(rows) + "\n"


def current(page: str) -> str:
    """What stands between the markers of ``page``: the table as last made."""
    _, start, rest = page.partition(START)
    body, end, _ = rest.partition(END)
    if not start or not end:
        raise SystemExit(
            f"error: {PAGE.name} lost its markers; put back {START} and {END} "
            "around the place of the settings table"
        )
    return body.strip("\n") + "\n"


def updated(page: str) -> str:
    """``page`` with a fresh table between its markers (whatever stood there before)."""
    current(page)  # the markers are there
    before, _, rest = page.partition(START)
    _, _, after = rest.partition(END)
    return f"{before}{START}\n{table()}{END}{after}"


def main(argv: list[str]) -> int:
    """Rewrite the table on the page; print whether it changed."""
    if argv:
        print(f"usage: {COMMAND} (no arguments)", file=sys.stderr)
        return 2
    page = PAGE.read_text(encoding="utf-8")
    fresh = updated(page)
    if fresh == page:
        print(f"{PAGE.name}: the settings table is current")
        return 0
    PAGE.write_text(fresh, encoding="utf-8")
    print(f"{PAGE.name}: the settings table is rewritten from eop.Settings")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
