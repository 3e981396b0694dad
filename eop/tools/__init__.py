"""eop's developer tools: what runs beside eop, never inside a worker.

- :mod:`eop.tools.embedded`: a throwaway nats-server and PostgreSQL from the
  ``embedded`` extra's wheels (:mod:`eop.tools._child`: their child processes);
  :mod:`eop.tools.embedded_cluster`: three clustered nats-servers;
  :mod:`eop.tools.spark_cluster`: a Spark standalone cluster from pyspark's jars;
- :mod:`eop.tools.demo`: ``eop demo``;
- :mod:`eop.tools.chaos`: ``eop chaos``, the seeded chaos harness;
- :mod:`eop.tools.bench`: ``eop bench``, the throughput and latency bench.

``eop worker`` and ``eop relay`` import none of them, and nothing below this
package in eop's layers does, so a production image can delete the folder
(the Dockerfile does): ``eop chaos``, ``eop bench`` and ``eop demo`` then say
in one line how to install it. Importing this package imports nothing.
"""
