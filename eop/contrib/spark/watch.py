"""Watching a running Spark job: progress lines, a warning when no task runs, a timeout.

With the cluster's only worker gone, a job waits for executors for ever and
Spark says nothing that eop lets through. :func:`watched` reports the job's
task counts, warns when tasks are pending and none has run for
``stall_warn_s``, and after ``stall_timeout_s`` (if set) cancels the job,
which then fails with :class:`~eop.contrib.spark.errors.JobStalled`.

Task counts come from the SparkContext's status tracker, which Spark Connect
does not offer: on a Connect session the watch is off, and says so once (a
stream's progress still comes from its query's reports, :func:`eop.contrib.spark.jobs.wait`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING

from eop import log
from eop.contrib.spark import connect, errors

if TYPE_CHECKING:
    from pyspark import StatusTracker
    from pyspark.sql import SparkSession

POLL_S = 2.0


@dataclasses.dataclass(frozen=True)
class Watch:
    """How a job is watched."""

    stall_warn_s: float = 60.0
    """Warn when tasks wait and none has run for this long."""
    stall_timeout_s: float | None = None
    """Cancel the job when tasks wait and none has run for this long (None: never)."""
    out: IO[str] | None = None
    """Where progress lines and the warning go (None: the warning is logged)."""
    progress: bool = True
    """Print the task counts to ``out`` as they change (a stream reports its own progress)."""


@dataclasses.dataclass
class _Counts:
    done: int = 0
    total: int = 0
    running: int = 0


@contextlib.contextmanager
def watched(
    spark: SparkSession,
    what: str,
    watch: Watch,
    end_job: Callable[[], None] | None = None,
) -> Iterator[None]:
    """Run the block's Spark jobs under ``watch``; a job ended for stalling raises JobStalled.

    ``end_job`` ends the work at the stall timeout (a streaming query's
    ``stop``); by default the jobs this thread starts are cancelled.
    """
    tracker = _tracker(spark)
    if tracker is None:
        _unwatched(what, watch)
        yield
        return
    tag = f"eop-{uuid.uuid4().hex[:12]}"
    # The SparkContext's job tags: a classic session's interruptTag cancels no job.
    spark.sparkContext.addJobTag(tag)
    stall = _Stall(what, watch, end_job or (lambda: spark.sparkContext.cancelJobsWithTag(tag)))
    stop = threading.Event()
    thread = threading.Thread(
        target=stall.run, args=(tracker, stop), name="eop-spark-watch", daemon=True
    )
    thread.start()
    try:
        yield
    except Exception:
        if stall.ended.is_set():
            raise stall.error() from None
        raise
    finally:
        stop.set()
        thread.join(timeout=5)
        spark.sparkContext.removeJobTag(tag)
    if stall.ended.is_set():
        raise stall.error()


def _unwatched(what: str, watch: Watch) -> None:
    text = (
        f"{what}: no stall watch: this session has no status tracker (Spark Connect), "
        "so a job that no executor takes is neither reported nor ended"
    )
    if watch.out is not None:
        print(f"eop: note: {text}", file=watch.out, flush=True)
    else:
        log.get_logger().info(log.Event.SPARK_UNWATCHED, what=what)


def _tracker(spark: SparkSession) -> StatusTracker | None:
    if connect.is_connect(spark):
        return None  # no SparkContext, so no status tracker: the job runs unwatched
    return spark.sparkContext.statusTracker()


class _Stall:
    """The watching thread: the last task counts, since when, and whether it ended the job."""

    def __init__(self, what: str, watch: Watch, end_job: Callable[[], None]) -> None:
        self.what = what
        self.watch = watch
        self.end_job = end_job
        self.ended = threading.Event()

    def error(self) -> errors.JobStalled:
        """What the job's caller gets when the stall timeout ended it."""
        return errors.JobStalled(
            f"{self.what}: no task ran for {self.watch.stall_timeout_s:g} s "
            "(stall timeout): the cluster has no executor free for the job"
        )

    def run(self, tracker: StatusTracker, stop: threading.Event, poll_s: float = POLL_S) -> None:
        """Poll ``tracker`` until ``stop``: progress lines, the warning, the timeout."""
        started = last_change = time.monotonic()
        last: _Counts | None = None
        warned = False
        while not stop.wait(poll_s):
            now = time.monotonic()
            counts = _counts(tracker)
            if counts != last or counts.running or not counts.total:
                out = self.watch.out
                if out is not None and self.watch.progress and counts.total and counts != last:
                    line = f"  {self.what}: {counts.done}/{counts.total} partitions done"
                    print(f"{line}, {counts.running} running ({now - started:.0f} s)", file=out)
                    out.flush()
                last, last_change, warned = counts, now, False
                continue
            idle = now - last_change
            if not warned and idle >= self.watch.stall_warn_s:
                warned = True
                _warn(self.what, idle, self.watch)
            timeout = self.watch.stall_timeout_s
            if timeout is not None and idle >= timeout:
                self.ended.set()
                self.end_job()
                return


def _counts(tracker: StatusTracker) -> _Counts:
    counts = _Counts()
    for stage_id in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage_id)
        if info is not None:
            counts.done += info.numCompletedTasks
            counts.total += info.numTasks
            counts.running += info.numActiveTasks
    return counts


def _warn(what: str, idle: float, watch: Watch) -> None:
    text = (
        f"{what}: tasks are waiting and none has run for {idle:.0f} s: "
        "does the cluster have a live worker with free cores and memory for this job?"
    )
    if watch.stall_timeout_s is not None:
        text += f" (the job ends after {watch.stall_timeout_s:g} s of this)"
    if watch.out is not None:
        print(f"eop: warning: {text}", file=watch.out, flush=True)
    else:
        log.get_logger().warning(log.Event.SPARK_JOB_STALLED, what=what, idle_s=round(idle))
