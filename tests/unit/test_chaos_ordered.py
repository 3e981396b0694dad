"""The ``ordered`` chaos scenario's parts without servers: payloads, order check, scaling."""

from __future__ import annotations

import collections
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eop.tools.chaos import checker, ordered, scenarios, schedule, workers
from eop.tools.chaos.report import Report
from eop.tools.chaos.target import Payload


def _payloads(count: int) -> list[Payload]:
    return [ordered.make_payload(i, random.Random(i)) for i in range(count)]


def test_each_account_gets_its_steps_in_publish_order_and_garbage_takes_no_step() -> None:
    """Per account, the steps are 1, 2, 3... in the order they are published, on the
    account's own subject (token 1); garbage (undecodable and rejected) is poison with no
    step, and the step published after it names it; some steps fail their first delivery."""
    payloads = _payloads(2000)
    steps: dict[str, list[int]] = collections.defaultdict(list)
    previous: dict[str, Payload] = {}
    kinds = collections.Counter()
    for p in payloads:
        assert p.subject is not None
        account = p.subject.split(".")[1]
        before = previous.get(account)
        previous[account] = p
        if p.poison:
            kinds["undecodable" if p.data.startswith(b"\xff") else "rejected"] += 1
            continue
        body = json.loads(p.data)
        assert body["account"] == account
        assert p.key == body["id"]
        steps[account].append(body["step"])
        after = before.key if before is not None and before.poison else None
        assert body["after"] == after
        kinds["fail first"] += bool(body["fail_first"])
    assert len(steps) == len(ordered.ACCOUNTS)
    assert all(s == list(range(1, len(s) + 1)) for s in steps.values())
    assert kinds["undecodable"] > 0
    assert kinds["rejected"] > 0
    assert kinds["fail first"] > 0
    # Bursts: a key's next message is often the very next one published.
    assert (
        payloads[0].subject
        == payloads[ordered.BURST - 1].subject
        != payloads[ordered.BURST].subject
    )


def test_steps_committed_in_order_pass_and_every_kind_of_violation_is_counted() -> None:
    """Commit order 1, 2, 3 per key is clean; a step ahead of an earlier one is a gap,
    the earlier one after it an inversion, a step again is counted too, and a step that ran
    before the dead letter published ahead of it committed is a violation of its own."""
    clean = checker.check_order([("a", 1, True), ("b", 1, True), ("a", 2, True), ("b", 2, True)])
    assert (clean.keys, clean.effects, clean.violations) == (2, 4, [])
    rows = [("a", 1, True), ("a", 3, True), ("a", 2, True), ("a", 4, False), ("a", 4, True)]
    verdict = checker.check_order(rows)
    assert (verdict.ahead, verdict.behind, verdict.unsettled) == (1, 2, 1)
    assert verdict.violations == [
        "a: step 3 committed while step 2 had not (gap)",
        "a: step 2 committed after step 3 (inversion or duplicate)",
        "a: step 4 ran before the dead letter published ahead of it committed",
        "a: step 4 committed after step 4 (inversion or duplicate)",
    ]


def test_an_order_violation_fails_the_verdict_and_is_reported() -> None:
    """A run with exactly-once intact but one step out of order fails; the report counts it
    (order_violations in the JSON, a line in the rendering)."""
    report = Report(seed=3, command="eop chaos --scenario ordered", messages=2)
    report.order = checker.check_order([("a", 2, True), ("a", 1, True)])
    assert not report.ok
    assert report.problems[0] == "order: a: step 2 committed while step 1 had not (gap)"
    assert report.to_dict()["order_violations"] == 2
    assert "order violations 2 (2 effects of 1 keys in commit order)" in report.render()
    report.order = checker.check_order([("a", 1, True), ("a", 2, True)])
    assert report.ok, report.problems


def test_the_ordered_scenario_scales_one_to_three_to_two_and_stops_past_ack_wait() -> None:
    """The scripted faults: one worker command at first, killed while alone, three from a
    quarter of the phase, two from 65 %; its SIGSTOPs past AckWait always outlast it; NATS
    and PostgreSQL restart in every run; the second command runs with --processes 2."""
    scenario = scenarios.get("ordered")
    assert scenario.initial_workers == 1
    script = schedule.timeline(5, 20.0, scenario.timeline, ack_wait_s=4.0)
    assert [(f.at_s, f.kind, f.target) for f in script] == [
        (2.0, "worker_kill", 0),
        (5.0, "scale_workers", 3),
        (13.0, "scale_workers", 2),
    ]
    assert {"worker_stop_long", "nats_restart", "pg_restart"} <= set(scenario.required)
    drawn = schedule.build(
        5, 600, mean_gap_s=1.5, workers=3, ack_wait_s=4.0, weights=scenario.weights
    )
    stops = [f for f in drawn if f.kind == "worker_stop_long"]
    assert stops
    assert all(f.duration_s > 4.0 for f in stops)
    assert scenario.slot_args(1) == ("--processes", "2")
    assert scenario.slot_args(0) == ()
    assert "ordered" not in scenarios.HUNTS


def _sleeper(tmp_path: Path, pool: workers.WorkerPool, slot: int) -> workers.Incarnation:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    log = tmp_path / f"w{slot}.log"
    log.write_text('{"event": "worker.starting"}\n')
    inc = workers.Incarnation(slot, slot, proc, schedule.WorkerPlan((), 1), log)
    pool.incarnations.append(inc)
    pool.slots[slot] = inc
    return inc


def test_scaling_down_stops_the_slots_beyond_and_faults_hit_the_ones_left(
    tmp_path: Path,
) -> None:
    """scale(1) SIGTERMs the worker beyond the first slot and returns it to be timed, poll
    does not replace it, and a kill aimed at slot 1 then hits slot 0 (the pool is smaller)."""
    pool = workers.WorkerPool(
        app="x:app", handlers=["h"], env={}, log_dir=tmp_path, count=2, seed=1, ack_wait_s=4.0
    )
    first, second = _sleeper(tmp_path, pool, 0), _sleeper(tmp_path, pool, 1)
    try:
        assert pool.scale(1) == [second]
        assert second.proc.wait(10) == -signal.SIGTERM
        pool.poll()
        assert pool.slots[1] is None
        assert len(pool.incarnations) == 2
        assert pool.kill(1)
        assert first.proc.wait(10) == -signal.SIGKILL
    finally:
        pool.close()


_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="process groups are POSIX")
def test_a_worker_command_with_processes_is_killed_with_its_children(tmp_path: Path) -> None:
    """A slot given --processes N leads a process group of its own: SIGKILL reaches its
    children too (a supervisor's children would otherwise outlive it, SIGTERMed)."""
    spawning = workers.WorkerPool(
        app="x:app",
        handlers=["h"],
        env={},
        log_dir=tmp_path,
        count=1,
        seed=1,
        ack_wait_s=4.0,
        slot_args=lambda slot: ("--processes", "2"),
    )
    spawned = spawning._spawn(0)
    spawning.close()
    assert spawned.group
    assert spawned.proc.args[-2:] == ["--processes", "2"]
    pool = workers.WorkerPool(
        app="x:app", handlers=["h"], env={}, log_dir=tmp_path, count=1, seed=1, ack_wait_s=4.0
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    plan = schedule.WorkerPlan((), 1)
    inc = workers.Incarnation(0, 0, proc, plan, tmp_path / "w.log", group=True)
    pool.incarnations.append(inc)
    pool.slots[0] = inc
    assert pool.kill(0)
    assert proc.wait(10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.split(")")[-1].split()[0] != "Z"
