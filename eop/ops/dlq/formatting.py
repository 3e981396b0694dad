"""Dead letters for people (tables, details) and for programs (JSON)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from eop import redaction
from eop.ops import tables
from eop.ops.dlq import state

_TABLE_COLUMNS = (
    ("ID", "id"),
    ("HANDLER", "subscription"),
    ("STREAM", "stream"),
    ("SEQ", "stream_seq"),
    ("REASON", "reason"),
    ("ERROR", "error"),
    ("DELIV", "delivery_count"),
    ("CREATED (UTC)", "created_at"),
    ("REPLAYED", "replay"),
)


def format_table(rows: Sequence[Mapping[str, Any]], *, error_width: int = 40) -> str:
    """The dead letters as an aligned text table (errors cut to ``error_width``)."""
    cells = [[title for title, _ in _TABLE_COLUMNS]]
    for row in rows:
        cells.append([_cell(key, row, error_width) for _, key in _TABLE_COLUMNS])
    return "\n".join(tables.aligned(cells))


def _cell(key: str, row: Mapping[str, Any], error_width: int) -> str:
    if key == "replay":
        return state.replay_state(row)
    return tables.text(row.get(key), error_width if key == "error" else None)


def to_json(row: Mapping[str, Any]) -> dict[str, Any]:
    """A dead letter (without payload) as JSON-able values; headers redacted once more."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key in ("payload", "fingerprint"):
            if key == "fingerprint" and value is not None:
                out[key] = bytes(value).hex()
            continue
        if isinstance(value, datetime.datetime):
            value = value.astimezone(datetime.timezone.utc).isoformat()
        if key == "headers":
            value = redaction.redact_headers(value or {})
        out[key] = value
    out["replay"] = state.replay_state(row)
    return out


def format_details(row: Mapping[str, Any]) -> str:
    """Everything about one dead letter, for people (no payload: ``--payload`` prints it)."""
    data = to_json(row)
    lines = []
    for key in (
        "id", "subscription", "stream", "stream_epoch", "stream_seq", "subject", "msg_id",
        "reason", "delivery_count", "created_at", "payload_size", "fingerprint",
    ):  # fmt: skip
        lines.append(f"{key + ':':<16}{data.get(key)}")
    lines.append(f"{'replay:':<16}{data['replay']}")
    for key in ("replay_generation", "replay_msg_id", "replay_requested_at", "replayed_at"):
        if data.get(key) not in (None, 0):
            lines.append(f"{key + ':':<16}{data[key]}")
    lines.append("headers:")
    lines.append(_indent(json.dumps(data.get("headers") or {}, indent=2, sort_keys=True)))
    lines.append("error:")
    lines.append(_indent(str(data.get("error") or "")))
    if data.get("traceback"):
        lines.append("traceback:")
        lines.append(_indent(str(data["traceback"]).rstrip()))
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
