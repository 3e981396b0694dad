"""How a stopping ``eop worker`` process ends, whatever its handlers are doing.

A stop (SIGTERM, SIGINT) stops fetching, lets in-flight messages finish for
``shutdown_grace_s``, then cancels the rest: an ``async def`` handler is
cancelled where it awaits, and its transaction rolls back. A COMMIT under way
and the ack that follows it are never cut; they end within ``ack_give_up_s``.

A thread cannot be cancelled: a sync handler stuck in ``time.sleep`` or in a
lock wait (its ``statement_timeout`` aside) keeps its thread, and Python
waits for every such thread before a process exits. So once the worker has
stopped, with the COMMITs and acks done and the logs flushed, a thread still
running a handler ends the process with :func:`os._exit`: its transaction
never committed, so PostgreSQL rolls it back when the connection closes, and
its message is redelivered after its AckWait. The same happens if the stop as
a whole overruns :func:`deadline_s`, whatever held it up (a pool, a socket, a
handler that swallows its cancellation).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable

from eop import log
from eop.settings import Settings

EXIT_STOPPED = 0
"""Stopped: every in-flight message finished, or was cancelled and left for redelivery."""
EXIT_ERROR = 1
"""A configuration or start-up error, or NATS gave up on the worker (printed on stderr)."""
EXIT_FORCED = 3
"""Stopped by :func:`os._exit`: a handler's thread could not be stopped, or the stop
overran :func:`deadline_s`. Messages still held come back after their AckWait."""

STOP_MARGIN_S = 5.0
"""What a stop may take beyond the grace and the acks: cancelling, closing connections."""


def deadline_s(settings: Settings) -> float:
    """The longest a stop takes, from the signal to the end of the process.

    ``shutdown_grace_s`` for in-flight messages, then ``ack_give_up_s`` for
    the acks of the COMMITs under way, then :data:`STOP_MARGIN_S`.
    """
    return settings.shutdown_grace_s + settings.ack_give_up_s + STOP_MARGIN_S


def exit_now(status: int, reason: str, **fields: object) -> None:
    """Log why, flush the logs, and end the process at once (no thread is waited for)."""
    log.get_logger().warning(log.Event.WORKER_EXIT_FORCED, reason=reason, status=status, **fields)
    # A broken handler or a closed stream must not keep the process alive.
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


class Watchdog:
    """Ends the process with :data:`EXIT_FORCED` if it still runs ``after_s`` after :meth:`arm`.

    A daemon thread, so that it works while the event loop is blocked, and
    never keeps a process alive that has finished.
    """

    def __init__(self, after_s: float, on_fire: Callable[[], None] | None = None) -> None:
        self.after_s = after_s
        self._armed = threading.Event()
        self._on_fire = on_fire or self._fire

    def arm(self) -> None:
        """Start counting (again calls do nothing)."""
        if self._armed.is_set():
            return
        self._armed.set()
        timer = threading.Timer(self.after_s, self._on_fire)
        timer.daemon = True
        timer.name = "eop-stop-watchdog"
        timer.start()

    def _fire(self) -> None:
        exit_now(EXIT_FORCED, "stop_deadline", deadline_s=self.after_s)
