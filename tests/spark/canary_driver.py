"""`eop spark backfill` and `eop spark stream` in a Spark driver whose web UI stays up, then
everything the UI, the plans and the event log show, written to files.

    python -m tests.spark.canary_driver OUT MODULE:APP --handler NAME [eop spark flags...]

Runs both commands (the stream with ``--available-now`` and its checkpoint in
``OUT/checkpoint``) in one local[2] session started here with the UI on a
free port, Spark's event log in ``OUT/eventlog`` and Spark logging at INFO;
the commands leave a session they did not start running. Then it writes
under ``OUT/ui`` every REST endpoint of the application (jobs, each stage
attempt with its tasks, environment, executors, SQL executions with their
plans...) and the UI's pages, and under ``OUT/plans`` the extended plans of
the commands' reads. ``OUT/ui/index.json`` lists each URL with its status.
Run by tests/spark/test_secrets.py, which looks for its canaries in all of it.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from eop import cli
from eop.cli import spark as spark_cli
from eop.contrib.spark import jobs, session
from eop.tools import embedded

#: The application's REST endpoints under /api/v1/applications/{id}/.
ENDPOINTS = (
    "jobs",
    "stages?details=true&withSummaries=true",
    "environment",
    "executors",
    "allexecutors",
    "sql?details=true&planDescription=true",
    "storage/rdd",
    "streaming/statistics",
)
#: The UI's HTML pages.
PAGES = ("jobs/", "stages/", "SQL/", "StreamingQuery/", "environment/", "executors/", "storage/")


class Dump:
    """Fetches URLs of the driver's UI into files; remembers each URL's status."""

    def __init__(self, base: str, folder: Path) -> None:
        self.base = base
        self.folder = folder
        self.statuses: dict[str, int] = {}
        self.count = 0
        folder.mkdir(parents=True)

    def get(self, path: str) -> str:
        """The body of ``base/path`` (empty unless 200), also written to a file."""
        try:
            with urllib.request.urlopen(f"{self.base}/{path}", timeout=60) as response:
                status, body = response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read().decode(errors="replace")
        self.statuses[path] = status
        self.count += 1
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", path)
        (self.folder / f"{self.count:03d}-{name}").write_text(body)
        return body if status == 200 else ""

    def json(self, path: str) -> Any:
        """The JSON of ``base/path`` (None unless 200)."""
        body = self.get(path)
        return json.loads(body) if body else None


def dump_ui(port: int, folder: Path) -> None:
    """Every REST endpoint and page of the application, each stage, job and SQL execution."""
    dump = Dump(f"http://127.0.0.1:{port}", folder)
    (application,) = dump.json("api/v1/applications")
    api = f"api/v1/applications/{application['id']}"
    for endpoint in ENDPOINTS:
        dump.get(f"{api}/{endpoint}")
    for job in dump.json(f"{api}/jobs"):
        dump.get(f"{api}/jobs/{job['jobId']}")
        dump.get(f"jobs/job/?id={job['jobId']}")
    for stage in dump.json(f"{api}/stages"):
        at = f"{stage['stageId']}/{stage['attemptId']}"
        dump.get(f"{api}/stages/{at}?details=true&withSummaries=true")
        dump.get(f"{api}/stages/{at}/taskList?length=10000")
        dump.get(f"stages/stage/?id={stage['stageId']}&attempt={stage['attemptId']}")
    for execution in dump.json(f"{api}/sql"):
        dump.get(f"{api}/sql/{execution['id']}?details=true&planDescription=true")
        dump.get(f"SQL/execution/?id={execution['id']}")
    for page in PAGES:
        text = dump.get(page)
        if page == "StreamingQuery/":
            for run_id in sorted(set(re.findall(r"statistics/?\?id=([0-9a-f-]{36})", text))):
                dump.get(f"StreamingQuery/statistics/?id={run_id}")
    (folder / "index.json").write_text(json.dumps(dump.statuses, indent=1))


def dump_plans(argv: list[str], folder: Path) -> None:
    """The extended plans of the backfill's and the stream's reads, as the commands build them."""
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    assert spark is not None
    args = cli.build_parser("spark").parse_args(["spark", "backfill", *argv])
    _, spec, _, read = spark_cli._prepare(args)
    folder.mkdir(parents=True)
    batch = jobs.ordered(spark.read.format("jetstream").options(**read.options(spec)).load(), spec)
    streaming = spark.readStream.format("jetstream").options(**read.options(spec)).load()
    for name, df in (("batch", batch), ("stream", streaming)):
        for mode in ("extended", "formatted", "cost", "codegen"):
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                df.explain(mode=mode)
            (folder / f"{name}-{mode}.txt").write_text(printed.getvalue())
        (folder / f"{name}-queryExecution.txt").write_text(df._jdf.queryExecution().toString())


def main(out: Path, argv: list[str]) -> int:
    """Both commands in this driver, then the UI and the plans into ``out``."""
    port = embedded.free_port()
    (out / "eventlog").mkdir(parents=True)
    conf = {
        "spark.ui.enabled": "true",
        "spark.ui.port": str(port),
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": str(out / "eventlog"),
        "spark.ui.showConsoleProgress": "false",
    }
    spark = session.build("local[2]", app_name="eop-canary", conf=conf)
    spark.sparkContext.setLogLevel("INFO")
    try:
        status = cli.main(["spark", "backfill", *argv])
        stream = ["--checkpoint", str(out / "checkpoint"), "--available-now"]
        status = status or cli.main(["spark", "stream", *argv, *stream, "--max-per-batch", "7"])
        if status == 0:
            dump_plans(argv, out / "plans")
            dump_ui(port, out / "ui")
    finally:
        spark.stop()
    return status


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
