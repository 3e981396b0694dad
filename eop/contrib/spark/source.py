"""The ``jetstream`` PySpark data source: batch reads and Structured Streaming.

    spark.dataSource.register(JetStreamDataSource)   # eop.contrib.spark.session does it
    df = (spark.read.format("jetstream")
          .option("stream", "ORDERS").option("subject", "ORDERS.created")
          .option("natsUrl", "nats://127.0.0.1:4222")
          .load())

Options are those of :class:`eop.contrib.spark.offsets.SourceOptions`; the schema is
:data:`eop.contrib.spark.reader.SCHEMA`. Offsets are ``{stream, epoch, seq}`` (the
next sequence to read); partitions are sequence ranges, each read by
:func:`eop.contrib.spark.reader.iterate` through a short-lived consumer, so any
micro-batch can be read again with the same rows after a restart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from eop import nats_access
from eop.contrib.spark import errors, offsets, reader
from eop.contrib.spark.offsets import Offset, SeqRange, SourceOptions


@dataclasses.dataclass(frozen=True)
class RangePartition(InputPartition):
    """One Spark partition: a sequence range, and the server to read it from."""

    seqs: SeqRange
    nats: nats_access.NatsAccess
    secret_env: tuple[tuple[str, str], ...] = ()
    """Secrets the executor reads from its own environment (``natsPasswordEnv``...)."""

    def __repr__(self) -> str:
        # Spark prints partitions in plans and logs: no credentials there.
        return f"RangePartition({self.seqs!r}, {self.nats!r})"


class JetStreamDataSource(DataSource):
    """``format("jetstream")``: the messages of a JetStream stream, by sequence."""

    @classmethod
    def name(cls) -> str:
        """The format name."""
        return "jetstream"

    def schema(self) -> str:
        """stream, seq, subject, msg_id, headers, data, timestamp, epoch."""
        return reader.SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        """A batch read of ``[startSequence, endSequence]``."""
        return JetStreamBatchReader(SourceOptions.parse(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """A streaming read from ``startSequence`` on."""
        return JetStreamStreamReader(SourceOptions.parse(self.options))


def _partitions(opts: SourceOptions, epoch: str, start: int, end: int) -> list[RangePartition]:
    ranges = offsets.split(opts.stream, epoch, opts.subject, start, end, opts.per_partition)
    return [RangePartition(seqs, opts.shipped_nats, opts.secret_env) for seqs in ranges]


ARROW_SCHEMA = pa.schema(
    [
        ("stream", pa.string()),
        ("seq", pa.int64()),
        ("subject", pa.string()),
        ("msg_id", pa.string()),
        ("headers", pa.map_(pa.string(), pa.string())),
        ("data", pa.binary()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("epoch", pa.string()),
    ]
)
""":data:`eop.contrib.spark.reader.SCHEMA` in Arrow's terms."""


def _read(partition: InputPartition) -> Iterator[pa.RecordBatch]:
    if not isinstance(partition, RangePartition):
        # Spark reads one partition of its own making when the plan has none.
        return
    nats = offsets.with_secrets_from_env(partition.nats, partition.secret_env)
    for rows in reader.iterate(nats, partition.seqs):
        # Arrow batches, not tuples: Spark's per-row conversion would cost more
        # than the read itself.
        yield to_arrow(rows)


def to_arrow(rows: list[reader.Row]) -> pa.RecordBatch:
    """Rows (never none) as an Arrow batch of :data:`ARROW_SCHEMA`."""
    columns = zip(*rows, strict=True)
    arrays = [pa.array(c, type=f.type) for c, f in zip(columns, ARROW_SCHEMA, strict=True)]
    return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA)


class JetStreamBatchReader(DataSourceReader):
    """Plans a batch read from the stream's state when the query is planned."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        """The requested sequences that the stream has stored, in ranges."""
        state = reader.state_once(self.opts.nats, self.opts.stream)
        start, end = offsets.batch_bounds(self.opts, state)
        return _partitions(self.opts, state.epoch, start, end)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The rows of one range (in a Spark task)."""
        return _read(partition)


class JetStreamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of sequence ranges; the checkpointed offsets make them replayable."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._until: int | None = None
        self._probe: reader.StateProbe | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Spark ships the reader to its tasks; the driver's connection stays behind.
        state = dict(self.__dict__)
        state["_probe"] = None
        return state

    def _state(self) -> offsets.StreamState:
        if self._probe is None:
            self._probe = reader.StateProbe(self.opts.nats)
        return self._probe.state(self.opts.stream)

    def initialOffset(self) -> dict[str, Any]:
        """``startSequence``, else the stream's first sequence, in its current epoch."""
        return offsets.initial_offset(self.opts, self._state()).to_json()

    def getDefaultReadLimit(self) -> ReadLimit:
        """``maxMessagesPerBatch`` sequences per micro-batch, when set."""
        if self.opts.max_per_batch is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.opts.max_per_batch)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        """The end of the next micro-batch from ``start``, within ``limit``."""
        begin = Offset.from_json(start)
        offsets.check_same_stream(self.opts, begin)
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return offsets.latest_offset(
            begin, self._state(), max_rows=max_rows, until=self._until
        ).to_json()

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: stop at what the stream holds now."""
        self._until = self._state().next_seq

    def reportLatestOffset(self) -> dict[str, Any] | None:
        """What the stream holds now, for the query's progress reports."""
        state = self._state()
        return Offset(state.stream, state.epoch, state.next_seq).to_json()

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """The micro-batch ``[start, end)`` in ranges (also when Spark replays it)."""
        begin, finish = Offset.from_json(start), Offset.from_json(end)
        offsets.check_same_stream(self.opts, begin)
        if begin.epoch != finish.epoch:  # latestOffset never plans across epochs
            raise errors.StreamRecreated(f"offsets {start} and {end} are of different epochs")
        return _partitions(self.opts, begin.epoch, begin.seq, finish.seq)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The rows of one range (in a Spark task)."""
        return _read(partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: reading consumes nothing on the server."""

    def stop(self) -> None:
        """Close the driver's connection."""
        if self._probe is not None:
            self._probe.close()
            self._probe = None
