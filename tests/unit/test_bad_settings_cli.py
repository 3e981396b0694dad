"""Bad settings stop every ``eop`` command with one ``eop: error:`` line, never a traceback.

The real command line in a subprocess: the refusal comes before any server is
reached, so these tests need none.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APP = "examples.quickstart.app:app"

#: Every family of commands; each bad value below is tried with one of them, in turn.
COMMANDS = [
    ["worker", APP],
    ["db", "upgrade"],
    ["status", APP],
    ["dlq", "list"],
    ["relay", "--app", APP],
    ["audit", APP],
    ["outbox", "status", "--app", APP],
    ["dlq", "show", "1"],
]

#: (variable, bad value, what the error line must say)
BAD_ENVIRONMENT = [
    ("EOP_SCHEMA", "eop'x", "lowercase PostgreSQL name"),
    ("EOP_SCHEMA", "eop;drop", "lowercase PostgreSQL name"),
    ("EOP_SCHEMA", "eop x", "lowercase PostgreSQL name"),
    ("EOP_SCHEMA", "", "lowercase PostgreSQL name"),
    ("EOP_SCHEMA", "e" * 64, "at most 63 bytes"),
    ("EOP_SCHEMA", "Eop", "lowercase PostgreSQL name"),
    ("EOP_CONCURRENCY", "lots", "whole number"),
    ("EOP_CONCURRENCY", "0", "at least 1"),
    ("EOP_ACK_WAIT_S", "-1", "0 or more"),
    ("EOP_ACK_WAIT_S", "inf", "finite"),
    ("EOP_CREATE", "maybe", "true or false"),
    ("EOP_LOG_FORMAT", "xml", "one of console, json"),
    ("EOP_LOG_LEVEL", "loud", "one of debug"),
    ("EOP_DATABASE_URL", "mysql://root:pw-9c1@db/x", "PostgreSQL URL"),
    ("EOP_DATABASE_URL", "not a url", "must be a URL"),
    ("EOP_DATABASE_URL", "postgresql+nodriver://u:pw-9c1@db/x", "installed asyncio driver"),
    ("EOP_DATABASE_URL", "postgresql+pg8000://u:pw-9c1@db/x", "installed asyncio driver"),
    ("EOP_NATS_URL", "http://nats:4222", "NATS server URLs"),
    ("EOP_METRICS_PORT", "70000", "at most 65535"),
    ("EOP_METRICS_HOST", "two words", "IP address"),
    ("EOP_PROCESSES", "-2", "0 or more"),
]

CASES = [
    pytest.param(var, raw, rule, argv, id=f"{var}={raw[:12]!r}-{argv[0]}")
    for (var, raw, rule), argv in zip(BAD_ENVIRONMENT, itertools.cycle(COMMANDS), strict=False)
]


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EOP_")}
    return subprocess.run(
        [sys.executable, "-m", "eop", *argv],
        env={**clean, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _assert_one_error_line(result: subprocess.CompletedProcess[str], *must_say: str) -> str:
    assert result.returncode in (1, 2), result
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("eop: error: "), lines[0]
    for text in must_say:
        assert text in lines[0]
    return lines[0]


@pytest.mark.parametrize(("var", "raw", "rule", "argv"), CASES)
def test_a_bad_environment_variable_is_one_line_naming_it_and_its_rule(
    var: str, raw: str, rule: str, argv: list[str]
) -> None:
    """Each bad EOP_ value, each command in turn: exit 1, one line naming the
    variable and the rule, no traceback, and no password echoed."""
    line = _assert_one_error_line(_run(argv, {var: raw}), var, rule)
    assert "pw-9c1" not in line


@pytest.mark.parametrize(
    ("argv", "flag", "rule"),
    [
        (["db", "upgrade", "--schema", "eop;drop"], "EOP_SCHEMA", "lowercase PostgreSQL name"),
        (["dlq", "list", "--schema", "E" * 70], "EOP_SCHEMA", "lowercase PostgreSQL name"),
        (["worker", APP, "--concurrency", "lots"], "--concurrency", "whole number"),
        (["worker", APP, "--ack-wait-s", "-5"], "EOP_ACK_WAIT_S", "0 or more"),
        (["status", APP, "--nats-url", "http://x"], "EOP_NATS_URL", "NATS server URLs"),
        (["relay", "--app", APP, "--outbox-batch", "0"], "EOP_OUTBOX_BATCH", "at least 1"),
        (["worker", APP, "--log-format", "xml"], "--log-format", "invalid choice"),
        (["audit", APP, "--from-seq", "5", "--to-seq", "2"], "--to-seq 2", "nothing to walk"),
        (["audit", APP, "--stuck-after-s", "-1"], "--stuck-after-s", "above 0"),
        (["dlq", "list", "--app", APP, "--handler", "nosuch"], "'nosuch'", "it has: audit"),
        (["dlq", "purge", "--app", APP, "--handler", "no", "--yes"], "'no'", "leave --app out"),
    ],
)
def test_a_bad_flag_is_one_line_naming_the_setting_and_its_rule(
    argv: list[str], flag: str, rule: str
) -> None:
    """A bad value given as a flag: one line naming the flag or the setting, no traceback."""
    _assert_one_error_line(_run(argv, {}), flag, rule)
