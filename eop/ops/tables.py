"""Plain-text tables for the operators' commands (``eop status``, ``eop dlq``, ``eop outbox``)."""

from __future__ import annotations

import datetime
from collections.abc import Sequence


def aligned(cells: Sequence[Sequence[str]]) -> list[str]:
    """The rows of ``cells`` (the titles first) with every column padded to its widest cell."""
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    return [
        "  ".join(value.ljust(width) for value, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    ]


def counted(count: int, noun: str) -> str:
    """``1 dead letter``, ``2 dead letters``: ``count`` and ``noun``, plural unless one."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def utc(value: datetime.datetime) -> str:
    """A time as a table shows it: UTC, to the second."""
    return value.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def text(value: object, width: int | None = None) -> str:
    """A value on one line (its whitespace collapsed; None is empty), cut to ``width``."""
    if isinstance(value, datetime.datetime):
        return utc(value)
    shown = " ".join(str(value).split()) if value is not None else ""
    if width is not None and len(shown) > width:
        shown = shown[: width - 1] + "…"
    return shown
