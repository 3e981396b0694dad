"""`eop bench` as a user runs it, on tiny sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from eop import errors
from eop.tools import embedded
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


_KEYS = ["a", "an", "b", "h", "hn", "hb", "m", "mn", "c", "o", "s1", "k"]


def test_bench_measures_the_baselines_and_eop_styles_end_to_end(tmp_path: Path) -> None:
    """A tiny `eop bench` over the lean raw loop (one and many processes), the naive and
    the hand-written consumers (one with a bounded inbox), the leanest exactly-once loop
    (the floor) and eop's handler styles prints each row, its comparison with the
    baselines of its process count, and the targets; every exactly-once message (eop's,
    the naive, the hand-written and the floor loops') took effect
    exactly once, the warm-up backlog before the measured one left out of the counts; the
    JSON report holds the same runs."""
    report_path = tmp_path / "bench.json"
    flags = ["--runs", ",".join(_KEYS), "--messages", "1000", "--naive-messages", "200"]
    flags += ["--warm-messages", "300"]
    proc = _bench([*flags, "--latency-s", "0.5", "--json", str(report_path)])
    for row in (
        "(a) lean raw at-least-once",
        "(b) naive",
        "(h) hand-written exactly-once",
        "(hb) hand-written bounded",
        "(m) leanest exactly-once (floor)",
        "(mn) leanest exactly-once",
        "(c) eop default, eop.Writes",
        "(o) eop default, async ORM",
        "(s1) sync ORM, one process",
        "(k) eop default, batch handler",
    ):
        assert row in proc.stdout
    # (Not "c cpu/lean": 1,000 messages of the lean loop may take less than a clock tick.)
    assert "target c/hand >= 3: " in proc.stdout
    assert "c/b = " in proc.stdout
    assert "c pg/bounded = " in proc.stdout
    assert "floor/hand = " in proc.stdout
    assert "c/floor = " in proc.stdout
    report = json.loads(report_path.read_text())
    assert [run["key"] for run in report["runs"]] == _KEYS
    assert report["relay"] is None
    assert report["ratios"]["s1/lean"] > 0
    assert report["ratios"]["c/hand"] > 0
    for run in report["runs"]:
        assert run["rate"] > 0
        assert run["p99_ms"] >= run["p50_ms"] > 0
        if run["key"] not in ("a", "an"):
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


def test_bench_measures_the_poison_flood_end_to_end(tmp_path: Path) -> None:
    """A tiny `eop bench --runs f` prints the poison flood's rows (eop and the hand-written
    consumer) and their ratios; in both, every good message took effect once, every
    failing one has one dead letter and no good one has any, and the CPU is divided by
    every handler run."""
    report_path = tmp_path / "bench.json"
    proc = _bench(["--runs", "f", "--flood-messages", "200", "--json", str(report_path)])
    for row in ("(f) eop worker, poison flood", "(fh) hand-written, "):
        assert row in proc.stdout
    assert "f good/hand = " in proc.stdout
    report = json.loads(report_path.read_text())
    assert report["runs"] == []
    assert [row["key"] for row in report["flood"]] == ["f", "fh"]
    for row in report["flood"]:
        assert (row["poison"], row["good"], row["max_attempts"]) == (100, 100, 5)
        assert (row["effects"], row["dead"], row["dead_good"]) == (100, 100, 0)
        assert row["handler_runs"] == 600
        assert row["drain_s"] > 0
        assert row["good_s"] > 0
    assert report["ratios"]["f good/hand"] > 0
