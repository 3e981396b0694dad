"""A streaming query that dies right after its sink wrote the first micro-batch.

    python -m tests.spark.crash_driver NATS_URL DATABASE_URL CHECKPOINT MAX_PER_BATCH

The sink commits the micro-batch's transactions, then this process SIGKILLs
itself before the foreachBatch function returns: Spark has written the
batch's offsets to the checkpoint but never its commit (the JVM exits with
its Python driver). Run by tests/spark/test_spark.py.
"""

from __future__ import annotations

import os
import signal
import sys

from eop.spark import jobs, session, sink
from eop.spark.apply import Counts

from . import sparkapp


def main(nats_url: str, database_url: str, checkpoint: str, max_per_batch: str) -> None:
    """Start the query; the first micro-batch is its last."""
    spark = session.build("local[2]", conf={"spark.ui.showConsoleProgress": "false"})
    spec = sparkapp.app.handlers["spark_sync"]
    target = sink.Target.create(sparkapp.PATH, spec.name, database_url=database_url)
    read = jobs.ReadOptions(nats_url, max_per_batch=int(max_per_batch))

    def die(batch_id: int, counts: Counts) -> None:
        print(f"sink wrote batch {batch_id}: {counts}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    query = jobs.stream(spark, target, spec, read, checkpoint=checkpoint, on_batch=die)
    query.awaitTermination()


if __name__ == "__main__":
    main(*sys.argv[1:5])
