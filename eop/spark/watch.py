"""Watching a running Spark job: progress lines, a warning when no task runs, a timeout.

With the cluster's only worker gone, a job waits for executors for ever and
Spark says nothing that eop lets through. :func:`watched` reports the job's
task counts, warns when tasks are pending and none has run for
``stall_warn_s``, and after ``stall_timeout_s`` (if set) cancels the job,
which then fails with :class:`~eop.spark.errors.JobStalled`.

Task counts come from the SparkContext's status tracker, which Spark Connect
does not offer: on a Connect session the job runs unwatched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING

from eop import log
from eop.spark import errors

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


@dataclasses.dataclass
class _Counts:
    done: int = 0
    total: int = 0
    running: int = 0


@contextlib.contextmanager
def watched(spark: SparkSession, what: str, watch: Watch) -> Iterator[None]:
    """Run the block's Spark jobs under ``watch``; a stalled, cancelled job raises JobStalled."""
    tracker = _tracker(spark)
    if tracker is None:
        yield
        return
    tag = f"eop-{uuid.uuid4().hex[:12]}"
    # The SparkContext's job tags: a classic session's interruptTag cancels no job.
    spark.sparkContext.addJobTag(tag)
    stop = threading.Event()
    cancelled = threading.Event()
    thread = threading.Thread(
        target=_watch,
        args=(spark, tracker, what, watch, stop, cancelled, tag),
        name="eop-spark-watch",
        daemon=True,
    )
    thread.start()
    try:
        yield
    except Exception:
        if cancelled.is_set():
            raise errors.JobStalled(
                f"{what}: no task ran for {watch.stall_timeout_s:g} s "
                "(stall timeout): the cluster has no executor free for the job"
            ) from None
        raise
    finally:
        stop.set()
        thread.join(timeout=5)
        spark.sparkContext.removeJobTag(tag)


def _tracker(spark: SparkSession) -> StatusTracker | None:
    try:
        return spark.sparkContext.statusTracker()
    except Exception:
        return None


def _watch(
    spark: SparkSession,
    tracker: StatusTracker,
    what: str,
    watch: Watch,
    stop: threading.Event,
    cancelled: threading.Event,
    tag: str,
) -> None:
    started = last_change = time.monotonic()
    last: _Counts | None = None
    warned = False
    while not stop.wait(POLL_S):
        now = time.monotonic()
        counts = _counts(tracker)
        if counts != last or counts.running or not counts.total:
            if watch.out is not None and counts.total and counts != last:
                line = f"  {what}: {counts.done}/{counts.total} partitions done"
                print(f"{line}, {counts.running} running ({now - started:.0f} s)", file=watch.out)
                watch.out.flush()
            last, last_change, warned = counts, now, False
            continue
        idle = now - last_change
        if not warned and idle >= watch.stall_warn_s:
            warned = True
            _warn(what, idle, watch)
        if watch.stall_timeout_s is not None and idle >= watch.stall_timeout_s:
            cancelled.set()
            spark.sparkContext.cancelJobsWithTag(tag)
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
