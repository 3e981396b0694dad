"""A throwaway Spark standalone cluster on 127.0.0.1, started from pyspark's own jars.

One master and its workers (``spark-class ...deploy.master.Master`` and
``...deploy.worker.Worker``), each a JVM of its own, as a user would start
them from a pip-installed PySpark. Their executors run whatever Python the
driver names (``PYSPARK_PYTHON``), in a work directory of their own: an app
is not on their path unless the job ships it or that Python has it installed.
The Spark tests and ``python -m eop.tools.bench spark`` run on it.

    with Cluster(scratch, cores=2).start() as cluster:
        spark = session.build(cluster.url)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from eop.contrib.spark import java
from eop.tools import embedded

START_TIMEOUT_S = 120.0


def spark_home() -> Path:
    """The pip-installed PySpark's directory, which holds Spark's jars and scripts."""
    import pyspark

    return Path(pyspark.__file__).parent


@dataclass
class Daemon:
    """One JVM of the cluster, its log in a file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        """The daemon's log so far."""
        return self.log.read_text(encoding="utf-8", errors="replace")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a while: the daemon and the executors it started."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)


@dataclass
class Cluster:
    """A standalone master and its workers; ``url`` is what ``--master`` takes."""

    scratch: Path
    cores: int = 2
    port: int = field(default_factory=embedded.free_port)
    master: Daemon | None = None
    workers: list[Daemon] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The master's URL."""
        return f"spark://127.0.0.1:{self.port}"

    def start(self, workers: int = 1) -> Cluster:
        """Start the master and ``workers`` workers; returns once the workers have registered."""
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.master = self._daemon(
            "master",
            "org.apache.spark.deploy.master.Master",
            ["--host", "127.0.0.1", "--port", str(self.port), "--webui-port", "0"],
        )
        try:
            self._wait(self.master, "I have been elected leader")
            for _ in range(workers):
                self.add_worker()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_worker(self) -> Daemon:
        """Start a worker with ``cores`` cores; returns once the master knows it."""
        if self.master is None:
            raise RuntimeError("Cluster.start() first")
        before = self.master.text().count("Registering worker")
        number = len(self.workers)
        work_dir = self.scratch / f"work{number}"
        work_dir.mkdir(parents=True, exist_ok=True)
        worker = self._daemon(
            f"worker{number}",
            "org.apache.spark.deploy.worker.Worker",
            [
                self.url,
                *("--host", "127.0.0.1", "--webui-port", "0", "--cores", str(self.cores)),
                *("--memory", "1g", "--work-dir", str(work_dir)),
            ],
        )
        self.workers.append(worker)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.master.text().count("Registering worker") <= before:
            self._check_alive(worker, deadline)
        return worker

    def executors(self) -> list[int]:
        """The PIDs of the executor JVMs the workers run now (Linux: read from /proc)."""
        workers = {w.process.pid for w in self.workers}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent in workers and b"CoarseGrainedExecutorBackend" in cmdline:
                found.append(int(entry.name))
        return found

    def stop(self) -> None:
        """Stop the workers, then the master."""
        for daemon in [*self.workers, *([self.master] if self.master else [])]:
            with contextlib.suppress(ProcessLookupError):
                daemon.stop()

    def _daemon(self, name: str, main: str, args: list[str]) -> Daemon:
        env = dict(os.environ)
        java.ensure_java(env)
        env.update(
            SPARK_HOME=str(spark_home()),
            SPARK_LOCAL_IP="127.0.0.1",
            # Not the driver's: the daemons need no Python, and the executors get the driver's.
            SPARK_LOG_DIR=str(self.scratch),
            SPARK_WORKER_DIR=str(self.scratch),
        )
        env.pop("PYSPARK_PYTHON", None)
        env.pop("PYTHONPATH", None)
        log = self.scratch / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), main, *args],
                env=env,
                cwd=self.scratch,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return Daemon(name, process, log)

    def _wait(self, daemon: Daemon, line: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while line not in daemon.text():
            self._check_alive(daemon, deadline)

    @staticmethod
    def _check_alive(daemon: Daemon, deadline: float) -> None:
        if daemon.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the Spark {daemon.name} did not start:\n{daemon.text()[-3000:]}")
        time.sleep(0.2)
