"""Fault points: the EOP_FAULTS syntax, disarmed no-ops, and each action."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from eop import errors, faults


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
