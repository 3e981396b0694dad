"""The arithmetic, the CPU accounting, the options and the progress line of `eop bench`."""

from __future__ import annotations

import io
import os

import pytest

from eop import bench, errors
from eop.bench import harness, measurement, report, runner, runs


def test_throughput_starts_after_the_first_completion() -> None:
    """Messages done together with the first one (one committed batch) open the span;
    the rate counts the messages done after them."""
    done = [10.0, 10.0, 10.0, 10.5, 11.0]
    assert bench.throughput(done) == pytest.approx(2 / 1.0)
    assert bench.throughput([5.0]) == 0.0
    assert bench.throughput([5.0, 5.0]) == 0.0


def test_percentile_is_nearest_rank() -> None:
    """p50 and p99 of 1..100 are 50 and 99; an empty list gives 0."""
    values = [float(v) for v in range(1, 101)]
    assert bench.percentile(values, 0.50) == 50.0
    assert bench.percentile(values, 0.99) == 99.0
    assert bench.percentile([7.0], 0.99) == 7.0
    assert bench.percentile([], 0.5) == 0.0


def test_window_takes_cpu_across_it_and_the_most_rows_around_it() -> None:
    """The samples bracketing a window give its CPU per message; the inbox rows are the
    most seen from just before to just after it; memory and the table's size are those
    of the first sample after it."""
    mb = 1024 * 1024
    samples = [
        measurement.Sample(floor=5_000, rows=900, cpu=1.0, rss=50 * mb),
        measurement.Sample(floor=12_000, rows=4_000, cpu=2.0, rss=60 * mb),
        measurement.Sample(
            floor=25_000, rows=700, cpu=4.0, rss=70 * mb, table=harness.InboxTable(3 * mb, 0, 1)
        ),
        measurement.Sample(floor=40_000, rows=9_000, cpu=5.0, rss=80 * mb),
    ]
    window = measurement.window_stats(samples, (10_001, 20_000))
    assert window.rows == 4_000
    assert window.cpu_us == pytest.approx(3.0 / 20_000 * 1e6)
    assert window.rss_mb == pytest.approx(70.0)
    assert window.inbox_mb == pytest.approx(3.0)
    assert measurement.window_stats([], (1, 2)) == measurement.Window(0, None, None, None)


def _big(**changes: object) -> dict[str, object]:
    figures: dict[str, object] = {
        "messages": 1_010_000,
        "seconds": 90.0,
        "effects": 1_010_000,
        "first_rate": 9_000.0,
        "early_rate": 10_000.0,
        "late_rate": 9_600.0,
        "early_cpu_us": 100.0,
        "late_cpu_us": 101.0,
        "early_rss_mb": 120.0,
        "late_rss_mb": 121.0,
        "max_rss_mb": 122.0,
        "early_inbox": 1_500,
        "late_inbox": 1_400,
        "max_inbox": 1_900,
        "end_inbox": 800,
        "settled_inbox": 0,
        "inbox_bound": 2_000,
        "early_inbox_mb": 1.0,
        "late_inbox_mb": 2.0,
        "max_inbox_mb": 3.0,
        "autovacuums": 2,
        "samples": 900,
        "sample_interval_s": 0.1,
        "load_start": 1.0,
        "load_end": 2.0,
    }
    return {**figures, **changes}


def test_long_run_report_judges_the_rate_ratio_and_the_inbox_bound() -> None:
    """The long run's lines give the rates early and late, CPU, RSS and the inbox, and
    judge the two targets: the late rate at least 0.95x the early one, the inbox rows
    within max_ack_pending + compaction_after_messages."""
    text = "\n".join(report._big(_big()))
    assert "9,000 at messages 1-10k, 10,000 at 10k-20k, 9,600 at the last 10k" in text
    assert "target late/early msg/s >= 0.95: 0.96 met" in text
    assert "target inbox rows <= 2,000" in text
    assert "1,900 met" in text
    assert "121.0 at the end" in text
    missed = "\n".join(report._big(_big(late_rate=9_000.0, max_inbox=2_001)))
    assert "0.90 MISSED" in missed
    assert "2,001 MISSED" in missed


def test_progress_prints_plain_lines_off_a_terminal() -> None:
    """Off a terminal: a first line, nothing more within 5 s, then the last one."""
    out = io.StringIO()
    progress = bench.Progress(out)
    progress.show("(a) run", 10, 100, 1234.0)
    progress.show("(a) run", 50, 100)
    progress.show("(a) run", 100, 100)
    progress.end()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "10/100" in lines[0]
    assert "1,234 msg/s" in lines[0]
    assert "100/100" in lines[1]
    assert "\r" not in out.getvalue()


def test_progress_redraws_one_line_on_a_terminal() -> None:
    """On a terminal every update redraws the same line; end() closes it."""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    progress = bench.Progress(out)
    progress.show("(c) eop default", 1, 4)
    progress.show("(c) eop default", 4, 4)
    progress.end()
    assert out.getvalue().count("\r") == 2
    assert out.getvalue().endswith("\n")
    assert out.getvalue().count("\n") == 1


def test_cpu_per_message_divides_each_known_figure() -> None:
    """CPU per message is each process's difference over the messages, in µs; unknown
    stays unknown (None), and so does a count of zero."""
    before = harness.Cpu(child=1.0, nats=2.0, pg=None)
    after = harness.Cpu(child=1.5, nats=2.1, pg=3.0)
    per = before.per_message_us(after, 1_000)
    assert per.child == pytest.approx(500.0)
    assert per.nats == pytest.approx(100.0)
    assert per.pg is None
    assert before.per_message_us(after, 0) == harness.Cpu(None, None, None)


def test_tree_cpu_counts_a_running_process_and_nothing_for_an_absent_one() -> None:
    """This process has used some CPU (Linux); an unknown pid has none to report."""
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc")
    mine = harness.tree_cpu_s(os.getpid())
    assert mine is not None
    assert mine >= 0
    assert harness.tree_cpu_s(None) is None


def test_runs_are_chosen_by_key() -> None:
    """--runs takes 'all' or run keys separated by commas (r: the relay's rows), or
    'none' with --big; an unknown key, or nothing, is refused."""
    assert runs.chosen(runs.Options(runs="c,r").runs) == ["c", "r"]
    assert runs.chosen("all") == list(runs.SELECTABLE)
    assert "hn" in runs.SELECTABLE
    for bad in ("x", "", " ", "c,zz", ",", "none"):
        with pytest.raises(errors.ConfigurationError):
            runs.Options(runs=bad)
    # The long run alone: no other run, only with --big.
    assert runs.chosen(runs.Options(runs="none", big=True).runs) == []


def _result(key: str, rate: float, processes: int, cpu_us: float) -> measurement.Result:
    return measurement.Result(
        key=key,
        label=key,
        command="",
        messages=1,
        rate=rate,
        cpu_us=cpu_us,
        nats_us=None,
        pg_us=None,
        latency_messages=0,
        latency_rate=0.0,
        p50_ms=1.0,
        p99_ms=2.0 if key == "c" else 4.0,
        effects=None,
        processes=processes,
    )


def test_each_eop_run_is_compared_with_baselines_of_its_own_process_count() -> None:
    """eop with 2 processes is divided by the 2-process lean and hand-written rows, eop in
    one process by the 1-process ones; styles are set beside eop.Writes; c/h and the p99
    ratio compare eop default with one hand-written process."""
    results = [
        _result("a", 100.0, 1, 5.0),
        _result("an", 200.0, 2, 6.0),
        _result("h", 10.0, 1, 50.0),
        _result("hn", 20.0, 2, 55.0),
        _result("c", 40.0, 2, 24.0),
        _result("c1", 25.0, 1, 20.0),
        _result("o", 30.0, 2, 30.0),
    ]
    ratios = runner.ratios(results)
    assert ratios["c/lean"] == pytest.approx(0.2)
    assert ratios["c/hand"] == pytest.approx(2.0)
    assert ratios["c cpu/lean"] == pytest.approx(4.0)
    assert ratios["c1/lean"] == pytest.approx(0.25)
    assert ratios["c1/hand"] == pytest.approx(2.5)
    assert ratios["o/c"] == pytest.approx(0.75)
    assert ratios["c/h"] == pytest.approx(4.0)
    assert ratios["c p99/h p99"] == pytest.approx(0.5)
    assert "a/lean" not in ratios


def test_report_says_which_targets_are_met_and_which_missed() -> None:
    """A target line per ratio measured: met, or MISSED."""
    assert report._target("o/c", 0.75, ">=", 0.8).endswith("MISSED")
    assert report._target("c cpu/lean", 3.5, "<=", 4.0).endswith("met")
