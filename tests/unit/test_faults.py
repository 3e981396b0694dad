"""Fault points: the EOP_FAULTS syntax, disarmed no-ops, each action, and who may arm them."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from eop import cli, errors, faults, log
from eop.tools.chaos import armed

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _disarmed() -> Iterator[None]:
    faults.disarm()
    yield
    faults.disarm()


def test_parse_reads_probability_nth_and_durations() -> None:
    """`POINT=ACTION[:S](@P|#N)` rules parse into Rules, and render back the same."""
    spec = "after_commit=kill#40,mid_handler=stall:6@0.01,during_ack=kill:0.004#3"
    rules = faults.parse(spec)
    assert rules == [
        faults.Rule("after_commit", "kill", nth=40),
        faults.Rule("mid_handler", "stall", 6.0, probability=0.01),
        faults.Rule("during_ack", "kill", 0.004, nth=3),
    ]
    assert ",".join(r.render() for r in rules) == spec


@pytest.mark.parametrize(
    "spec",
    ["nowhere=kill@0.1", "after_ack=explode@0.1", "after_ack=kill@2", "after_ack=kill#0", "x"],
)
def test_parse_rejects_unknown_points_actions_and_odds(spec: str) -> None:
    """A typo in EOP_FAULTS is a configuration error, not a silently disarmed point."""
    with pytest.raises(errors.ConfigurationError):
        faults.parse(spec)


async def test_disarmed_points_do_nothing() -> None:
    """Without EOP_FAULTS, every point returns at once and nothing is armed."""
    faults.arm_from_env({})
    assert not faults.armed()
    for point in faults.POINTS:
        await faults.point(point)


def test_ruled_tells_the_points_an_armed_rule_names() -> None:
    """`ruled(point)`: whether passing that point can do anything (code may skip it if not)."""
    assert not any(faults.ruled(p) for p in faults.POINTS)
    faults.arm(faults.parse("during_ack=kill:0.004#3,after_claim=raise@0.01"), seed=1)
    assert {p for p in faults.POINTS if faults.ruled(p)} == {"during_ack", "after_claim"}
    faults.disarm()
    assert not faults.ruled("during_ack")


async def test_raise_fires_exactly_at_the_nth_pass() -> None:
    """`#N` fires once, at the Nth pass of that point, and never again."""
    faults.arm(faults.parse("after_claim=raise#3"), seed=1)
    await faults.point("after_claim")
    await faults.point("after_commit")  # other points do not count
    await faults.point("after_claim")
    with pytest.raises(faults.FaultInjected):
        await faults.point("after_claim")
    for _ in range(10):
        await faults.point("after_claim")


async def test_probability_is_reproducible_from_the_seed() -> None:
    """The same EOP_FAULT_SEED fires at the same passes."""

    async def firings(seed: int) -> list[int]:
        faults.arm(faults.parse("before_commit=raise@0.3"), seed=seed)
        fired = []
        for i in range(50):
            try:
                await faults.point("before_commit")
            except faults.FaultInjected:
                fired.append(i)
        return fired

    first = await firings(7)
    assert first == await firings(7)
    assert 0 < len(first) < 50


async def test_stall_sleeps_without_blocking_the_loop() -> None:
    """`stall` suspends only the delivery at the point (it awaits, the loop runs on)."""
    faults.arm(faults.parse("after_claim=stall:0.01#1"), seed=1)
    await faults.point("after_claim")


def test_kill_logs_the_hit_then_sigkills_the_process() -> None:
    """`kill` ends the process with SIGKILL, after its `fault.hit` line reached the log."""
    code = (
        "import asyncio; from eop import faults, log; log.configure('json');"
        "faults.arm_from_env(); asyncio.run(faults.point('after_commit'));"
        "print('survived', flush=True)"
    )
    env = dict(os.environ, EOP_FAULTS="after_commit=kill#1", EOP_FAULT_SEED="5")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == -signal.SIGKILL
    assert '"event": "fault.hit"' in result.stderr
    assert '"point": "after_commit"' in result.stderr
    assert "survived" not in result.stdout


def test_delayed_kill_lets_the_code_go_on_until_the_timer() -> None:
    """`kill:S` returns at once and kills from a timer: a crash during the next step."""
    code = (
        "import asyncio, time; from eop import faults;"
        "faults.arm_from_env(); asyncio.run(faults.point('during_ack'));"
        "print('went on', flush=True); time.sleep(30)"
    )
    env = dict(os.environ, EOP_FAULTS="during_ack=kill:0.2#1", EOP_FAULT_SEED="5")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == -signal.SIGKILL
    assert "went on" in result.stdout


def test_warn_if_ignored_speaks_only_of_a_set_variable_left_disarmed() -> None:
    """`fault.ignored` once when EOP_FAULTS is set and nothing armed; silent when unset,
    blank, or armed (the chaos entry point armed it: nothing is ignored)."""
    with capture_logs() as logs:
        faults.warn_if_ignored({})
        faults.warn_if_ignored({faults.FAULTS_VAR: " "})
        faults.warn_if_ignored({faults.FAULTS_VAR: "after_commit=kill#1"})
        faults.arm(faults.parse("after_commit=kill#1"), seed=1)
        faults.warn_if_ignored({faults.FAULTS_VAR: "after_commit=kill#1"})
    ignored = [e for e in logs if e["event"] == log.Event.FAULT_IGNORED]
    assert [(e["log_level"], e["variable"]) for e in ignored] == [("warning", "EOP_FAULTS")]


@pytest.mark.parametrize(
    "argv", [["worker", "no_such_module_xyz:app"], ["relay", "--app", "no_such_module_xyz:app"]]
)
def test_eop_worker_and_relay_never_arm_from_the_environment(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stray EOP_FAULTS in production arms nothing in `eop worker` or `eop relay`
    (it could SIGKILL them); each says once that it ignores the variable."""
    monkeypatch.setenv(faults.FAULTS_VAR, "after_commit=kill#1")
    assert cli.main(argv) == 1  # the app cannot be imported: the start got that far
    assert not faults.armed()
    assert capsys.readouterr().err.count("fault.ignored") == 1


def test_the_chaos_entry_point_arms_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m eop.tools.chaos.armed worker ...` arms EOP_FAULTS with EOP_FAULT_SEED before
    the command runs, and says nothing of ignoring them."""
    monkeypatch.setenv(faults.FAULTS_VAR, "after_commit=kill#1")
    monkeypatch.setenv(faults.SEED_VAR, "5")
    assert armed.main(["worker", "no_such_module_xyz:app"]) == 1
    assert faults.ruled("after_commit")
    err = capsys.readouterr().err
    assert "fault.armed" in err
    assert "fault.ignored" not in err


def test_the_chaos_entry_point_reports_a_bad_rule_as_eop_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo in EOP_FAULTS ends the armed command with status 1 and one `eop: error:`
    line naming the variable, not a traceback nor a silently disarmed worker."""
    monkeypatch.setenv(faults.FAULTS_VAR, "after_comit=kill#1")
    assert armed.main(["worker", "no_such_module_xyz:app"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("eop: error: EOP_FAULTS")
    assert "Traceback" not in err
    assert not faults.armed()


def test_only_the_chaos_entry_point_arms_from_the_environment() -> None:
    """No module of eop but eop.tools.chaos.armed calls `arm_from_env`: `eop worker` and
    `eop relay` (and whatever else runs in production) cannot be armed by a variable."""
    callers = sorted(
        {
            str(path.relative_to(ROOT))
            for path in (ROOT / "eop").rglob("*.py")
            if path != ROOT / "eop" / "faults.py"
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if (isinstance(node, ast.Attribute) and node.attr == "arm_from_env")
            or (isinstance(node, ast.Name) and node.id == "arm_from_env")
            or (isinstance(node, ast.alias) and node.name == "arm_from_env")
        }
    )
    assert callers == ["eop/tools/chaos/armed.py"]
