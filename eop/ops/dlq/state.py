"""Where a dead letter's replay stands, and what one replay did."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any, Literal

from eop import errors

ReplayMode = Literal["publish", "rerun"]


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """What one replay did."""

    id: int
    status: Literal["published", "duplicate", "recovered", "rerun", "skipped", "failed"]
    """``published``: a new message; ``duplicate``: the server already had it
    (an earlier run crashed after publishing); ``recovered``: found in the
    stream, not published again; ``rerun``: the handler ran and committed;
    ``skipped``: replayed before, nothing done; ``failed``: the rerun's handler raised."""
    mode: str
    generation: int
    msg_id: str | None = None
    stream_seq: int | None = None
    detail: str = ""

    def describe(self) -> str:
        """One line for people."""
        parts = [f"dead letter {self.id}: {self.status}"]
        if self.msg_id:
            parts.append(f"msg-id {self.msg_id}")
        if self.stream_seq is not None:
            parts.append(f"stream seq {self.stream_seq}")
        if self.detail:
            parts.append(self.detail)
        return "; ".join(parts)


def already_done(row: Mapping[str, Any], again: bool) -> ReplayResult | None:
    """The "skipped" result when ``row`` was replayed before and not ``again``; else None."""
    if row["replayed_at"] is None or again:
        return None
    when = row["replayed_at"].astimezone(datetime.timezone.utc).isoformat(timespec="seconds")
    return ReplayResult(
        id=row["id"],
        status="skipped",
        mode=row["replay_mode"],
        generation=row["replay_generation"],
        msg_id=row["replay_msg_id"],
        stream_seq=row["replay_stream_seq"],
        detail=f"already replayed ({row['replay_mode']}) at {when}; "
        "--again replays it once more, as a new message",
    )


def pending_publish(row: Mapping[str, Any]) -> bool:
    """A publish was committed as intended and is not confirmed yet: resume, never redo."""
    return bool(row["replay_requested_at"] is not None and row["replayed_at"] is None)


def replay_state(row: Mapping[str, Any]) -> str:
    """``-``, ``pending`` (a publish not yet confirmed), or how and when it was replayed."""
    if row.get("replay_requested_at") is None:
        return "-"
    if row.get("replayed_at") is None:
        return "pending"
    state = f"{row['replay_mode']} #{row['replay_generation']}"
    if row.get("replay_stream_seq") is not None:
        state += f" seq {row['replay_stream_seq']}"
    return state


def not_found(dead_letter_id: int) -> errors.DeadLetterNotFound:
    """The error for an id that names no dead letter."""
    return errors.DeadLetterNotFound(f"no dead letter with id {dead_letter_id}")
