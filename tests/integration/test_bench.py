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


def _bench(flags: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        embedded.nats_server_binary()
        embedded.postgres_bin_dir()
    except errors.ServerBinaryNotFound as exc:
        unavailable(str(exc))
    # fsync off: the tests check that the bench works, not how fast the disk is.
    proc = subprocess.run(
        [sys.executable, "-m", "eop", "bench", "--no-fsync", *flags],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("EOP_")},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "WARNING" not in proc.stdout
    return proc


def test_bench_measures_the_six_runs_end_to_end(tmp_path: Path) -> None:
    """A tiny `eop bench --runs abcdef` prints rows (a) to (f) and the ratios; every eop
    and naive message took effect exactly once; the JSON report holds the same runs."""
    report_path = tmp_path / "bench.json"
    flags = ["--runs", "abcdef", "--messages", "1000", "--naive-messages", "200"]
    proc = _bench([*flags, "--latency-s", "0.5", "--json", str(report_path)])
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
    report = json.loads(report_path.read_text())
    assert [run["key"] for run in report["runs"]] == ["a", "b", "c", "d", "e", "f"]
    assert report["relay"] is None
    for run in report["runs"]:
        assert run["rate"] > 0
        assert run["p99_ms"] >= run["p50_ms"] > 0
        if run["key"] != "a":
            assert run["effects"] == run["messages"] + run["latency_messages"]


def test_bench_measures_the_relay_rows_end_to_end(tmp_path: Path) -> None:
    """A tiny `eop bench --runs r` prints the relay's rows (r, rw, rp, rl, rn) and its
    ratios; the relay put each outbox row in the stream exactly once, the worker took
    each of them into effect once, and every row of the commit-to-PubAck runs (with
    LISTEN and polling) reached the stream once."""
    report_path = tmp_path / "bench.json"
    flags = ["--runs", "r", "--relay-messages", "2500", "--relay-rate", "50"]
    proc = _bench([*flags, "--relay-latency-s", "0.5", "--json", str(report_path)])
    for row in ("(r) eop relay", "(rw) eop default worker", "(rp) raw publish_async"):
        assert row in proc.stdout
    for row in ("(rl) relay, LISTEN/NOTIFY", "(rn) relay without LISTEN"):
        assert row in proc.stdout
    assert "r/rw = " in proc.stdout
    assert "r/rp = " in proc.stdout
    report = json.loads(report_path.read_text())
    assert report["runs"] == []
    relay = report["relay"]
    assert [row["key"] for row in relay["rows"]] == ["r", "rw", "rp"]
    for row in relay["rows"]:
        assert row["delivered"] == row["messages"] == 2500
        assert row["rate"] > 0
    assert [row["key"] for row in relay["latency"]] == ["rl", "rn"]
    for row in relay["latency"]:
        assert row["delivered"] == row["rows"] == 25
        assert row["max_ms"] >= row["p99_ms"] >= row["p50_ms"] > 0
