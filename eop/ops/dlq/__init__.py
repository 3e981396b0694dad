"""Dead letters: list, show, replay and purge them (``eop dlq``).

A replay is safe to repeat. Each dead letter counts its replays in
``replay_generation``; the ``Nats-Msg-Id`` of a published replay is derived
from the dead letter and that generation (:func:`replay_msg_id`), and it is
committed *before* the publish, with ``replay_requested_at``. So:

- crash before that commit: nothing was published, the next run starts afresh;
- crash after it, before or after the publish: the next run finds the intent
  unfinished and resumes it with the *same* msg-id: it looks for that msg-id
  in the stream, and publishes only if it is not there (the server's duplicate
  window, then the handler's msg-id guard in the inbox, catch a publish the
  scan missed);
- finished (``replayed_at`` set): a second replay is a no-op and says so; only
  ``again=True`` starts a new generation, a new msg-id, a second effect.

A rerun (``--rerun``) runs the handler here, in one transaction with the
bookkeeping: the dead letter row is locked, its ``replayed_at`` and the
handler's writes commit together or not at all.

Its modules: :mod:`~eop.ops.dlq.filters` (which dead letters),
:mod:`~eop.ops.dlq.dead_letters` (list, show, purge), :mod:`~eop.ops.dlq.replay` (the
publish), :mod:`~eop.ops.dlq.rerun`, :mod:`~eop.ops.dlq.state` (where a replay
stands, what one did) and :mod:`~eop.ops.dlq.formatting` (tables and JSON).
"""

from __future__ import annotations

from eop.ops.dlq.dead_letters import DeadLetters
from eop.ops.dlq.filters import Filters, parse_when
from eop.ops.dlq.formatting import format_details, format_table, to_json
from eop.ops.dlq.replay import (
    REPLAY_OF_HEADER,
    SCAN_MARGIN,
    Replayer,
    replay_headers,
    replay_msg_id,
)
from eop.ops.dlq.state import ReplayMode, ReplayResult, replay_state

__all__ = [
    # which dead letters, and reading them
    "Filters",
    "parse_when",
    "DeadLetters",
    # replaying them
    "Replayer",
    "ReplayMode",
    "ReplayResult",
    "replay_msg_id",
    "replay_headers",
    "REPLAY_OF_HEADER",
    "SCAN_MARGIN",
    # showing them
    "replay_state",
    "format_table",
    "format_details",
    "to_json",
]
