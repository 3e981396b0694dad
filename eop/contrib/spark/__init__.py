"""eop on Apache Spark: the ``jetstream`` data source and an exactly-once handler sink.

Importing this package does not import PySpark; the modules that need it do:

- :mod:`eop.contrib.spark.source`: the ``jetstream`` Python data source (batch and
  Structured Streaming) that reads stream sequences through short-lived
  consumers;
- :mod:`eop.contrib.spark.sink`: the ``eop`` data source, whose writer (batch and
  streaming) runs a registered eop handler on the rows of each partition, in
  one transaction with the same inbox claims as the workers;
- :mod:`eop.contrib.spark.report`: the writer's outcome counts, from Spark's commit
  process to the caller;
- :mod:`eop.contrib.spark.jobs`: what ``eop spark backfill`` and ``eop spark stream`` run;
- :mod:`eop.contrib.spark.session`: a SparkSession with a Java runtime found or
  provided, or a Spark Connect session;
- :mod:`eop.contrib.spark.connect`: where classic and Spark Connect sessions differ;
- :mod:`eop.contrib.spark.probe`: before a job, whether the executors import eop, pyarrow and
  the app;
- :mod:`eop.contrib.spark.failures`: a Spark failure's root cause and fix, in one line;
- :mod:`eop.contrib.spark.watch`: progress, and a job that no executor takes warned about or ended.

A throwaway standalone master and workers from pyspark's jars, which the tests
and ``python -m eop.tools.bench spark`` run on, is a developer tool:
:mod:`eop.tools.spark_cluster`.

``python -m eop.contrib.spark`` is ``eop spark`` as a spark-submit application (see
docs/spark-deployment.md).

Install it with ``pip install 'eop[spark]'`` (``'eop[spark-connect]'`` for Spark Connect).
"""

from __future__ import annotations
