"""``eop spark`` as a Spark application, for ``spark-submit`` (cluster deploy mode too).

    spark-submit --master yarn --deploy-mode cluster \
        --archives eop-env.tar.gz#environment \
        --conf spark.pyspark.python=./environment/bin/python \
        --conf spark.yarn.appMasterEnv.EOP_DATABASE_URL=postgresql+asyncpg://... \
        --conf spark.yarn.appMasterEnv.EOP_NATS_URL=nats://... \
        examples/spark/submit.py backfill examples.spark.app:app --handler balances

The arguments are those of ``eop spark``; the master is spark-submit's.
``eop-env.tar.gz`` is a packed virtualenv (``venv-pack``) with ``eop[spark]``
and the app installed, so that the driver and every executor import them.
"""

from __future__ import annotations

import sys

from eop import cli

if __name__ == "__main__":
    sys.exit(cli.main(["spark", *sys.argv[1:]]))
