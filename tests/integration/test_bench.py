"""`eop bench` as a user runs it, on tiny sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from eop import embedded, errors
from tests.conftest import unavailable

ROOT = Path(__file__).resolve().parents[2]


def test_bench_measures_the_four_runs_end_to_end(tmp_path: Path) -> None:
    """A tiny `eop bench` prints rows (a) to (d) and both ratios; every eop and naive
    message took effect exactly once; the JSON report holds the same runs."""
    try:
        embedded.nats_server_binary()
        embedded.postgres_bin_dir()
    except errors.ServerBinaryNotFound as exc:
        unavailable(str(exc))
    report_path = tmp_path / "bench.json"
    flags = ["--messages", "1000", "--naive-messages", "200", "--latency-s", "0.5"]
    # fsync off: the test checks that the bench works, not how fast the disk is.
    flags += ["--no-fsync", "--json", str(report_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "eop", "bench", *flags],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("EOP_")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for row in (
        "(a) raw at-least-once",
        "(b) naive",
        "(c) eop default",
        "(d) eop tuned",
        "(e) eop default, session",
        "(f) eop default, one process",
    ):
        assert row in proc.stdout
    assert "c/a = " in proc.stdout
    assert "c/b = " in proc.stdout
    assert "WARNING" not in proc.stdout
    report = json.loads(report_path.read_text())
    assert [run["key"] for run in report["runs"]] == ["a", "b", "c", "d", "e", "f"]
    for run in report["runs"]:
        assert run["rate"] > 0
        assert run["p99_ms"] >= run["p50_ms"] > 0
        if run["key"] != "a":
            assert run["effects"] == run["messages"] + run["latency_messages"]
