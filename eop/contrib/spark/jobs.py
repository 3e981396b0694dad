"""What ``eop spark backfill`` and ``eop spark stream`` run, usable from Python too.

Both read the handler's stream and subject with the ``jetstream`` source and
write the rows to the exactly-once sink, the ``eop`` data source
(:mod:`eop.contrib.spark.sink`): on classic Spark and on Spark Connect alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any

from eop import errors as eop_errors
from eop import nats_access
from eop.contrib.spark import (
    connect,
    errors,
    failures,
    fleet,
    lease,
    probe,
    reader,
    report,
    sink,
    watch,
)
from eop.contrib.spark.apply import Counts
from eop.handler import HandlerSpec, parse_order_by

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

    from eop.app import App


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How the handler's stream is read."""

    nats_url: str
    from_seq: int | None = None
    to_seq: int | None = None
    """Inclusive; batch only."""
    per_partition: int | None = None
    max_per_batch: int | None = None
    """Streaming only."""
    nats: nats_access.NatsAccess | None = None
    """Authentication and TLS (``nats_url`` wins over its ``url``)."""
    secret_env: tuple[tuple[str, str], ...] = ()
    """NATS secrets (``password``, ``token``) each process reads from the named variable
    instead: the options and the partitions carry the name, not the value."""

    def access(self) -> nats_access.NatsAccess:
        """How this process reaches NATS (``nats_url`` over the access's own URL)."""
        if self.nats is None:
            return nats_access.NatsAccess(url=self.nats_url)
        return dataclasses.replace(self.nats, url=self.nats_url)

    def options(self, spec: HandlerSpec) -> dict[str, str]:
        """The ``jetstream`` source options for ``spec``'s stream and subject (as stored:
        :func:`stored_subject`)."""
        opts = {
            "stream": spec.stream,
            "subject": stored_subject(spec),
            "natsUrl": self.nats_url,
            "startSequence": self.from_seq,
            "endSequence": self.to_seq,
            "messagesPerPartition": self.per_partition,
            "maxMessagesPerBatch": self.max_per_batch,
        }
        nats = self.nats
        if nats is not None and self.secret_env:
            blank: dict[str, Any] = {field: "" for field, _ in self.secret_env}
            nats = dataclasses.replace(nats, **blank)
        auth = nats.spark_options() if nats is not None else {}
        for field, var in self.secret_env:
            auth[f"nats{field.capitalize()}Env"] = var
        return {**auth, **{k: str(v) for k, v in opts.items() if v is not None}}


def stored_subject(spec: HandlerSpec) -> str:
    """The filter of ``spec``'s messages as the stream stores them.

    With ``partitions`` > 1 the stream puts each message's partition in front
    of its subject (:mod:`eop.ordering.partitions`): ``3.ledger.acc1.step`` for
    ``ledger.acc1.step``. The sink takes that token off again
    (:func:`eop.contrib.spark.sink.messages_from_rows`), as the workers do.
    """
    return f"*.{spec.subject}" if spec.partitions > 1 else spec.subject


def check_range(spec: HandlerSpec, read: ReadOptions) -> None:
    """Refuse a range that starts inside the stream for a handler with ``order_by``.

    Messages below ``from_seq`` without an outcome would run after the job's,
    later messages of their keys: each key's order holds only for a run from
    the stream's start. (The inbox skips what is done; a range that ends early,
    ``to_seq``, keeps the order.)
    """
    if spec.order_by is not None and read.from_seq is not None and read.from_seq > 1:
        raise eop_errors.ConfigurationError(
            f"handler {spec.name!r} keeps its keys in order: a job starting at --from-seq "
            f"{read.from_seq} would run a key's later messages before its earlier ones "
            "that have no outcome yet; run it from the stream's start (what is done is "
            "skipped), --to-seq to stop early"
        )


def ordered(df: DataFrame, spec: HandlerSpec) -> DataFrame:
    """For handlers with ``order_by``: a key's messages in one partition.

    Partitions run in parallel, so sequence ranges would let a key's later
    message commit before its earlier one in another range. The sink runs
    each partition's messages in stream order (:class:`eop.contrib.spark.sink.PartitionFunction`).
    ``df``'s subjects are as stored: with ``partitions`` > 1 the key's token
    comes after the partition's.
    """
    if spec.order_by is None:
        return df
    from pyspark.sql import functions as F

    kind, arg = parse_order_by(spec.order_by)
    if kind == "subject":
        # try_element_at counts from 1; a partition token shifts the key by one more.
        index = int(arg) + 1 + (1 if spec.partitions > 1 else 0)
        key = F.try_element_at(F.split("subject", r"\."), F.lit(index))
    else:
        key = F.try_element_at(F.col("headers"), F.lit(arg))
    if df.isStreaming or connect.is_connect(df.sparkSession):
        # No RDD on Spark Connect, none before a micro-batch: spark.sql.shuffle.partitions.
        return df.repartition(key)
    return df.repartition(max(df.rdd.getNumPartitions(), 1), key)


def backfill(
    spark: SparkSession,
    target: sink.Target,
    spec: HandlerSpec,
    read: ReadOptions,
    *,
    progress: IO[str] | None = None,
    watching: watch.Watch | None = None,
    check: bool = True,
    app: App | None = None,
) -> Counts:
    """Run the handler over the stream's sequences ``[from_seq, to_seq]`` (a batch job).

    ``check`` first probes the executors (:mod:`eop.contrib.spark.probe`); ``watching``
    says when a job that no executor takes is warned about or ended
    (``progress`` is the shorthand for its ``out``); ``app`` is where the
    counts are read (default: the target's, imported here). An ordered
    handler's job refuses to start while workers run it (:mod:`eop.contrib.spark.fleet`).
    """
    home = app or sink.caller_app(target)
    check_range(spec, read)
    fleet.check_idle(home, spec)
    watching = watching or watch.Watch(out=progress)
    what = f"backfill of {spec.stream} for {spec.name}"
    with (
        lease.held(home, spec) as held,
        translated(target.app),
        watch.watched(spark, what, watching),
    ):
        target = dataclasses.replace(target, lease=held.member)
        held.prepare_lane(reader.state_once(read.access(), spec.stream).epoch)
        if check:
            probe.check(spark, target.app, _executor_env(target, read))
        df = spark.read.format("jetstream").options(**read.options(spec)).load()
        df = ordered(df, spec)
        return sink.apply(df, target, app=app)


def _probe_watched(
    spark: SparkSession,
    target: sink.Target,
    spec: HandlerSpec,
    read: ReadOptions,
    watching: watch.Watch,
) -> None:
    env = _executor_env(target, read)
    if connect.is_connect(spark):
        # No status tracker to watch with; the query's own watch says so once.
        probe.check(spark, target.app, env)
        return
    what = f"stream of {spec.stream} for {spec.name}"
    with watch.watched(spark, what, dataclasses.replace(watching, progress=False)):
        probe.check(spark, target.app, env)


def stream(
    spark: SparkSession,
    target: sink.Target,
    spec: HandlerSpec,
    read: ReadOptions,
    *,
    checkpoint: str,
    trigger_s: float | None = None,
    available_now: bool = False,
    on_batch: Callable[[int, Counts], None] | None = None,
    check: bool = True,
    watching: watch.Watch | None = None,
    app: App | None = None,
) -> StreamingQuery:
    """Start the Structured Streaming query; its offsets and progress live in ``checkpoint``.

    ``check`` first probes the executors (:mod:`eop.contrib.spark.probe`), under
    ``watching`` (default: the warning logged): a probe no executor takes is
    warned about and ended like a backfill's job, not waited on in silence.
    ``on_batch`` gets each micro-batch's counts once its commit left them
    (read from ``app``'s database, by default the target's, in a thread of
    this process): :func:`wait` returns after the last, and they live in
    PostgreSQL under the checkpoint's id until read (:func:`report_id_of`).
    An ordered handler's query refuses to start while workers run it
    (:mod:`eop.contrib.spark.fleet`). The query's lease (:mod:`eop.contrib.spark.lease`) is
    renewed by this process until :func:`wait` returns: call it.
    """
    home = app or sink.caller_app(target)
    check_range(spec, read)
    fleet.check_idle(home, spec)
    report_id = report_id_of(spec, checkpoint) if on_batch is not None else None
    held = lease.JobLease(home, spec)
    held.take()
    held.start()
    target = dataclasses.replace(target, lease=held.member)
    try:
        with translated(target.app):
            held.prepare_lane(reader.state_once(read.access(), spec.stream).epoch)
        query = _start(
            spark,
            target,
            spec,
            read,
            checkpoint=checkpoint,
            trigger_s=trigger_s,
            available_now=available_now,
            check=check,
            watching=watching,
            report_id=report_id,
        )
    except BaseException:
        held.finish()
        raise
    _LEASES[query.id] = held
    if on_batch is not None and report_id is not None:
        poller = report.Poller(home, report_id, on_batch, lambda: query.isActive)
        _POLLERS[query.id] = poller.start()
    return query


def _start(
    spark: SparkSession,
    target: sink.Target,
    spec: HandlerSpec,
    read: ReadOptions,
    *,
    checkpoint: str,
    trigger_s: float | None,
    available_now: bool,
    check: bool,
    watching: watch.Watch | None,
    report_id: str | None,
) -> StreamingQuery:
    with translated(target.app):
        if check:
            _probe_watched(spark, target, spec, read, watching or watch.Watch())
        df = spark.readStream.format("jetstream").options(**read.options(spec)).load()
        writer = (
            ordered(df, spec)
            .writeStream.format(sink.NAME)
            .options(**target.options(report_id))
            .option("checkpointLocation", checkpoint)
            .queryName(f"eop-{spec.name}")
        )
        if available_now:
            writer = writer.trigger(availableNow=True)
        elif trigger_s:
            writer = writer.trigger(processingTime=f"{round(trigger_s * 1000)} milliseconds")
        connect.activate(spark)
        return writer.start()


# Each started query's poller, for wait() to see its last batches reported.
_POLLERS: dict[str, report.Poller] = {}
# Each started query's lease, for wait() to give up once the query ended.
_LEASES: dict[str, lease.JobLease] = {}


def report_id_of(spec: HandlerSpec, checkpoint: str) -> str:
    """The id a stream's micro-batch counts are left under: the same for every run on one
    checkpoint, so a run reports the batches an earlier run committed but never read
    (its process died)."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"eop-stream:{spec.name}:{checkpoint}").hex


def _executor_env(target: sink.Target, read: ReadOptions) -> list[str]:
    """The variables the executors read credentials from, which the probe checks."""
    return sorted({*target.env.values(), *(var for _, var in read.secret_env)})


def wait(
    query: StreamingQuery,
    *,
    report: IO[str] | None = None,
    stop: threading.Event | None = None,
    every_s: float = 5.0,
) -> None:
    """Wait for the query to end (an error, AvailableNow's end, or ``stop``), with progress.

    Stopping the query ends it between micro-batches or rolls the running one
    back; either way the next start continues from the checkpoint.
    """
    last_id: Any = None
    next_report = time.monotonic() + every_s
    ended = False
    try:
        with translated():
            while not query.awaitTermination(1):
                if stop is not None and stop.is_set():
                    query.stop()
                    break
                progress = query.lastProgress
                if report and progress and time.monotonic() >= next_report:
                    next_report = time.monotonic() + every_s
                    if progress.get("batchId") != last_id:
                        last_id = progress.get("batchId")
                        print(_describe_progress(progress), file=report, flush=True)
            ended = True
            # awaitTermination raises the query's failure only when asked without a timeout.
            query.awaitTermination()
    finally:
        _finish(query.id, ended)


def _finish(query_id: str, ended: bool) -> None:
    """The query's poller and lease, ended: after its last report once it ended; at once if
    waiting failed (its server lost: the reports stay for the next run on its checkpoint)."""
    poller = _POLLERS.pop(query_id, None)
    if poller is not None:
        poller.finish(timeout_s=30.0 if ended else 1.0)
    held = _LEASES.pop(query_id, None)
    if held is not None:
        # Given up: a query that runs on without this process commits no more.
        held.finish()


def _describe_progress(progress: dict[str, Any]) -> str:
    source = (progress.get("sources") or [{}])[0]
    done = _seq(source.get("endOffset"))
    latest = _seq(source.get("latestOffset"))
    rate = source.get("processedRowsPerSecond") or 0.0
    lag = f", {latest - done} behind" if done is not None and latest is not None else ""
    return f"  at sequence {done}{lag} ({rate:,.0f} rows/s in the last batch)"


def _seq(offset: Any) -> int | None:
    if isinstance(offset, str):
        with contextlib.suppress(ValueError):
            offset = json.loads(offset)
    return int(offset["seq"]) - 1 if isinstance(offset, dict) and "seq" in offset else None


@contextlib.contextmanager
def translated(app: str | None = None) -> Iterator[None]:
    """Spark's errors as :class:`SparkJobFailed`: their root cause, and the fix if eop knows it.

    ``app`` (``module:attribute``) lets a missing app module be told apart
    from a missing eop.
    """
    try:
        yield
    except eop_errors.EopError:
        raise
    except Exception as exc:
        if not _from_spark(exc) or connect.lost(exc):
            # A lost Connect server is told by its session's owner, who knows its URL.
            raise
        text = str(exc)
        fix = failures.hint(text, app.partition(":")[0] if app else None)
        line = failures.summary(exc)
        raise errors.SparkJobFailed(f"{line}: {fix}" if fix else line) from None


def _from_spark(exc: BaseException) -> bool:
    module = type(exc).__module__
    return module.startswith(("pyspark", "py4j"))
