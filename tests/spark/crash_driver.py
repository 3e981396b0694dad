"""A streaming query that dies right after its sink committed the first micro-batch.

    python -m tests.spark.crash_driver NATS_URL DATABASE_URL CHECKPOINT MAX_PER_BATCH

The ``eop`` data source is registered here in a form whose stream writer,
once its commit has run (the tasks' transactions committed, the counts
left), SIGKILLs this driver, its JVM and its Python workers before Spark
writes the batch's commit to the checkpoint.
Run by tests/spark/test_spark.py.
"""

from __future__ import annotations

import os
import signal
import sys

from pyspark.sql.datasource import DataSourceStreamWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from eop.contrib.spark import jobs, session, sink
from eop.contrib.spark.apply import Counts

from . import sparkapp

GROUP_VAR = "EOP_TEST_CRASH_GROUP"


class DyingStreamWriter(sink.EopStreamWriter):
    """The sink's stream writer, and a crash after its first commit."""

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Commit, then kill the driver, its JVM and its workers at once."""
        super().commit(messages, batchId)
        os.killpg(int(os.environ[GROUP_VAR]), signal.SIGKILL)
        # PySpark's daemon keeps its workers in a group of their own: this one's.
        os.killpg(os.getpgrp(), signal.SIGKILL)


class DyingEop(sink.EopDataSource):
    """``format("eop")`` with :class:`DyingStreamWriter`."""

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        """The dying writer."""
        return DyingStreamWriter(*self._parsed(schema, overwrite))


def main(nats_url: str, database_url: str, checkpoint: str, max_per_batch: str) -> None:
    """Start the query; the first micro-batch is its last."""
    # A group of its own, which the JVM joins; the workers learn it from the environment.
    os.setsid()
    os.environ[GROUP_VAR] = str(os.getpgrp())
    spark = session.build("local[2]", conf={"spark.ui.showConsoleProgress": "false"})
    spark.dataSource.register(DyingEop)
    spec = sparkapp.app.handlers["spark_sync"]
    target = sink.Target.create(sparkapp.PATH, spec.name, database_url=database_url)
    read = jobs.ReadOptions(nats_url, max_per_batch=int(max_per_batch))
    seen: list[Counts] = []
    query = jobs.stream(
        spark, target, spec, read, checkpoint=checkpoint, on_batch=lambda _, c: seen.append(c)
    )
    query.awaitTermination()


if __name__ == "__main__":
    main(*sys.argv[1:5])
