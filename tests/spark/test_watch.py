"""The stall watch's rule, on a fake status tracker (no Spark): warn, then end the job.

The real thing, on a master without workers, is in test_cluster.py.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from typing import Any

from eop.contrib.spark import watch

POLL_S = 0.01


@dataclass
class Stage:
    """What pyspark's StatusTracker.getStageInfo gives, as far as the watch reads it."""

    numTasks: int
    numCompletedTasks: int
    numActiveTasks: int


class Tracker:
    """A stage whose counts the test sets."""

    def __init__(self, stage: Stage | None) -> None:
        self.stage = stage

    def getActiveStageIds(self) -> list[int]:
        return [] if self.stage is None else [1]

    def getStageInfo(self, stage_id: int) -> Stage | None:
        return self.stage


def run(tracker: Tracker, settings: watch.Watch, until: float = 5.0) -> tuple[bool, str]:
    """Run the watch on ``tracker`` until it ends the job or ``until`` s pass."""
    ended = threading.Event()
    stall = watch._Stall("backfill of ORDERS for h", settings, ended.set)
    stop = threading.Event()
    thread = threading.Thread(target=stall.run, args=(tracker, stop, POLL_S))
    thread.start()
    ended.wait(until)
    stop.set()
    thread.join()
    out: Any = settings.out
    return stall.ended.is_set(), out.getvalue() if out is not None else ""


def test_tasks_waiting_with_none_running_warn_then_end_the_job() -> None:
    """4/20 done, 0 running, no change: the warning, then the end at the stall timeout."""
    out = io.StringIO()
    settings = watch.Watch(stall_warn_s=0.05, stall_timeout_s=0.2, out=out)
    ended, text = run(Tracker(Stage(20, 4, 0)), settings)
    assert ended
    assert "4/20 partitions done, 0 running" in text
    assert "eop: warning: backfill of ORDERS for h: tasks are waiting and none has run" in text
    assert "no task ran for 0.2 s (stall timeout)" in str(
        watch._Stall("x", settings, print).error()
    )


def test_running_tasks_or_no_stage_never_count_as_a_stall() -> None:
    """A long task that runs, or a stream between micro-batches: no warning, no end."""
    for stage in (Stage(20, 4, 2), None):
        out = io.StringIO()
        settings = watch.Watch(stall_warn_s=0.02, stall_timeout_s=0.05, out=out)
        ended, text = run(Tracker(stage), settings, until=0.5)
        assert not ended
        assert "warning" not in text


def test_without_a_timeout_the_watch_only_warns() -> None:
    """The default: the warning once, and the job left to run."""
    out = io.StringIO()
    settings = watch.Watch(stall_warn_s=0.02, out=out, progress=False)
    ended, text = run(Tracker(Stage(20, 4, 0)), settings, until=0.5)
    assert not ended
    assert text.count("eop: warning:") == 1
    assert "partitions done" not in text
