"""The exactly-once sink: the ``eop`` data source, whose writer runs a registered eop handler.

    counts = sink.apply(df, sink.Target.create("myapp:app", "billing"))    # batch
    (df.writeStream.format("eop").options(**target.options())              # streaming
       .option("checkpointLocation", "/data/eop/billing").start())

A PySpark Python data source writer (batch and Structured Streaming), so the
same sink runs on classic Spark and on Spark Connect. Each partition of
``df`` (rows of the ``jetstream`` source, unchanged) runs in one transaction
through :class:`eop.contrib.spark.apply.Partition`, so retried, speculative and
replayed tasks are no-ops for what already committed. Each task's
:class:`~eop.contrib.spark.apply.Counts` travel back in its commit message; the
commit, which Spark runs in a process of its own, leaves their sum for the
caller (:mod:`eop.contrib.spark.report`). The app is imported by its
``module:attribute`` path in each Python worker (the module must be
importable there: installed, on ``PYTHONPATH``, or shipped with
``--py-files``), once per process.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamWriter,
    DataSourceWriter,
    WriterCommitMessage,
)

from eop import errors, log, message, wire
from eop.contrib.spark import connect, report
from eop.contrib.spark.apply import Counts, Partition

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row
    from pyspark.sql.types import StructType

    from eop.app import App

#: Columns the sink reads; the ``jetstream`` source provides them.
REQUIRED_COLUMNS = ("stream", "epoch", "seq", "subject", "headers", "data")


@dataclasses.dataclass(frozen=True)
class Target:
    """Which handler of which app the sink runs, and the settings it overrides there.

    ``settings`` (for example ``database_url``) travel with the tasks and
    override the app's, which otherwise come from the executors' ``EOP_*``
    environment variables. ``env`` names, per setting, the environment
    variable an executor reads it from: the name travels, not the value (a
    database URL with its password stays on the executors' side).
    """

    app: str
    handler: str
    settings_json: str = "{}"
    env_json: str = "{}"
    lease: str = ""
    """The member name of the job's lease, which each task checks (:mod:`eop.contrib.spark.lease`);
    empty: no check (a DataFrame written to the sink by the caller's own code)."""

    @classmethod
    def create(
        cls, app: str, handler: str, *, env: dict[str, str] | None = None, **settings: object
    ) -> Target:
        """A target; ``settings`` with None values, or named in ``env``, are left out."""
        env = env or {}
        kept = {k: v for k, v in settings.items() if v is not None and k not in env}
        return cls(app, handler, json.dumps(kept, sort_keys=True), json.dumps(env, sort_keys=True))

    def __repr__(self) -> str:
        # Tracebacks and logs may print it: not the database password.
        return f"Target({self.app!r}, {self.handler!r}, <{len(self.settings)} settings>)"

    @property
    def env(self) -> dict[str, str]:
        """Setting name to the environment variable the executors read it from."""
        names: dict[str, str] = json.loads(self.env_json)
        return names

    def resolved_settings(self) -> dict[str, Any]:
        """The settings overrides, those named by ``env`` read from this process's environment."""
        overrides = self.settings
        for field, var in self.env.items():
            value = os.environ.get(var)
            if value is None:
                raise errors.ConfigurationError(
                    f"the Spark sink reads {field} from {var}, which is not set on this executor"
                )
            overrides[field] = value
        return overrides

    @property
    def settings(self) -> dict[str, Any]:
        """The settings overrides."""
        overrides: dict[str, Any] = json.loads(self.settings_json)
        return overrides

    def options(self, report_id: str | None = None) -> dict[str, str]:
        """The ``eop`` data source's options for this target (and the caller's report id).

        The settings go in ``secretSettings``: Spark redacts the values of
        options whose names say "secret" where it shows them (plans, the UI).
        """
        opts = {"app": self.app, "handler": self.handler, "secretSettings": self.settings_json}
        opts["env"] = self.env_json
        if self.lease:
            opts["lease"] = self.lease
        if report_id is not None:
            opts["reportId"] = report_id
        return opts

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> Target:
        """The target that :meth:`options` described (Spark lowercases option names)."""
        opts = {k.lower(): v for k, v in options.items()}
        missing = [name for name in ("app", "handler") if not opts.get(name)]
        if missing:
            raise errors.ConfigurationError(
                f"the eop data source needs the options {missing} "
                "(see eop.contrib.spark.sink.Target)"
            )
        settings = opts.get("secretsettings", "{}")
        env = opts.get("env", "{}")
        return cls(opts["app"], opts["handler"], settings, env, opts.get("lease", ""))


def apply(df: DataFrame, target: Target, *, app: App | None = None) -> Counts:
    """Run the target's handler over every row of ``df``; the outcomes, summed.

    ``df.write.format("eop")`` (the session needs :func:`eop.contrib.spark.session.register`),
    then the counts its commit left. ``app`` is where they are read: an app on
    the database the sink writes to (default: the target's, imported here).
    """
    check_columns(df.columns)
    report_id = uuid.uuid4().hex
    connect.activate(df.sparkSession)
    df.write.format(NAME).options(**target.options(report_id)).mode("append").save()
    reports = report.take(app or caller_app(target), report_id)
    if report.BATCH_JOB not in reports:
        raise errors.EopError("the eop sink's commit left no counts (see eop.contrib.spark.report)")
    return reports[report.BATCH_JOB]


def check_columns(columns: Sequence[str]) -> None:
    """ConfigurationError unless ``columns`` hold those of the jetstream source the sink reads."""
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise errors.ConfigurationError(
            f"the DataFrame lacks the columns {missing} of the jetstream source"
        )


NAME = "eop"
"""The data source's format name."""


class EopDataSource(DataSource):
    """``format("eop")``: the exactly-once sink, for batch writes and streaming queries.

    Options: those of :meth:`Target.options`; ``reportId`` (optional) names
    the report the commit leaves (:mod:`eop.contrib.spark.report`). Only ``append``:
    the sink adds outcomes, it never replaces anything.
    """

    @classmethod
    def name(cls) -> str:
        """The format name."""
        return NAME

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        """A batch write (``df.write.format("eop")...save()``)."""
        return EopWriter(*self._parsed(schema, overwrite))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        """A streaming sink (``df.writeStream.format("eop")...start()``)."""
        return EopStreamWriter(*self._parsed(schema, overwrite))

    def _parsed(self, schema: StructType, overwrite: bool) -> tuple[Target, str | None]:
        if overwrite:
            raise errors.ConfigurationError("the eop sink only appends: use mode('append')")
        check_columns(schema.fieldNames())
        opts = {k.lower(): v for k, v in self.options.items()}
        return Target.from_options(self.options), opts.get("reportid") or None


@dataclasses.dataclass(frozen=True)
class CountsMessage(WriterCommitMessage):
    """A task's commit message: its partition's outcome counts."""

    counts: dict[str, int]


def _total(messages: Iterable[WriterCommitMessage | None]) -> Counts:
    total = Counts()
    for msg in messages:
        if isinstance(msg, CountsMessage):
            total = total + Counts(**msg.counts)
    return total


class EopWriter(DataSourceWriter):
    """The batch writer: a partition per task, the counts left for the caller at commit."""

    def __init__(self, target: Target, report_id: str | None) -> None:
        self.target = target
        self.report_id = report_id

    def write(self, iterator: Iterator[Row]) -> WriterCommitMessage:
        """One partition in one transaction (in a Spark task)."""
        return CountsMessage(PartitionFunction(self.target).run(iterator).as_dict())

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """All tasks succeeded: the summed counts for the caller (on the driver's side)."""
        if self.report_id is not None:
            report.leave(
                caller_app(self.target), self.report_id, report.BATCH_JOB, _total(messages)
            )

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Nothing to undo: each partition committed whole or not at all, and a rerun skips it."""


class EopStreamWriter(DataSourceStreamWriter):
    """The streaming writer: a micro-batch's partitions, its counts left at its commit.

    Spark writes a micro-batch again after a restart if it had not committed
    it: the rows are found in the inbox and skipped.
    """

    def __init__(self, target: Target, report_id: str | None) -> None:
        self.target = target
        self.report_id = report_id

    def write(self, iterator: Iterator[Row]) -> WriterCommitMessage:
        """One partition of the micro-batch in one transaction (in a Spark task)."""
        return CountsMessage(PartitionFunction(self.target).run(iterator).as_dict())

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """The micro-batch's summed counts for the caller (on the driver's side)."""
        if self.report_id is not None:
            report.leave(caller_app(self.target), self.report_id, batchId, _total(messages))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to undo: Spark runs the micro-batch again, and the inbox skips what is done."""


class PartitionFunction:
    """One partition's rows in, their :class:`Counts` out (also a ``mapPartitions`` function)."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def run(self, rows: Iterable[Row]) -> Counts:
        """The partition, in one transaction, in stream order.

        Sorted here: a streaming query may not sort, and a partition of an
        ``order_by`` handler's (rows repartitioned by key) comes unsorted.
        """
        partition = partition_for(self.target)
        spec = partition.spec
        rows = list(rows)
        messages = sorted(
            messages_from_rows(rows, spec.name, spec.partitions),
            key=lambda m: (m.stream_epoch, m.seq),
        )
        # Rows without a partition token: no worker's consumer would deliver them.
        skipped = Counts(skipped=len(rows) - len(messages))
        # A shuffle leaves partitions empty: no transaction for them.
        return skipped + partition.run(messages) if messages else skipped

    def __call__(self, rows: Iterable[Row]) -> Iterator[Counts]:
        yield self.run(rows)


def messages_from_rows(
    rows: Iterable[Row], subscription: str, partitions: int = 1
) -> Iterator[message.Message]:
    """The messages of ``jetstream`` rows, as the handler sees them.

    Built as :func:`eop.message.from_nats` builds a worker's, so that a
    message's fingerprint is the same whoever processes it. With
    ``partitions`` > 1 the stream stored each subject behind its partition's
    number (``3.ledger.acc1.step``): the handler and the fingerprint get the
    subject as published (``ledger.acc1.step``), as the workers' fetches
    strip it (:mod:`eop.ordering.share`), and a row without such a token,
    which no partition's consumer would deliver, is left out.
    """
    for row in rows:
        fields = row.asDict()
        subject = fields["subject"]
        if partitions > 1:
            token, _, subject = subject.partition(".")
            if not _partition_token(token, partitions):
                continue
        stamp = fields.get("timestamp")
        if isinstance(stamp, datetime.datetime) and stamp.tzinfo is None:
            # PySpark hands timestamps over in the worker's local time, without a zone.
            stamp = stamp.astimezone(datetime.timezone.utc)
        headers = {str(k): str(v) for k, v in (fields["headers"] or {}).items()}
        if any(_unstorable(k) or _unstorable(v) for k, v in headers.items()):
            headers = {wire.storable(k): wire.storable(v) for k, v in headers.items()}
        yield message.Message(
            subscription=subscription,
            subject=wire.storable(subject),
            # BinaryType arrives as a bytearray; the fingerprint hashes bytes alike.
            data=bytes(fields["data"] or b""),
            headers=headers,
            stream=fields["stream"],
            stream_epoch=fields["epoch"],
            seq=int(fields["seq"]),
            num_delivered=1,
            timestamp=stamp,
        )


def _partition_token(token: str, partitions: int) -> bool:
    """Whether ``token`` is a partition's number as the stream's transform writes it."""
    return token.isdecimal() and str(int(token)) == token and int(token) < partitions


def _unstorable(text: str) -> bool:
    # As eop.message.from_nats decides it: NUL, or bytes that were not UTF-8.
    return "\x00" in text or wire.escaped(text)


_PARTITIONS: dict[Target, Partition] = {}


def partition_for(target: Target) -> Partition:
    """The process's :class:`Partition` for ``target`` (the app imported once).

    Python workers are reused across tasks and queries; a different target
    (another database, in tests) replaces the cached one and its pools.
    """
    found = _PARTITIONS.get(target)
    if found is not None:
        return found
    from eop.app import App, select_handlers

    app = App.from_path(target.app).with_settings(**target.resolved_settings())
    (spec,) = select_handlers(app, [target.handler])
    for old in _PARTITIONS.values():
        old.close()
    _PARTITIONS.clear()
    log.configure(app.settings.log_format, app.settings.log_level)
    found = _PARTITIONS[target] = Partition(app, spec, lease=target.lease or None)
    return found


_APPS: dict[Target, App] = {}


def caller_app(target: Target) -> App:
    """The target's app, imported once per process, for the reports: no handler runs on it.

    The commit's process and the caller read and write ``spark_reports`` on it.
    """
    found = _APPS.get(target)
    if found is None:
        from eop.app import App

        found = _APPS[target] = App.from_path(target.app).with_settings(
            **target.resolved_settings()
        )
    return found
