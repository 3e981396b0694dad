"""The exactly-once sink: a registered eop handler run over a DataFrame, inside Spark tasks.

    counts = sink.apply(df, sink.Target("myapp:app", "billing"))          # batch
    df.writeStream.foreachBatch(sink.BatchSink(target)).start()           # streaming

Each partition of ``df`` (rows of the ``jetstream`` source, unchanged) runs in
one transaction through :class:`eop.spark.apply.Partition`, so retried,
speculative and replayed tasks are no-ops for what already committed. The
app is imported by its ``module:attribute`` path in each Python worker (the
module must be importable there: installed, on ``PYTHONPATH``, or shipped
with ``--py-files``), once per process.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from eop import errors, log, message
from eop.spark.apply import Counts, Partition

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row

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


def apply(df: DataFrame, target: Target) -> Counts:
    """Run the target's handler over every row of ``df``; the outcomes, summed."""
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise errors.ConfigurationError(
            f"the DataFrame lacks the columns {missing} of the jetstream source"
        )
    # The RDD API, not mapInArrow: that one needs pandas, which nothing else here does.
    per_partition = df.rdd.mapPartitions(PartitionFunction(target)).collect()
    total = Counts()
    for counts in per_partition:
        total = total + counts
    return total


class BatchSink:
    """A ``foreachBatch`` function: :func:`apply` on each micro-batch, then ``on_batch``.

    Spark calls it again with the same rows when it replays a micro-batch it
    had not committed (a query killed after the sink wrote); those rows are
    all found in the inbox and skipped.
    """

    def __init__(
        self, target: Target, on_batch: Callable[[int, Counts], None] | None = None
    ) -> None:
        self.target = target
        self.on_batch = on_batch

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        counts = apply(df, self.target)
        if self.on_batch is not None:
            self.on_batch(batch_id, counts)


class PartitionFunction:
    """The ``mapPartitions`` function: one partition's rows in, their :class:`Counts` out."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def __call__(self, rows: Iterable[Row]) -> Iterator[Counts]:
        partition = partition_for(self.target)
        yield partition.run(messages_from_rows(rows, partition.spec.name))


def messages_from_rows(rows: Iterable[Row], subscription: str) -> Iterator[message.Message]:
    """The messages of ``jetstream`` rows, as the handler sees them."""
    for row in rows:
        fields = row.asDict()
        stamp = fields.get("timestamp")
        if isinstance(stamp, datetime.datetime) and stamp.tzinfo is None:
            # PySpark hands timestamps over in the worker's local time, without a zone.
            stamp = stamp.astimezone(datetime.timezone.utc)
        yield message.Message(
            subscription=subscription,
            subject=fields["subject"],
            # BinaryType arrives as a bytearray; the fingerprint hashes bytes alike.
            data=bytes(fields["data"] or b""),
            headers=dict(fields["headers"] or {}),
            stream=fields["stream"],
            stream_epoch=fields["epoch"],
            seq=int(fields["seq"]),
            num_delivered=1,
            timestamp=stamp,
        )


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
    found = _PARTITIONS[target] = Partition(app, spec)
    return found
