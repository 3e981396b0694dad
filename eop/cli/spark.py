"""``eop spark backfill`` and ``eop spark stream``: a registered handler run on Spark.

Importing this module does not import PySpark (``eop --help`` stays fast and
works without the ``spark`` extra); the commands do when they run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

from eop import errors as eop_errors
from eop.app import App, select_handlers
from eop.cli import options

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from eop.contrib.spark import jobs, sink
    from eop.handler import HandlerSpec

#: App settings the sink uses in Spark's tasks; the driver's values travel with them.
SINK_FIELDS = (
    "database_url",
    "schema",
    "db_pooler",
    "batch",
    "max_attempts",
    "backoff_base_s",
    "backoff_max_s",
    "lock_timeout_s",
    "statement_timeout_s",
    "tx_retries",
    "log_format",
    "log_level",
)
_FLAG_FIELDS = (
    "database_url",
    "nats_url",
    "schema",
    "db_pooler",
    "batch",
    "max_attempts",
    "lock_timeout_s",
    "statement_timeout_s",
    "tx_retries",
    *options.NATS_AUTH_FIELDS,
)


HELP = "run a handler on Apache Spark: backfills and streams"


def add_commands(sub: options.Subparsers) -> None:
    """Add ``spark`` and its actions to the subparsers of ``eop``."""
    spark = sub.add_parser("spark", help=HELP)
    actions = spark.add_subparsers(title="actions", required=True, metavar="ACTION")
    backfill = actions.add_parser(
        "backfill", help="run a handler over a range of the stream (a batch job), exactly once"
    )
    _common(backfill)
    _env_flag(backfill, "--from-seq", int, "first stream sequence (default: the stream's first)")
    _env_flag(backfill, "--to-seq", int, "last stream sequence (default: the stream's last)")
    backfill.set_defaults(command=_cmd_backfill)

    stream = actions.add_parser(
        "stream", help="run a handler on the stream with Structured Streaming, exactly once"
    )
    _common(stream)
    _env_flag(stream, "--checkpoint", str, "checkpoint directory (any Hadoop path)", required=True)
    _env_flag(stream, "--from-seq", int, "where a new query starts (default: the stream's first)")
    _env_flag(stream, "--max-per-batch", int, "stream sequences per micro-batch (default: all)")
    _env_flag(
        stream,
        "--trigger-s",
        float,
        "seconds between micro-batch starts; 0: back to back, polling the stream all the time",
        default=1.0,
    )
    var = "EOP_SPARK_AVAILABLE_NOW"
    stream.add_argument(
        "--available-now",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get(var, "").lower() in ("1", "true", "yes", "on"),
        help=f"process what the stream holds now, then stop [env: {var}; default: False]",
    )
    stream.set_defaults(command=_cmd_stream)


def _common(parser: argparse.ArgumentParser) -> None:
    from eop.contrib.spark.offsets import DEFAULT_MESSAGES_PER_PARTITION
    from eop.contrib.spark.session import DEFAULT_MASTER

    options.add_log_options(parser, suppress=True)
    parser.add_argument("app", metavar="MODULE:APP", help="the eop.App, e.g. myapp:app")
    _env_flag(parser, "--handler", str, "the handler to run", metavar="NAME", required=True)
    _env_flag(
        parser,
        "--master",
        str,
        f"Spark master URL (default: spark-submit's, else {DEFAULT_MASTER})",
    )
    _env_flag(
        parser,
        "--remote",
        str,
        "a Spark Connect server (sc://host:port) to run the job on, instead of a Spark driver "
        "in this process; its Python workers import eop and the app",
        metavar="URL",
    )
    _env_flag(
        parser,
        "--connect-retry-s",
        float,
        "with --remote: how long a call the Spark Connect server does not answer is retried "
        "before the command fails",
        default=30.0,
    )
    _env_flag(
        parser,
        "--messages-per-partition",
        int,
        "stream sequences per Spark task (and per transaction)",
        default=DEFAULT_MESSAGES_PER_PARTITION,
    )
    _env_flag(
        parser,
        "--python",
        str,
        "the Python that Spark runs for eop, on the driver and every executor (sets "
        "PYSPARK_PYTHON); it needs eop[spark] and, unless shipped, the app",
        metavar="PATH",
    )
    var = "EOP_SPARK_PY_FILES"
    parser.add_argument(
        "--py-files",
        action="append",
        default=[],
        metavar="FILE",
        help="a .py, .zip or .egg file the executors put on their path, such as the app's "
        f"module (repeatable; spark.submit.pyFiles) [env: {var}, comma separated]",
    )
    _env_flag(
        parser,
        "--stall-warn-s",
        float,
        "warn when the job's tasks wait and none has run for this long (no executor)",
        default=60.0,
    )
    _env_flag(
        parser,
        "--stall-timeout-s",
        float,
        "end the job when its tasks wait and none has run for this long (default: never)",
    )
    var = "EOP_SPARK_EXECUTOR_CREDENTIALS"
    parser.add_argument(
        "--executor-credentials",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get(var, "").lower() in ("1", "true", "yes", "on"),
        help="the executors read EOP_DATABASE_URL, EOP_NATS_PASSWORD and EOP_NATS_TOKEN from "
        "their own environment: the job carries the variables' names, not the values "
        f"[env: {var}; default: False]",
    )
    var = "EOP_SPARK_CONF"
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a Spark setting (repeatable) [env: {var}, comma separated]",
    )
    options.add_settings(parser, _FLAG_FIELDS)


def _env_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    kind: type,
    help_text: str,
    *,
    default: object = None,
    required: bool = False,
    metavar: str | None = None,
) -> None:
    """A flag whose default comes from ``EOP_SPARK_<FLAG>``, named in ``--help``."""
    var = "EOP_SPARK_" + flag.lstrip("-").replace("-", "_").upper()
    raw = os.environ.get(var)
    if raw is not None:
        try:
            default = kind(raw)
        except ValueError:
            raise SystemExit(f"eop: error: {var}={raw!r} is not a valid {kind.__name__}") from None
    shown = "" if required or default is None else f"; default: {default}"
    parser.add_argument(
        flag,
        type=kind,
        default=default,
        required=required and default is None,
        metavar=metavar or flag.lstrip("-").upper().replace("-", "_"),
        help=f"{help_text} [env: {var}{shown}]",
    )


def _conf(args: argparse.Namespace, *, remote: bool = False) -> dict[str, str]:
    items = args.conf or options.env_list("EOP_SPARK_CONF")
    conf = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise eop_errors.UsageError(f"--conf takes KEY=VALUE, not {item!r}")
        conf[key.strip()] = value.strip()
    if not remote:
        # The commands print their own progress lines; Spark's bar would garble them.
        conf.setdefault("spark.ui.showConsoleProgress", "false")
    return conf


def py_files(args: argparse.Namespace) -> list[str]:
    """The files ``--py-files`` (or EOP_SPARK_PY_FILES) ships, each checked to exist here."""
    items = [i.strip() for a in args.py_files for i in a.split(",") if i.strip()]
    items = items or options.env_list("EOP_SPARK_PY_FILES")
    for item in items:
        if "://" not in item and not os.path.isfile(item):
            raise eop_errors.ConfigurationError(f"--py-files: {item!r} is not a file")
    return items


def _prepare(args: argparse.Namespace) -> tuple[App, HandlerSpec, sink.Target, jobs.ReadOptions]:
    from eop.contrib.spark import fleet, jobs, sink

    app = options.configured_app(args, _FLAG_FIELDS)
    (spec,) = select_handlers(app, [args.handler])
    s = app.settings
    options.run_with(app, _check_schema(app))
    # Before Spark starts (seconds of JVM), not only at the job's start.
    fleet.check_idle(app, spec)
    env: dict[str, str] = {}
    secret_env: tuple[tuple[str, str], ...] = ()
    if args.executor_credentials:
        env = {"database_url": "EOP_DATABASE_URL"}
        secret_env = tuple(
            (field, f"EOP_NATS_{field.upper()}")
            for field in ("password", "token")
            if getattr(s, f"nats_{field}")
        )
    target = sink.Target.create(
        args.app, spec.name, env=env, **{f: getattr(s, f) for f in SINK_FIELDS}
    )
    read = jobs.ReadOptions(
        nats_url=s.nats_url,
        nats=s.nats_access,
        secret_env=secret_env,
        from_seq=args.from_seq,
        to_seq=getattr(args, "to_seq", None),
        per_partition=args.messages_per_partition,
        max_per_batch=getattr(args, "max_per_batch", None),
    )
    # Again in backfill() and stream(), for callers of the API; here before the JVM starts,
    # so that a refused range costs the command a second, not Spark's start-up.
    jobs.check_range(spec, read)
    return app, spec, target, read


@contextlib.contextmanager
def _session(
    args: argparse.Namespace, name: str, *, streaming: bool = False
) -> Iterator[SparkSession]:
    """The command's SparkSession, stopped after it unless it was running before."""
    from eop.contrib.spark import connect, session

    if args.remote:
        if args.master:
            raise eop_errors.UsageError(
                "--master and --remote exclude each other: a Spark Connect server has its master"
            )
        if streaming and py_files(args):
            # The probe would pass (it runs as a batch job, which sees the session's
            # artifacts) and every micro-batch's tasks would then fail on the import.
            raise eop_errors.UsageError(
                "--py-files does not reach a streaming query's tasks on Spark Connect "
                "(only batch jobs see the session's artifacts): install the app's module "
                "in the Spark Connect server's Python, or run the stream with --master"
            )
        # PySpark warns when its retries run out; the command's own error line says it.
        warnings.filterwarnings("ignore", message=r"\[RETRIES_EXCEEDED\]")
        try:
            spark = session.build(
                remote=args.remote,
                conf=_conf(args, remote=True),
                connect_retry_s=args.connect_retry_s,
            )
        except Exception as exc:
            if connect.lost(exc):
                raise connect.lost_error(args.remote, args.connect_retry_s) from None
            raise
        try:
            session.ship(spark, py_files(args))
            yield spark
        except Exception as exc:
            if not connect.lost(exc):
                spark.stop()
                raise
            # Stopping would retry the dead server once more: let it go.
            connect.abandon(spark)
            raise connect.lost_error(args.remote, args.connect_retry_s) from None
        # The client's session; the server and its Spark go on.
        spark.stop()
        return

    from pyspark import SparkContext

    # Not getActiveSession(): that one is per thread, and a caller's session is not.
    running = SparkContext._active_spark_context
    files = py_files(args)
    if args.python:
        # PySpark reads the variable, not spark.pyspark.python, unless spark-submit started it.
        os.environ["PYSPARK_PYTHON"] = args.python
    spark = session.build(args.master, app_name=name, conf=_conf(args))
    if running is None:
        # Spark's warnings (AQE off in streaming, native Hadoop missing) are not the user's;
        # a stalled job is reported by eop.contrib.spark.watch instead.
        spark.sparkContext.setLogLevel("ERROR")
    session.ship(spark, files)
    try:
        yield spark
    finally:
        if running is None:
            spark.stop()


async def _check_schema(app: App) -> None:
    """Fail before Spark starts, not in every task, when eop's tables are not there."""
    from eop.pg import migrate

    await migrate.ensure_ready(app.engine, app.settings.schema)


@contextlib.contextmanager
def _cancelled_on_signal(spark: SparkSession, what: str) -> Iterator[None]:
    """SIGTERM or SIGINT cancels the block's Spark jobs; the block's error is then JobStopped.

    Its own job and lease code give the lease up on the way out, as for any error: the
    process ending at the signal kept it (an ordered handler's partitions too) until it
    ran out, and SIGINT printed Spark's and Python's tracebacks. The jobs are cancelled
    from a thread of their own, again until the block ends (a job may start after the
    signal): the main thread's py4j connection may be waiting for the JVM's answer. A
    second signal has its default effect.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from eop.contrib.spark import connect
    from eop.contrib.spark.errors import JobStopped

    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.getsignal(sig) for sig in signals}
    signalled: list[int] = []
    ended = threading.Event()

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def cancel() -> None:
        while not ended.is_set():
            with contextlib.suppress(Exception):
                if connect.is_connect(spark):
                    spark.interruptAll()
                else:
                    spark.sparkContext.cancelAllJobs()
            ended.wait(0.5)

    def stop(signum: int, _frame: object) -> None:
        restore()
        signalled.append(signum)
        threading.Thread(target=cancel, name="eop-spark-stop", daemon=True).start()

    for sig in signals:
        signal.signal(sig, stop)
    try:
        yield
    except Exception:
        if not signalled:
            raise
        raise JobStopped(
            f"{what} stopped by {signal.Signals(signalled[0]).name} before it finished: "
            "what its tasks committed stays, and its lease was given up; run it again to finish"
        ) from None
    finally:
        ended.set()
        restore()


def _cmd_backfill(args: argparse.Namespace) -> int:
    from eop.contrib.spark import jobs, watch

    app, spec, target, read = _prepare(args)
    watching = watch.Watch(
        stall_warn_s=args.stall_warn_s, stall_timeout_s=args.stall_timeout_s, out=sys.stderr
    )
    what = f"backfill of {spec.stream} for handler {spec.name}"
    with (
        _session(args, f"eop-backfill-{spec.name}") as spark,
        _cancelled_on_signal(spark, what),
    ):
        counts = jobs.backfill(spark, target, spec, read, watching=watching, app=app)
    print(f"{what}: {counts}")
    return 0


def _cmd_stream(args: argparse.Namespace) -> int:
    from eop.contrib.spark import jobs, watch
    from eop.contrib.spark.apply import Counts

    app, spec, target, read = _prepare(args)
    total = Counts()

    def on_batch(batch_id: int, counts: Counts) -> None:
        nonlocal total
        total = total + counts
        print(f"  batch {batch_id}: {counts}", file=sys.stderr, flush=True)

    # Progress comes from the query's own reports; the watch warns and stops a stalled query
    # (and the probe before it, which a cluster with no free executor would leave waiting).
    watching = watch.Watch(args.stall_warn_s, args.stall_timeout_s, out=sys.stderr, progress=False)
    with _session(args, f"eop-stream-{spec.name}", streaming=True) as spark:
        # Until the query runs (its probe first), a signal ends the start as a backfill's.
        with _cancelled_on_signal(spark, f"the start of the stream of {spec.stream}"):
            query = jobs.stream(
                spark,
                target,
                spec,
                read,
                checkpoint=args.checkpoint,
                trigger_s=args.trigger_s,
                available_now=args.available_now,
                on_batch=on_batch,
                watching=watching,
                app=app,
            )
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
        with watch.watched(spark, f"stream of {spec.stream} for {spec.name}", watching, query.stop):
            jobs.wait(query, report=sys.stderr, stop=stop)
    print(f"stream of {spec.stream} for handler {spec.name} stopped: {total}")
    return 0
