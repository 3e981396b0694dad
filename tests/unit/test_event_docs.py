"""docs/observability.md has one row for every log event and action eop has, and only those.

Users build alerts and dashboards on the ``event`` and ``action`` of eop's log
lines, and the page's tables of them are written by hand. These tests compare
the first column of each table with :class:`eop.log.Event` and
:class:`eop.log.Action`, so a member added, renamed or dropped fails here until
the page says so; and they check that every event is logged somewhere in eop,
so that the vocabulary names no event a user could wait for in vain.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eop import log

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "observability.md"
EVENTS = "### The events"
ACTIONS = "### Actions"


def rows(heading: str) -> tuple[list[str], int]:
    """The names in the first column of the table under ``heading``, in the page's order,
    and how many body rows that table has (a row naming no single name is not counted
    in the first)."""
    text = PAGE.read_text(encoding="utf-8")
    assert heading in text, f"docs/observability.md lost its section {heading!r}"
    section = re.split(r"\n#+ ", text.split(heading, 1)[1], maxsplit=1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    body = table[2:]  # below the header and its --- line
    names = [m.group(1) for line in body if (m := re.match(r"^\| `([^`]+)` \|", line))]
    return names, len(body)


@pytest.mark.parametrize(
    ("heading", "members"),
    [(EVENTS, [e.value for e in log.Event]), (ACTIONS, [a.value for a in log.Action])],
    ids=["events", "actions"],
)
def test_the_table_lists_each_member_once_and_nothing_else(
    heading: str, members: list[str]
) -> None:
    """Each member has exactly one row of its own; no row names a member that is gone."""
    names, body = rows(heading)
    assert len(names) == body, f"{heading}: a row whose first cell is not one `name`"
    doubled = sorted({n for n in names if names.count(n) > 1})
    assert not doubled, f"{heading}: rows for the same name twice: {doubled}"
    missing = sorted(set(members) - set(names))
    assert not missing, f"{heading}: no row for {missing}: add one to docs/observability.md"
    unknown = sorted(set(names) - set(members))
    assert not unknown, f"{heading}: rows for {unknown}, which eop.log no longer has"


def test_every_event_is_logged_somewhere_in_eop() -> None:
    """No member of log.Event is left that nothing logs (``subscription.lost`` was one):
    each is named as ``Event.NAME`` by some module other than its definition."""
    definition = ROOT / "eop" / "log.py"
    sources = [
        p.read_text(encoding="utf-8") for p in (ROOT / "eop").rglob("*.py") if p != definition
    ]
    # log.py logs library.log itself (Event.LIBRARY_LOG): its code below the enums counts.
    sources.append(definition.read_text(encoding="utf-8").split("class Action", 1)[1])
    unused = [
        e.name
        for e in log.Event
        if not any(re.search(rf"\bEvent\.{e.name}\b", text) for text in sources)
    ]
    assert not unused, f"log.Event members nothing logs: {unused}"
