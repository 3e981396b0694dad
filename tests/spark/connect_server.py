"""A Spark Connect server on 127.0.0.1 and a free port, started from pyspark's own jars.

``spark-submit --class ...SparkConnectServer`` (what pyspark's
``sbin/start-connect-server.sh`` runs), with a ``local[2]`` master, as a JVM
of its own. Its Python workers run this interpreter with the repository on
their path, so they import eop and the tests' app as a deployed server's
would import them from its environment.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import DEVNULL, STDOUT, Popen

from eop.contrib.spark import java
from eop.tools import embedded
from eop.tools.spark_cluster import START_TIMEOUT_S, Daemon, spark_home

ROOT = Path(__file__).resolve().parents[2]
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


@dataclass
class ConnectServer:
    """One Spark Connect server; ``url`` is what ``--remote`` takes."""

    scratch: Path
    port: int = field(default_factory=embedded.free_port)
    daemon: Daemon | None = None

    @property
    def url(self) -> str:
        """The server's ``sc://`` URL."""
        return f"sc://127.0.0.1:{self.port}"

    def start(self) -> ConnectServer:
        """Start the server; returns once it listens."""
        env = dict(os.environ)
        java.ensure_java(env)
        env.update(
            SPARK_HOME=str(spark_home()),
            SPARK_LOCAL_IP="127.0.0.1",
            PYSPARK_PYTHON=sys.executable,
            PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        )
        conf = {
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(self.port),
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.ui.showConsoleProgress": "false",
        }
        args = [str(spark_home() / "bin" / "spark-submit"), "--class", SERVER_CLASS]
        args += ["--master", "local[2]", "--name", "eop-tests-connect"]
        for key, value in conf.items():
            args += ["--conf", f"{key}={value}"]
        log = self.scratch / "connect-server.log"
        with log.open("wb") as out:
            process = Popen(
                [*args, "spark-internal"],
                env=env,
                cwd=self.scratch,
                stdout=out,
                stderr=STDOUT,
                stdin=DEVNULL,
                start_new_session=True,
            )
        self.daemon = Daemon("connect server", process, log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Spark Connect server started" not in self.daemon.text():
            if process.poll() is not None or time.monotonic() > deadline:
                tail = self.daemon.text()[-3000:]
                raise RuntimeError(f"the Spark Connect server did not start:\n{tail}")
            time.sleep(0.2)
        return self

    def kill(self) -> None:
        """SIGKILL the server and its Python workers (a crash: nothing is told)."""
        if self.daemon is not None and self.daemon.process.poll() is None:
            os.killpg(self.daemon.process.pid, signal.SIGKILL)
            self.daemon.process.wait(timeout=30)

    def stop(self) -> None:
        """Stop the server and the Python workers it started."""
        if self.daemon is not None:
            self.daemon.stop()
