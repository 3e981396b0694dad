"""The chaos harness's pure parts: wire framing, the seeded schedule, the checker."""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from eop import cli, errors, faults
from eop.tools.chaos import bank, checker, publisher, report, schedule, wire
from eop.tools.chaos.target import Payload


def _split(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), 5))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def test_nats_framer_finds_frames_whatever_the_chunking() -> None:
    """Frames come out whole (ops with their payloads), however the bytes were cut."""
    stream = (
        b"PUB $JS.ACK.S.c.1.2.3.4.0 _INBOX.a.b 0\r\n\r\n"
        b"HPUB x _INBOX.c 12 17\r\nNATS/1.0\r\n\r\nhello\r\n"
        b"PING\r\n"
        b"MSG _INBOX.a.b 1 4\r\nab\r\n\r\n"
    )
    rng = random.Random(1)
    for _ in range(20):
        framer = wire.NatsFramer()
        frames = [f for chunk in _split(stream, rng) for f in framer.feed(chunk)]
        assert [f.kind for f in frames] == [b"PUB", b"HPUB", b"PING", b"MSG"]
        assert b"".join(f.raw for f in frames) == stream
    assert wire.nats_ack_reply_subject(frames[0]) == b"_INBOX.a.b"
    assert wire.nats_ack_reply_subject(frames[1]) is None
    assert wire.nats_delivery_subject(frames[3]) == b"_INBOX.a.b"


def _pg(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("!i", len(body) + 4) + body


def test_pg_framer_follows_ssl_request_startup_and_typed_messages() -> None:
    """The client's untyped start, the server's one-byte SSL answer, then typed messages."""
    ssl = struct.pack("!ii", 8, wire.SSL_REQUEST_CODE)
    params = b"user\x00postgres\x00\x00"
    startup = struct.pack("!ii", 8 + len(params), 196608) + params
    client, server = wire.PgFramer(client=True), wire.PgFramer(client=False)
    client.peer = server
    sent = client.feed(ssl + startup + _pg(b"Q", b"COMMIT;\x00"))
    assert len(sent) == 3
    assert wire.pg_is_commit(sent[2])
    received = server.feed(b"N" + _pg(b"C", b"COMMIT\x00") + _pg(b"Z", b"I"))
    assert [f.kind for f in received] == [b"", b"C", b"Z"]
    assert wire.pg_ends_command(received[1])
    assert not wire.pg_is_commit(wire.Frame(b"Q", b"", (b"SELECT 1\x00",)))


def test_schedule_is_a_function_of_the_seed() -> None:
    """The same seed gives the same faults at the same offsets; another seed does not."""
    shape = {"mean_gap_s": 0.3, "workers": 3, "ack_wait_s": 4.0}
    first = schedule.build(5, 60, **shape)
    assert first == schedule.build(5, 60, **shape)
    assert first != schedule.build(6, 60, **shape)
    assert len(first) > 100
    assert {f.kind for f in first} <= set(schedule.KINDS)


def test_outages_of_one_server_never_overlap() -> None:
    """Two outages of the same server are never scheduled at once."""
    faults_ = schedule.build(9, 600, mean_gap_s=0.2, workers=3, ack_wait_s=4.0)
    ends: dict[str, float] = {}
    for fault in faults_:
        if fault.kind.startswith(("nats_kill", "nats_restart", "pg_restart", "pg_crash")):
            resource = fault.kind.split("_")[0]
            assert fault.at_s >= ends.get(resource, 0.0)
            ends[resource] = fault.at_s + fault.duration_s


def test_worker_plan_arms_its_kill_point_and_renders_to_env() -> None:
    """A worker plan kills at the chosen point and arms through EOP_FAULTS."""
    [after_commit] = [s for s in schedule.HANDLER_SPOTS if s.name == "after_commit"]
    plan = schedule.worker_plan(3, 0, [after_commit], ack_wait_s=4.0)
    assert plan.kill_point == "after_commit"
    assert plan.spots == ("after_commit",)
    parsed = faults.parse(plan.env()[faults.FAULTS_VAR])
    assert parsed == list(plan.rules)


def test_relay_kill_spots_are_told_apart_by_their_timer() -> None:
    """A staller of the pipeline also dies at a relay spot; a kill from a timer started at
    relay_after_publish (during the mark) is counted apart from one at the point itself,
    and the classic evidence never asks for relay kills (the bank has no outbox)."""
    during_mark = schedule.RELAY_SPOTS[1]
    plan = schedule.worker_plan(3, 1, [during_mark], ack_wait_s=4.0, stall=True)
    assert plan.staller
    assert plan.spots == ("relay_during_mark",)
    assert "relay_after_publish=kill:0.05#" in plan.env()[faults.FAULTS_VAR]
    assert schedule.spot_name("relay_after_publish", 0.05) == "relay_during_mark"
    assert schedule.spot_name("relay_after_publish", 0.0) == "relay_after_publish"
    assert schedule.spot_name("during_ack", 0.004) == "during_ack"
    ev = checker.LogEvidence()
    ev.kills.update({"relay_during_mark": 2, "after_ack": 1})
    assert not any("relay" in label for label in checker.missing_evidence(checker.evidence(ev)))
    spots = (*schedule.HANDLER_SPOTS, *schedule.RELAY_SPOTS)
    missing = checker.missing_evidence(checker.evidence(ev, spots), spots, races=False)
    assert "kills at relay_after_mark" in missing
    assert "kills at relay_during_mark" not in missing
    assert "ambiguous commits" not in missing


def test_consumer_is_recreated_at_most_once_a_minute() -> None:
    """A recreated consumer replays the stream: a long run must not do nothing but replay."""
    recreations = [
        f.at_s
        for f in schedule.build(4, 1800, mean_gap_s=0.2, workers=3, ack_wait_s=4.0)
        if f.kind == "consumer_recreate"
    ]
    assert len(recreations) > 5
    assert all(b - a >= 60.0 for a, b in itertools.pairwise(recreations))


def test_stall_plan_holds_the_first_claims_past_ack_wait() -> None:
    """The drain's staller freezes at its first two claims for twice AckWait (a live
    worker would renew their leases), then runs calm."""
    plan = schedule.stall_plan(3, 7, ack_wait_s=4.0)
    assert plan.kill_point is None
    assert [(r.point, r.action, r.nth) for r in plan.rules] == [
        ("after_claim", "freeze", n) for n in range(1, 3)
    ]
    assert all(r.seconds == 8.0 for r in plan.rules)
    assert faults.parse(plan.env()[faults.FAULTS_VAR]) == list(plan.rules)


def test_publish_plan_republishes_some_inside_and_some_after_the_window() -> None:
    """Every payload is sent; some twice at once, some again after the duplicate window."""
    payloads = [bank.make_payload(i, random.Random(i)) for i in range(1000)]
    sends = publisher.plan(payloads, 1, 60.0, 2.0)
    assert {s.payload.key for s in sends} == {p.key for p in payloads}
    assert any(s.late for s in sends)
    assert len(sends) > len(payloads) + sum(1 for s in sends if s.late)


def test_checker_classifies_each_message() -> None:
    """One effect (or one dead letter for poison) is right; anything else is named."""
    good = [Payload(k, b"{}") for k in ("ok", "lost", "twice", "dead")]
    poison = [Payload("p-ok", b"x", poison=True), Payload("p-lost", b"x", poison=True)]
    out = checker.check_outcomes(
        [*good, *poison],
        {"ok": 1, "twice": 2, "stranger": 1},
        {"dead": ["attempts_exhausted"], "p-ok": ["rejected"], "nobody": ["rejected"]},
    )
    assert out.exactly_once == 1
    assert out.poison_dead_lettered == 1
    assert out.lost == ["lost", "p-lost"]
    assert out.duplicated == ["twice: 2 effects, dead letters []"]
    assert out.dead_lettered == ["dead: attempts_exhausted"]
    assert len(out.unexpected) == 2


def test_log_scan_counts_events_and_finds_canaries_without_printing_them(tmp_path: Path) -> None:
    """Events and fault hits are counted; a canary is reported by name, never by value."""
    log = tmp_path / "worker-0000.log"
    lines = [
        {"event": "fault.hit", "point": "after_ack", "action": "kill"},
        {"event": "fault.hit", "point": "relay_after_publish", "action": "kill", "seconds": 0.05},
        {"event": "message.duplicate", "by": "msg_id", "handler": "h2"},
        {"event": "commit.ambiguous"},
        {"event": "message.processed", "note": "sekrit-value"},
    ]
    log.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"event": "cut sh')
    ev = checker.scan_logs([log], {"db password": "sekrit-value"})
    assert ev.fault_hits["after_ack:kill"] == 1
    assert ev.events["commit.ambiguous"] == 1
    assert ev.leaks == ["worker-0000.log:5: db password"]
    assert ev.kills == {"after_ack": 1, "relay_during_mark": 1}
    assert ev.guard_skips == {"h2": 1}
    found = checker.evidence(ev)
    assert found["kills at after_ack"] == 1
    assert "kills at after_fetch" in checker.missing_evidence(found)


def test_log_scan_lists_stuck_deliveries_and_the_report_counts_them(tmp_path: Path) -> None:
    """Each ``delivery.stuck`` a worker logged is listed, and counted in the report."""
    log = tmp_path / "worker-0003.log"
    stuck = {
        "event": "delivery.stuck",
        "seq": 17,
        "consumer": "eop-chaos",
        "waited_s": 31.5,
        "stuck_after_s": 30.0,
    }
    log.write_text(json.dumps(stuck) + "\n")
    ev = checker.scan_logs([log], {})
    assert ev.stuck == ["worker-0003.log: seq 17 of eop-chaos unacknowledged for 31.5 s (> 30.0 s)"]
    found = report.Report(seed=1, command="eop chaos", messages=1, logs=ev)
    assert found.to_dict()["stuck_deliveries"] == 1


def test_a_delivery_still_stuck_past_its_bound_after_the_heal_is_a_stall(
    tmp_path: Path,
) -> None:
    """A stuck delivery's wait runs from its start until any worker settles it (or its
    own worker saw it end); while faults run they explain it, but one unacknowledged
    for longer than its bound once every fault was healed is a stall and fails the run.
    One whose end no log shows is left to the drain."""
    log = tmp_path / "worker-0001.log"
    lines = [
        {
            "event": "delivery.stuck",
            "handler": "chaos",
            "seq": 5,
            "consumer": "eop-chaos",
            "waited_s": 13.0,
            "stuck_after_s": 12.0,
            "timestamp": "2026-11-28T10:00:00Z",
        },
        {
            "event": "delivery.unstuck",
            "consumer": "eop-chaos",
            "timestamp": "2026-11-28T10:00:30Z",
        },
        {
            "event": "delivery.stuck",
            "handler": "chaos-bank",
            "seq": 9,
            "consumer": "eop-chaos-bank",
            "waited_s": 12.5,
            "stuck_after_s": 12.0,
            "timestamp": "2026-11-28T10:00:40Z",
        },
    ]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ev = checker.scan_logs([log], {})
    first, second = ev.stuck_waits
    assert (first.waited_s, first.resolved, second.resolved) == (43.0, True, False)
    judged = report.Report(seed=1, command="eop chaos", messages=1, logs=ev)
    assert judged.stuck_after_heal == []
    # Healed 10 s after the report: 20 s of the wait came after it, more than 12 s.
    judged.healed_at = "2026-11-28T10:00:10+00:00"
    assert judged.stuck_after_heal == [
        "worker-0001.log: seq 5 of eop-chaos unacknowledged for 43.0 s, 20.0 s of them "
        "after every fault was healed (stuck after 12 s)"
    ]
    assert judged.stalls == [f"stuck: {judged.stuck_after_heal[0]}"]
    assert not judged.ok
    # Healed 20 s after it: 10 s after the heal, within the bound.
    judged.healed_at = "2026-11-28T10:00:20+00:00"
    assert judged.stuck_after_heal == []
    assert judged.to_dict()["stuck_after_heal"] == 0
    assert judged.ok


def test_a_stuck_wait_ends_when_any_worker_settles_it_and_calm_waits_for_late_faults(
    tmp_path: Path,
) -> None:
    """The wait of a delivery whose reporting worker ended first ends at the first
    settlement any worker logged for its sequence; and a fault point that fired after
    the heal (a drain worker held its claims) moves calm to the end of that fault."""
    reporter = tmp_path / "worker-0002.log"
    reporter.write_text(
        json.dumps(
            {
                "event": "delivery.stuck",
                "handler": "chaos-bank",
                "seq": 12,
                "consumer": "eop-chaos-bank",
                "waited_s": 20.0,
                "stuck_after_s": 12.0,
                "timestamp": "2026-11-28T10:00:20Z",
            }
        )
        + "\n"
    )
    settler = tmp_path / "worker-0003.log"
    settled = {"event": "message.processed", "handler": "chaos-bank", "seq": 12}
    frozen = {"event": "fault.hit", "point": "after_claim", "action": "freeze", "seconds": 8.0}
    settler.write_text(
        json.dumps({**frozen, "timestamp": "2026-11-28T10:00:05Z"})
        + "\n"
        + json.dumps({**settled, "timestamp": "2026-11-28T10:00:30Z"})
        + "\n"
    )
    ev = checker.scan_logs([reporter, settler], {})
    assert not ev.stuck_waits[0].resolved
    # Healed at 10:00:00, the freeze ended at 10:00:13: settled 17 s into calm.
    assert checker.stuck_stalls(ev, "2026-11-28T10:00:00+00:00") == [
        "worker-0002.log: seq 12 of eop-chaos-bank unacknowledged for 30.0 s, 17.0 s of "
        "them after every fault was healed (stuck after 12 s)"
    ]
    # A freeze that ended at 10:00:21 leaves 9 s of calm: within the bound.
    frozen["timestamp"] = "2026-11-28T10:00:13Z"
    settler.write_text(
        json.dumps(frozen) + "\n" + json.dumps({**settled, "timestamp": "2026-11-28T10:00:30Z"})
    )
    ev = checker.scan_logs([reporter, settler], {})
    assert checker.stuck_stalls(ev, "2026-11-28T10:00:00+00:00") == []


def test_chaos_command_names_its_variables_and_refuses_half_a_target(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`eop chaos --help` shows EOP_CHAOS_* variables; --app without the rest is an error."""
    with pytest.raises(SystemExit):
        cli.main(["chaos", "--help"])
    assert "EOP_CHAOS_SEED" in capsys.readouterr().out
    assert cli.main(["chaos", "--app", "myapp:app"]) == 2
    assert "--app needs --handler" in capsys.readouterr().err


def test_a_bad_chaos_variable_is_one_sentence_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """EOP_CHAOS_* values follow the settings' rules; a bad one is not a traceback."""
    monkeypatch.setenv("EOP_CHAOS_WORKERS", "three")
    with pytest.raises(SystemExit) as exited:
        cli.build_parser("chaos")
    assert exited.value.code == 1
    assert capsys.readouterr().err == (
        "eop: error: chaos_workers (EOP_CHAOS_WORKERS) must be a whole number, not 'three'\n"
    )
    monkeypatch.setenv("EOP_CHAOS_WORKERS", "5")
    assert cli.build_parser("chaos").parse_args(["chaos"]).workers == 5


_SLOW_STARTER = """
import signal, sys, time
time.sleep(0.5)  # importing, before any SIGTERM handler exists
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with open(sys.argv[1], "a") as log:
    log.write('{"event": "worker.starting"}\\n')
time.sleep(60)
"""


def test_the_final_stop_waits_for_a_new_worker_to_install_its_handlers(tmp_path: Path) -> None:
    """A worker still importing is not SIGTERMed to death: it stops cleanly (exit 0)."""
    from eop.tools.chaos import workers

    pool = workers.WorkerPool(
        app="x:app", handlers=["h"], env={}, log_dir=tmp_path, count=1, seed=1, ack_wait_s=4.0
    )
    log = tmp_path / "worker-0000.log"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_STARTER, str(log)])
    inc = workers.Incarnation(0, 0, proc, schedule.WorkerPlan((), 1), log)
    pool.incarnations.append(inc)
    pool.slots[0] = inc
    assert pool.stop_all(timeout_s=10.0) == {0: 0}


def test_pool_workers_run_the_armed_entry_point_and_arm_their_plan(tmp_path: Path) -> None:
    """A chaos worker is `python -m eop.tools.chaos.armed worker ...`, not `eop worker` (which
    never arms): its log shows its plan's rules armed, before it fails to import the app."""
    from eop.tools.chaos import armed, workers

    env = {**os.environ, "EOP_LOG_FORMAT": "json"}
    pool = workers.WorkerPool(
        app="no_such_module_xyz:app",
        handlers=["h"],
        env=env,
        log_dir=tmp_path,
        count=1,
        seed=1,
        ack_wait_s=4.0,
    )
    pool.start()
    [inc] = pool.incarnations
    assert inc.proc.args[1:4] == ["-m", armed.MODULE, "worker"]
    assert inc.proc.wait(60) == 1
    [line] = [x for x in inc.log.read_text().splitlines() if '"fault.armed"' in x]
    assert faults.parse(json.loads(line)["faults"]) == list(inc.plan.rules)
    assert inc.plan.kill_point is not None


def test_a_good_message_dead_lettered_fails_the_verdict() -> None:
    """Never zero times: a good message that ends as a dead letter (whatever the reason,
    e.g. a lock timeout in its handler) fails the run, and is counted by reason."""
    from eop.tools.chaos.report import Report

    payloads = [Payload("ok", b"{}"), Payload("locked", b"{}"), Payload("p", b"x", poison=True)]
    report = Report(seed=1, command="eop chaos", messages=3)
    report.outcomes = checker.check_outcomes(
        payloads, {"ok": 1}, {"locked": ["attempts_exhausted"], "p": ["rejected"]}
    )
    assert not report.ok
    assert report.problems == ["dead-lettered good message: locked: attempts_exhausted"]
    assert report.outcomes.good_dead_by_reason == {"attempts_exhausted": 1}
    assert report.outcomes.poison_dead_by_reason == {"rejected": 1}
    assert "dead letters of good messages attempts_exhausted 1" in report.render()
    report.outcomes = checker.check_outcomes(payloads, {"ok": 1, "locked": 1}, {"p": ["rejected"]})
    assert report.ok, report.problems


def test_a_worker_stop_over_grace_plus_5_s_fails_the_verdict() -> None:
    """A worker that takes longer than shutdown_grace_s + 5 s to exit after SIGTERM, or
    never exits, is a stall: named with its worker number and pid, and the run fails."""
    from eop.tools.chaos.report import Report

    report = Report(seed=1, command="eop chaos", messages=0, stop_limit_s=13.0)
    stop = functools.partial(checker.Stop, limit_s=13.0)
    report.stops = [stop(worker=3, pid=4242, when="final", seconds=12.9, code=0)]
    assert report.ok, report.problems
    report.stops.append(stop(worker=4, pid=4343, when="mid-run", seconds=13.2, code=0))
    report.stops.append(stop(worker=5, pid=4444, when="heal", seconds=18.0, code=None))
    assert not report.ok
    assert report.problems == [
        "stall: worker 4 (pid 4343) took 13.2 s to exit after SIGTERM (mid-run; limit 13 s)",
        "stall: worker 5 (pid 4444) did not exit within 18.0 s of SIGTERM (heal; limit 13 s); "
        "SIGKILLed",
    ]
    assert "stop of worker 5 (pid 4444, heal): 18.0 s" in report.render()


def test_a_stop_over_the_base_limit_within_its_injected_stall_passes_and_says_why() -> None:
    """A worker whose fault plan injects a stall has that much longer to exit: its stop
    passes, and the report's line of stops names the longer limit beside the base one."""
    from eop.tools.chaos.report import Report

    report = Report(seed=1, command="eop chaos", messages=0, stop_limit_s=13.0)
    report.stops = [
        checker.Stop(worker=1, pid=1, when="final", seconds=12.0, code=0, limit_s=13.0),
        checker.Stop(worker=2, pid=2, when="mid-run", seconds=13.7, code=0, limit_s=16.0),
    ]
    assert report.ok, report.problems
    assert (
        "max 13.7 s (limit 13 s, up to 16 s for a worker whose faults inject a stall or a "
        "freeze)" in report.render()
    )
    report.stops.pop()
    assert "max 12.0 s (limit 13 s)" in report.render()


def test_a_drain_that_does_not_finish_is_a_stall() -> None:
    """The liveness failure (no drain by the deadline) is counted among the stalls."""
    from eop.tools.chaos.report import Report

    report = Report(seed=1, command="eop chaos", messages=0)
    report.liveness = "the consumer did not drain within 25 s after healing"
    assert report.stalls == [f"liveness: {report.liveness}"]
    assert not report.ok


_IGNORES_SIGTERM = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1], "a") as log:
    log.write('{"event": "worker.starting"}\\n')
time.sleep(60)
"""


def test_a_worker_that_ignores_sigterm_is_timed_and_killed(tmp_path: Path) -> None:
    """The final stop times each worker; one still running at the timeout is SIGKILLed
    and its stop recorded without an exit status (a stall)."""
    from eop.tools.chaos import workers

    pool = workers.WorkerPool(
        app="x:app",
        handlers=["h"],
        env={"EOP_SHUTDOWN_GRACE_S": "0"},
        log_dir=tmp_path,
        count=1,
        seed=1,
        ack_wait_s=4.0,
    )
    log = tmp_path / "worker-0000.log"
    proc = subprocess.Popen([sys.executable, "-c", _IGNORES_SIGTERM, str(log)])
    inc = workers.Incarnation(0, 0, proc, schedule.WorkerPlan((), 1), log)
    pool.incarnations.append(inc)
    pool.slots[0] = inc
    assert pool.stop_limit_s == 5.0
    assert pool.stop_all(timeout_s=1.0) == {0: -9}
    [stop] = pool.stops
    assert (stop.worker, stop.pid, stop.code, stop.when) == (0, proc.pid, None, "final")
    assert checker.check_stops(pool.stops)


def test_each_scenario_meets_its_fault_early_whatever_the_seed() -> None:
    """A hunt's required fault is scheduled once in the first half of the phase; the classic mix
    never schedules a hunt, the mixed one does."""
    from eop.tools.chaos import scenarios

    for name in scenarios.HUNTS:
        scenario = scenarios.get(name)
        for seed in range(5):
            faults_ = schedule.build(
                seed,
                8.0,
                mean_gap_s=0.5,
                workers=2,
                ack_wait_s=4.0,
                weights=dict(scenario.weights),
                required=scenario.required,
            )
            for kind in scenario.required:
                assert any(f.kind == kind and f.at_s <= 8.0 / 2 for f in faults_), (name, seed)
            assert {f.kind for f in faults_} <= set(scenario.weights) | set(scenario.required)
    hunt_kinds = set(schedule.HUNT_WEIGHTS)
    classic = schedule.build(5, 600, mean_gap_s=0.3, workers=3, ack_wait_s=4.0)
    assert not {f.kind for f in classic} & hunt_kinds
    mixed = schedule.build(
        5, 600, mean_gap_s=0.3, workers=3, ack_wait_s=4.0, weights=scenarios.get("mixed").weights
    )
    assert hunt_kinds <= {f.kind for f in mixed}


def test_outages_outlast_the_attempts_budget_of_the_workers_settings() -> None:
    """The long outage, the read-only window and the held locks last longer than
    max_attempts x (backoff_max_s + lock timeout + in-process retries)."""
    from eop.tools.chaos import scenarios

    env = {"EOP_MAX_ATTEMPTS": "5", "EOP_BACKOFF_MAX_S": "1", "EOP_TX_RETRIES": "2"}
    env |= {"EOP_LOCK_TIMEOUT_S": "1", "EOP_STATEMENT_TIMEOUT_S": "10"}
    budget = scenarios.attempts_budget_s(env)
    assert budget > 5 * 1.0
    shape = schedule.Shape(attempts_budget_s=budget)
    for kind in ("pg_outage_long", "pg_read_only", "row_lock_hold"):
        [fault] = schedule.build(
            1, 10, mean_gap_s=1, workers=2, ack_wait_s=4, weights={}, required=(kind,), shape=shape
        )
        assert fault.duration_s >= budget


def test_an_unknown_scenario_is_one_sentence() -> None:
    """`eop chaos --scenario nope` names the scenarios instead of starting servers."""
    assert cli.main(["chaos", "--scenario", "nope"]) == 1


def test_a_long_msg_id_is_shortened_in_report_lines() -> None:
    """A 5,000-character msg-id appears in a problem line by its ends and length."""
    key = "L" + "x" * 4999
    out = checker.check_outcomes([Payload(key, b"{}")], {}, {})
    assert out.lost == [f"L{'x' * 19}...{'x' * 12} (5000 chars)"]


def test_each_stage_of_a_pipeline_settles_what_enters_it_and_the_good_ones_before() -> None:
    """A message entering at stage 0 must take effect in both stages, a poison one only be
    dead-lettered in the first; one entering at stage 1 (an order sent straight to B)
    takes effect in the second only."""
    a, poison = Payload("a", b"{}"), Payload("p", b"x", poison=True)
    b = Payload("b", b"{}", stage=1)
    assert checker.planned_at([a, poison, b], 0) == [a, poison]
    assert checker.planned_at([a, poison, b], 1) == [a, b]
    second = checker.check_outcomes(checker.planned_at([a, poison, b], 1), {"a": 1, "p": 1}, {})
    assert second.lost == ["b"]
    assert second.unexpected == ["1 effects of unknown key 'p'"]


def test_the_outbox_check_counts_copies_and_names_what_went_wrong() -> None:
    """Every row must be published, in its stream at its sequence; copies sent again are
    counted and absorbed when their key has one effect downstream; a parked, pending,
    missing or doubled row, or a copy that took effect twice, is a problem."""
    from eop.tools.chaos import relayed

    def row(i: int, key: str, seq: int | None, **kw: object) -> relayed.Row:
        fields: dict[str, object] = {
            "id": i,
            "msg_id": f"m{i}",
            "subject": "b.new",
            "key": key,
            "published": seq is not None,
            "parked": None,
            "stream": "B" if seq is not None else None,
            "stream_seq": seq,
        }
        fields.update(kw)
        return relayed.Row(**fields)  # type: ignore[arg-type]

    rows = [
        row(1, "k1", 1),
        row(2, "k2", 2),
        row(3, "k3", 3),
        row(4, "k4", None),
        row(5, "k5", None, parked="no_stream"),
        row(6, "k6", 9),
        row(7, "k1", 4),
    ]
    stored = [relayed.Stored(n, m) for n, m in [(1, "m1"), (2, "m2"), (3, "m3"), (4, "m7")]]
    stored += [relayed.Stored(5, "m2"), relayed.Stored(6, "m3"), relayed.Stored(7, "m3")]
    v = relayed.check(rows, {"B": stored}, {"B": [{"k1": 1, "k2": 1, "k3": 2}]})
    assert (v.rows, v.published, v.absorbed, v.extra_copies) == (7, 5, 1, 3)
    assert v.copies == {"m2": 2, "m3": 3}
    assert v.parked == ["id 5 (b.new, key k5): no_stream"]
    assert v.pending == ["id 4 (b.new, key k4)"]
    assert v.missing == ["id 6 (b.new, key k6) in B"]
    assert v.doubled == ["key k1 to b.new: rows 1 and 7"]
    assert v.not_absorbed == ["id 3 (b.new, key k3): stored 3 times, effects [2]"]
    assert len(v.problems) == 5


def test_a_stopping_worker_is_never_paused(tmp_path: Path) -> None:
    """worker_stop does not SIGSTOP a worker the harness is stopping (a mid-run SIGTERM):
    a frozen process cannot exit, and its timed stop would count the pause as a stall."""
    from eop.tools.chaos import workers

    pool = workers.WorkerPool(
        app="x:app", handlers=["h"], env={}, log_dir=tmp_path, count=1, seed=1, ack_wait_s=4.0
    )
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    inc = workers.Incarnation(0, 0, proc, schedule.WorkerPlan((), 1), tmp_path / "w.log")
    pool.incarnations.append(inc)
    pool.slots[0] = inc
    try:
        pool.send_term(inc)
        assert pool.pause(0) is None
    finally:
        proc.kill()
        proc.wait()


def test_a_self_killed_worker_is_credited_with_the_spot_it_died_at(tmp_path: Path) -> None:
    """A worker armed at two spots (a delivery's and the relay's) is credited with the one
    its log says fired last, a timer's kill included (lines follow it)."""
    from eop.tools.chaos import workers

    log = tmp_path / "worker-0000.log"
    lines = [
        {"event": "fault.hit", "point": "after_claim", "action": "stall", "seconds": 8},
        {"event": "fault.hit", "point": "relay_after_publish", "action": "kill", "seconds": 0.05},
        {"event": "outbox.published"},
    ]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    inc = workers.Incarnation(0, 0, proc, schedule.WorkerPlan((), 1), log)
    assert workers._killed_at(inc) == "relay_during_mark"


def test_the_cluster_scenario_runs_three_servers_and_only_through_its_own_runner() -> None:
    """`--scenario cluster` is no hunt; it runs 3 nats-servers without fault points, and
    the single-server harness refuses it (one sentence) before starting anything."""
    from eop.tools.chaos import harness, scenarios

    scenario = scenarios.get("cluster")
    assert scenario.nats_nodes == 3
    assert "cluster" not in scenarios.HUNTS
    assert not scenario.arm_workers
    with pytest.raises(errors.ConfigurationError, match="runs a NATS cluster"):
        harness.run(harness.Config(scenario="cluster"))


def test_leader_kill_figures_say_who_died_and_how_long_elections_took() -> None:
    """The cluster run's figures: each kill (role, server, whether it led both), the
    election times and the time until every server was healthy, measured not asserted."""
    from eop.tools.chaos.cluster import Kill, kill_figures

    figures = kill_figures(
        [Kill("stream", "n2", False, 4.0, 1.5), Kill("consumer", "n1", True, None, 2.5)]
    )
    assert figures["leader kills"] == "stream leader n2, consumer leader n1 (both)"
    assert figures["new leader after a kill"] == "median 4.0 s, max 4.0 s (1 not within 30 s)"
    assert figures["all servers healthy after a restart"] == "median 2.0 s, max 2.5 s"
