"""The eop command line: flags named after their EOP_* variables, clear errors."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import uuid
from pathlib import Path

import pytest

from eop import cli, errors
from eop import settings as settings_mod
from eop.app import App
from eop.cli import options
from eop.settings import Settings, env_var


def subcommand(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[name]
    return parser


def flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: action for action in parser._actions for opt in action.option_strings}


def flag_of(field: str) -> str:
    return "--" + field.replace("_", "-")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No EOP_* variable of the developer's shell leaks into these tests."""
    for name in [n for n in os.environ if n.startswith("EOP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "path", list(sys.path))


# --------------------------------------------------------------------- flags


@pytest.mark.parametrize("field", cli.WORKER_FIELDS)
def test_every_worker_flag_help_names_its_variable(field: str) -> None:
    worker = subcommand(cli.build_parser(), "worker")
    action = flags(worker)[flag_of(field)]
    assert action.help is not None
    assert f"[env: {env_var(field)};" in action.help
    assert "``" not in action.help, "reST markup of the docs shown raw in --help"


def test_every_setting_is_a_worker_flag() -> None:
    """Every setting but the secrets (environment only: command lines are public)."""
    worker = flags(subcommand(cli.build_parser(), "worker"))
    for field in dataclasses.fields(Settings):
        if field.name in settings_mod.SECRET_FIELDS:
            assert flag_of(field.name) not in worker, field.name
        else:
            assert flag_of(field.name) in worker, field.name


@pytest.mark.parametrize("action", ["upgrade", "downgrade", "current", "check"])
def test_db_flags_name_their_variables(action: str) -> None:
    db = flags(subcommand(cli.build_parser(), "db", action))
    assert "EOP_DATABASE_URL" in (db["--database-url"].help or "")
    assert "EOP_SCHEMA" in (db["--schema"].help or "")
    assert "EOP_APP" in (db["--app"].help or "")


def test_worker_help_lists_the_variables(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["worker", "--help"])
    out = capsys.readouterr().out
    for field in cli.WORKER_FIELDS:
        assert env_var(field) in out


def test_unset_worker_flags_leave_the_environment_in_charge() -> None:
    args = cli.build_parser().parse_args(["worker", "m:app"])
    assert cli.overrides(args, cli.WORKER_FIELDS) == {}


def test_worker_flags_are_typed() -> None:
    args = cli.build_parser().parse_args(
        ["worker", "m:app", "--ack-wait-s", "5", "--concurrency", "3", "--no-create"]
    )
    assert cli.overrides(args, cli.WORKER_FIELDS) == {
        "ack_wait_s": 5.0,
        "concurrency": 3,
        "create": False,
    }


def test_worker_handler_flag_repeats() -> None:
    args = cli.build_parser().parse_args(["worker", "m:app", "--handler", "a", "--handler", "b"])
    assert args.handler == ["a", "b"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["worker", "m:app"], None),
        (["--log-level", "debug", "worker", "m:app"], "debug"),
        (["worker", "m:app", "--log-level", "debug"], "debug"),
        (["worker", "--log-level", "debug", "m:app"], "debug"),
        (["--log-level", "error", "worker", "m:app", "--log-level", "debug"], "debug"),
        (["db", "upgrade", "--log-level", "warning"], "warning"),
    ],
)
def test_log_flags_work_before_and_after_the_subcommand(
    argv: list[str], expected: str | None
) -> None:
    assert cli.build_parser().parse_args(argv).log_level == expected


def test_a_log_flag_before_the_subcommand_survives_the_subcommand() -> None:
    args = cli.build_parser().parse_args(["--log-format", "json", "worker", "m:app"])
    assert args.log_format == "json"


def test_an_invalid_choice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["worker", "m:app", "--log-level", "loud"])
    assert "invalid choice" in capsys.readouterr().err


def test_db_revision_defaults() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["db", "upgrade"]).revision == "head"
    assert parser.parse_args(["db", "downgrade"]).revision == "-1"


# ------------------------------------------------------------------- load_app


@pytest.fixture
def app_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module in the current directory defining ``app`` (an eop.App) and ``other``."""
    name = f"eop_unit_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "from eop import App, Settings\napp = App(settings=Settings())\nother = 42\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_load_app_imports_from_the_current_directory(app_module: str) -> None:
    assert isinstance(cli.load_app(f"{app_module}:app"), App)


@pytest.mark.parametrize("path", ["myapp", "myapp:", ":app", ""])
def test_load_app_wants_module_colon_attribute(path: str) -> None:
    with pytest.raises(errors.ConfigurationError, match="expected MODULE:APP"):
        cli.load_app(path)


def test_load_app_reports_a_missing_module() -> None:
    with pytest.raises(errors.ConfigurationError, match="cannot import 'no_such_module_xyz'"):
        cli.load_app("no_such_module_xyz:app")


def test_load_app_reports_an_attribute_that_is_not_an_app(app_module: str) -> None:
    with pytest.raises(errors.ConfigurationError, match=r"is not an eop\.App \(got int\)"):
        cli.load_app(f"{app_module}:other")


def test_load_app_reports_a_missing_attribute(app_module: str) -> None:
    """A mistyped attribute is named as missing, not reported as 'got NoneType'."""
    with pytest.raises(errors.ConfigurationError, match="has no attribute 'nope'"):
        cli.load_app(f"{app_module}:nope")


# ----------------------------------------------------------------------- main


def test_main_prints_the_error_and_its_cause_without_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["worker", "no_such_module_xyz:app"]) == 1
    err = capsys.readouterr().err
    # The cause (ModuleNotFoundError) says nothing the line does not: one line.
    assert err == "eop: error: cannot import 'no_such_module_xyz': No module named " + (
        "'no_such_module_xyz'\n"
    )


def test_print_error_keeps_only_the_causes_that_add_to_the_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A refused login wrapped three times (driver, SQLAlchemy, eop) is one line; a cause
    with words of its own is still printed under it."""

    class InvalidAuthorizationSpecificationError(Exception):
        pass

    class DBAPIError(Exception):
        pass

    driver = InvalidAuthorizationSpecificationError('role "nobody" does not exist')
    wrapped = DBAPIError(
        '(sqlalchemy.dialects.postgresql.asyncpg.Error) role "nobody" does not exist'
    )
    wrapped.__cause__ = driver
    refused = errors.DatabaseLoginRefused(
        'PostgreSQL at x refused the connection: role "nobody" does not exist'
    )
    refused.__cause__ = wrapped
    options.print_error(refused, as_json=False)
    assert capsys.readouterr().err == (
        'eop: error: PostgreSQL at x refused the connection: role "nobody" does not exist\n'
    )

    other = errors.ConfigurationError("cannot load the app")
    other.__cause__ = ValueError("bad literal in settings.py")
    options.print_error(other, as_json=False)
    assert capsys.readouterr().err == (
        "eop: error: cannot load the app\n  caused by ValueError: bad literal in settings.py\n"
    )


def test_main_reports_a_bad_environment_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EOP_CONCURRENCY", "lots")
    assert cli.main(["worker", "m:app"]) == 1
    err = capsys.readouterr().err
    assert "EOP_CONCURRENCY" in err
    assert "not 'lots'" in err


def test_print_error_in_json_is_one_command_failed_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With JSON logs a command's last words are a JSON line like the others: the event
    `command.failed` at level error, the error, and the causes that add to it."""
    other = errors.ConfigurationError("cannot load the app")
    other.__cause__ = ValueError("bad literal in settings.py")
    options.print_error(other, as_json=True)
    (line,) = capsys.readouterr().err.splitlines()
    entry = json.loads(line)
    assert entry["event"] == "command.failed"
    assert entry["level"] == "error"
    assert entry["error"] == "cannot load the app"
    assert entry["caused_by"] == ["ValueError: bad literal in settings.py"]
    assert entry["pid"] == os.getpid()
    assert entry["timestamp"].endswith("Z")


@pytest.mark.parametrize(
    ("env", "argv"),
    [({"EOP_LOG_FORMAT": "json"}, []), ({}, ["--log-format", "json"])],
)
def test_main_reports_a_refused_setting_as_json_when_json_is_asked(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    argv: list[str],
) -> None:
    """A setting refused before logging is configured still ends in a JSON line when the
    environment or the command line asks for JSON lines."""
    monkeypatch.setenv("EOP_CONCURRENCY", "lots")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main([*argv, "worker", "m:app"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    entry = json.loads(line)
    assert entry["event"] == "command.failed"
    assert "EOP_CONCURRENCY" in entry["error"]


def test_a_usage_error_is_a_json_line_when_json_is_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """argparse's refusals (a bad flag value, a missing MODULE:APP) follow --log-format
    json like every other last word: one command.failed line, status 2."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["--log-format", "json", "worker", "m:app", "--processes", "lots"])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    entry = json.loads(line)
    assert entry["event"] == "command.failed"
    assert "--processes" in entry["error"]


@pytest.mark.parametrize("flag", ["--since", "--until"])
def test_a_dead_letter_time_eop_cannot_read_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """``eop dlq list --since soon`` is refused as argparse refuses a malformed flag: one
    line naming the flag and the forms it takes, status 2, before any database is asked."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["dlq", "list", flag, "soon", "--database-url", "postgresql+asyncpg://x@h:1/d"])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"eop: error: argument {flag}: 'soon' is neither an ISO time")
    assert "duration (2h, 30m, 7d)" in line


def test_an_app_module_that_raises_on_import_is_one_line_naming_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The user's module fails while imported: one `eop: error:` line with the module,
    the file and line, and the error; no traceback."""
    (tmp_path / "raising_app_mod.py").write_text('import eop\nraise RuntimeError("boom")\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["worker", "raising_app_mod:app"]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"eop: error: importing 'raising_app_mod' failed at {tmp_path / 'raising_app_mod.py'}, "
        "line 2: RuntimeError: boom\n"
    )


def test_a_url_password_in_an_app_modules_import_error_is_masked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The module's error quotes a URL with its password (a connection made at import):
    the one line shows the URL without it."""
    (tmp_path / "url_app_mod.py").write_text(
        'raise ConnectionError("no postgresql://app:S3cr3t-pw@10.0.0.1/db")\n'
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["worker", "url_app_mod:app"]) == 1
    err = capsys.readouterr().err
    assert "S3cr3t-pw" not in err
    assert err.endswith("ConnectionError: no postgresql://app:***@10.0.0.1/db\n")
