"""The arithmetic, the CPU accounting, the options and the progress line of `eop bench`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import io
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from eop import backoff, errors
from eop.tools import bench
from eop.tools.bench import (
    baselines,
    flood,
    floor,
    harness,
    measurement,
    procstat,
    report,
    runner,
    runs,
)


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
        "max_full_count_gap_s": 0.3,
        "unseen_rows": 0,
        "count_lag_s": 1.0,
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
    mine = procstat.tree_cpu_s(os.getpid())
    assert mine is not None
    assert mine >= 0
    assert procstat.tree_cpu_s(None) is None


def test_a_process_cpu_is_read_to_the_microsecond_not_in_clock_ticks() -> None:
    """The bench's CPU a message divides small differences: its reading of a process
    agrees with the process's own clock to well under a 10 ms tick."""
    if not os.path.exists("/proc/self/task"):
        pytest.skip("no /proc")
    busy = (
        "import sys, time; sum(i * i for i in range(300_000));"
        " print(time.process_time(), flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", busy], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        own = float(child.stdout.readline())
        read = procstat.snapshot()[child.pid].own_s
    finally:
        child.communicate("")
    assert abs(read - own) < 0.002


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
    # The poison flood's rows are chosen together, and need a failing and a good message.
    assert "f" in runs.chosen(runs.Options(runs="f", flood_messages=2).runs)
    with pytest.raises(errors.ConfigurationError):
        runs.Options(runs="f", flood_messages=1)


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
    one process by the 1-process ones, their p99 too; styles are set beside eop.Writes;
    c/h, shown beside the targets, compares eop default with one hand-written process."""
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
    assert ratios["c p99/hand"] == pytest.approx(0.5)
    assert "c p99/h p99" not in ratios
    assert "a/lean" not in ratios


def test_report_says_which_targets_are_met_and_which_missed() -> None:
    """A target line per ratio measured: met, or MISSED."""
    assert report._target("o/c", 0.75, ">=", 0.8).endswith("MISSED")
    assert report._target("c cpu/lean", 3.5, "<=", 4.0).endswith("met")


def test_poison_flood_is_half_failing_then_half_good_and_counts_every_attempt() -> None:
    """--messages splits into failing and good messages (the odd one good); the CPU is
    divided by every handler run: max_attempts per failing message, one per good one."""
    assert runs.flood_counts(4_000) == (2_000, 2_000)
    assert runs.flood_counts(5) == (2, 3)
    assert flood.handler_runs(2_000, 2_000, 5) == 12_000


def test_poison_flood_handler_raises_for_poison_and_records_the_rest() -> None:
    """eop's flood handler raises for a message starting with the poison mark and queues
    the one INSERT of every run for any other; the hand-written one does the same."""

    class Queue:
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []

        def add(self, _statement: object, row: dict[str, Any]) -> None:
            self.rows.append(row)

    def message(data: bytes) -> Any:
        return SimpleNamespace(data=data, subscription="bench-flood", seq=7, timestamp=None)

    queue = Queue()
    writes: Any = queue  # a fake of eop.Writes
    with pytest.raises(RuntimeError):
        asyncio.run(runs.record_or_fail(message(runs.POISON + b"xx"), writes))
    asyncio.run(runs.record_or_fail(message(b"xxx"), writes))
    assert queue.rows == [{"v": "bench-flood", "s": 7, "t": None}]
    meta = SimpleNamespace(sequence=SimpleNamespace(stream=7), timestamp=None)
    with pytest.raises(RuntimeError):
        baselines._handle(message(runs.POISON + b"xx"), meta, "v")
    assert baselines._handle(message(b"xxx"), meta, "v") == ("v", 7, None)


def test_hand_written_backoff_is_eops() -> None:
    """The hand-written flood consumer's nak delay follows eop's one backoff formula."""
    for delivered in range(0, 40):
        for base_s, max_s in ((0.5, 1.0), (0.5, 60.0), (0.1, 0.3)):
            assert baselines.nak_delay_s(delivered, base_s, max_s) == backoff.backoff_s(
                delivered, base_s, max_s
            )


class _Conn:
    """A fake asyncpg connection for the hand-written flood's transaction logic: it
    records each transaction's statements and whether it committed."""

    def __init__(self, claimed_before: frozenset[int] = frozenset()) -> None:
        self.claimed = set(claimed_before)
        self.transactions: list[tuple[list[tuple[str, Any]], bool]] = []

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        statements: list[tuple[str, Any]] = []
        self.current, before = statements, set(self.claimed)
        try:
            yield
        except BaseException:
            self.claimed = before
            self.transactions.append((statements, False))
            raise
        self.transactions.append((statements, True))

    async def fetch(self, _sql: str, _stream: str, seqs: list[int]) -> list[tuple[int]]:
        new = [seq for seq in seqs if seq not in self.claimed]
        self.claimed.update(new)
        self.current.append(("claim", seqs))
        return [(seq,) for seq in new]

    async def executemany(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        table = "effects" if "bench_effects" in sql else "dead"
        self.current.append((table, [row[1] for row in rows]))


def _msg(seq: int, delivered: int, poison: bool) -> Any:
    stamp = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    meta = SimpleNamespace(
        sequence=SimpleNamespace(stream=seq), num_delivered=delivered, timestamp=stamp
    )
    data = (runs.POISON if poison else b"x") + b"x"
    return SimpleNamespace(data=data, subject="s", metadata=meta)


def test_hand_written_flood_rolls_back_a_retry_and_dead_letters_with_the_claim() -> None:
    """A failure with attempts left rolls the batch's transaction back and the rest run
    again without it (nothing of it committed, its nak left to the caller); a failure on
    the last attempt is dead-lettered in the transaction that claims it; a duplicate is
    neither run nor written."""
    conn = _Conn(claimed_before=frozenset({4}))
    msgs = [_msg(1, 1, False), _msg(2, 2, True), _msg(3, 5, True), _msg(4, 1, False)]
    failed = asyncio.run(baselines._flood_transaction(conn, "S", "v", msgs, 5))
    assert failed == [msgs[1]]
    assert conn.transactions == [
        ([("claim", [1, 2, 3, 4])], False),
        ([("claim", [1, 3, 4]), ("effects", [1]), ("dead", [3])], True),
    ]
    assert conn.claimed == {1, 3, 4}


def test_hand_written_flood_commits_nothing_when_every_message_fails_early() -> None:
    """A batch whose every message fails with attempts left is one transaction, rolled
    back, and every message is returned for a nak."""
    conn = _Conn()
    msgs = [_msg(seq, 1, True) for seq in range(1, 4)]
    failed = asyncio.run(baselines._flood_transaction(conn, "S", "v", msgs, 5))
    assert failed == msgs
    assert conn.transactions == [([("claim", [1, 2, 3])], False)]
    assert conn.claimed == set()


def _flood_row(key: str, good_s: float, drain_s: float, cpu_us: float | None) -> flood.Flood:
    return flood.Flood(
        key=key,
        label=f"{key} row",
        command="",
        processes=2,
        poison=2_000,
        good=2_000,
        max_attempts=5,
        backoff_max_s=1.0,
        handler_runs=12_000,
        good_s=good_s,
        drain_s=drain_s,
        cpu_us=cpu_us,
        nats_us=None,
        pg_us=None,
        effects=2_000,
        dead=2_000,
        dead_good=0,
    )


def test_poison_flood_ratios_set_eop_over_the_hand_written_consumer() -> None:
    """f good/hand, f drain/hand and f cpu/hand divide eop's time to good, time to drain
    and CPU per handler run by the hand-written consumer's; an unknown figure or a missing
    row gives no ratio."""
    rows = [_flood_row("f", 2.0, 12.0, 300.0), _flood_row("fh", 8.0, 10.0, 100.0)]
    assert flood.ratios(rows) == pytest.approx(
        {"f good/hand": 0.25, "f drain/hand": 1.2, "f cpu/hand": 3.0}
    )
    unknown = [_flood_row("f", 2.0, 12.0, None), _flood_row("fh", 8.0, 10.0, 100.0)]
    assert "f cpu/hand" not in flood.ratios(unknown)
    assert flood.ratios(rows[:1]) == {}


def test_poison_flood_report_prints_each_row_its_ratios_and_warns_on_a_lost_message() -> None:
    """The flood's lines give both rows' times, handler runs and CPU, and the ratios;
    a good message without its effect or dead-lettered is a WARNING."""
    rows = [_flood_row("f", 2.0, 12.0, 300.0), _flood_row("fh", 8.0, 10.0, 100.0)]
    dicts = [dataclasses.asdict(row) for row in rows]
    text = "\n".join(report._flood(dicts, flood.ratios(rows)))
    assert "2,000 messages whose handler raises, then 2,000 good ones" in text
    assert "(f) f row" in text
    assert "12,000" in text
    assert "f good/hand = 0.25   f drain/hand = 1.20   f cpu/hand = 3.00" in text
    assert "WARNING" not in text
    dicts[0].update(effects=1_999, dead_good=1)
    assert "WARNING: 1999 effect rows for 2000 good messages" in "\n".join(report._flood(dicts, {}))


def test_a_limited_postgresql_is_judged_saturated_only_when_its_quota_is_busy() -> None:
    """With PostgreSQL held to 0.5 cores, a run that kept 0.45 of them busy saturated it
    (its rate over the quota is one core's ceiling); one that kept 0.2 busy did not, and
    the same figure is then only a lower bound, said so in the report."""
    busy = dataclasses.replace(_result("h", 30_000.0, 1, 50.0), pg_us=15.0)  # 0.45 cores
    idle = dataclasses.replace(_result("c", 10_000.0, 2, 30.0), pg_us=20.0)  # 0.2 cores
    found = runner.ceiling([busy, idle], 0.5)
    assert found["h"]["saturated"]
    assert found["h"]["per_pg_core"] == 60_000.0
    assert not found["c"]["saturated"]
    text = "\n".join(report._ceiling(found, 0.5))
    assert "(h)    30,000 msg/s, 0.45 cores busy; saturated: 60,000 msg/s a PostgreSQL core" in text
    assert "(c)    10,000 msg/s, 0.20 cores busy; not saturated" in text


def test_postgresqls_cpu_per_message_is_set_beside_the_hand_written_consumers() -> None:
    """`X pg/hand` divides a run's PostgreSQL CPU a message by the hand-written consumer's
    with as many processes; the target judges eop default's against 1.0."""
    rows = [
        dataclasses.replace(_result("hn", 10.0, 2, 50.0), pg_us=8.0),
        dataclasses.replace(_result("c", 30.0, 2, 30.0), pg_us=12.0),
    ]
    assert runner.ratios(rows)["c pg/hand"] == 1.5
    assert ("c pg/hand", "<=", 1.0) in report._TARGETS
    bounded = dataclasses.replace(_result("hb", 9.0, 2, 52.0), pg_us=10.0)
    assert runner.ratios([*rows, bounded])["c pg/bounded"] == 1.2
    assert "hb/hand" not in runner.ratios([*rows, bounded])


def test_the_leanest_exactly_once_loop_is_a_floor_beside_the_baselines() -> None:
    """(m) and (mn) are baselines, not eop runs: each eop run is divided by the floor of its
    own process count (`X/floor`, `X cpu/floor`, `X pg/floor`), and the floor in eop's
    process count by the lean loop and the hand-written consumer: what those targets allow
    any exactly-once design."""
    n = runs.PROCESSES
    rows = [
        _result("an", 200.0, n, 5.0),
        dataclasses.replace(_result("hn", 20.0, n, 50.0), pg_us=10.0),
        dataclasses.replace(_result("m", 30.0, 1, 15.0), pg_us=8.0),
        dataclasses.replace(_result("mn", 40.0, n, 20.0), pg_us=9.0),
        dataclasses.replace(_result("c", 30.0, n, 40.0), pg_us=12.0),
        dataclasses.replace(_result("c1", 24.0, 1, 30.0), pg_us=10.0),
    ]
    ratios = runner.ratios(rows)
    assert ratios["c/floor"] == pytest.approx(0.75)
    assert ratios["c cpu/floor"] == pytest.approx(2.0)
    assert ratios["c pg/floor"] == pytest.approx(12.0 / 9.0)
    assert ratios["c1 cpu/floor"] == pytest.approx(2.0)
    assert ratios["floor cpu/lean"] == pytest.approx(4.0)
    assert ratios["floor/hand"] == pytest.approx(2.0)
    assert ratios["floor pg/hand"] == pytest.approx(0.9)
    assert ratios["floor p99/hand"] == pytest.approx(1.0)
    assert not [name for name in ratios if name.startswith(("m", "mn"))]
    assert {"floor/hand", "c cpu/floor"} <= set(report._SHOWN)


def test_the_floor_reads_its_messages_from_their_ack_subjects() -> None:
    """(m) takes a delivery's stream sequence and timestamp from its reply subject, in both
    of the server's formats."""
    plain = "$JS.ACK.S.d.1.42.40.1700000000000000000.7"
    domain = "$JS.ACK.dom.hash.S.d.1.43.41.1700000000500000000.6.tok"
    at = datetime.datetime.fromtimestamp(1_700_000_000, datetime.timezone.utc)
    assert floor.floor_row("d", plain) == ("d", 42, at)
    assert floor.floor_row("d", domain) == ("d", 43, at + datetime.timedelta(seconds=0.5))


class _FakeConn:
    def __init__(self, sent: list[tuple[object, ...]]) -> None:
        self.sent = sent

    def transaction(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()  # type: ignore[return-value]

    async def execute(self, *args: object) -> None:
        self.sent.append(args)


class _FakePool:
    def __init__(self) -> None:
        self.sent: list[tuple[object, ...]] = []

    @contextlib.asynccontextmanager
    async def acquire(self) -> Any:
        yield _FakeConn(self.sent)


class _FakeJs:
    def __init__(self) -> None:
        self.floor = 0

    async def consumer_info(self, stream: str, durable: str) -> Any:
        return SimpleNamespace(ack_floor=SimpleNamespace(stream_seq=self.floor))


async def test_bounded_hand_written_inbox_deletes_up_to_the_ack_floor_every_so_often() -> None:
    """(hb) deletes nothing before HAND_BOUND_EVERY messages settled; then it deletes the
    rows above the previous floor and at or below the consumer's ack floor, each range
    once, and nothing when the floor did not move."""
    js, pool = _FakeJs(), _FakePool()
    bound = baselines.HandBound("S", "d")
    js.floor = 900
    bound.settled(js, pool, baselines.HAND_BOUND_EVERY - 1)
    assert bound.running is None
    bound.settled(js, pool, 1)
    assert bound.running is not None
    await bound.running
    js.floor = 2_100
    bound.settled(js, pool, baselines.HAND_BOUND_EVERY)
    await bound.running
    bound.settled(js, pool, baselines.HAND_BOUND_EVERY)  # the floor stayed at 2,100
    await bound.running
    assert [args[1:] for args in pool.sent] == [("S", 0, 900), ("S", 900, 2_100)]
    assert all(str(args[0]).startswith("DELETE FROM bench_hand_inbox") for args in pool.sent)
