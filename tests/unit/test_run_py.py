"""run.py's install step: which extras each command installs, and when it installs.

``python3 run.py demo`` installs eop with only its ``embedded`` extra; every other
command installs ``dev``. Both share one virtualenv, whose stamp records the
extras installed: a demo after a test run installs nothing, a test run after a
demo installs the rest. Nothing is really installed here: pip's calls are recorded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself requires tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def load_run_py() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("eop_run_py", ROOT / "run.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run = load_run_py()


def optional_dependencies() -> dict[str, list[str]]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        extras: dict[str, list[str]] = tomllib.load(f)["project"]["optional-dependencies"]
    return extras


class FakeVenv(run.Venv):  # type: ignore[misc,name-defined]
    """A Venv whose python and eop exist on paper and whose pip calls are only recorded."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.bin.mkdir(parents=True)
        self.tool("eop").touch()
        self.pip_installs: list[str] = []

    def usable(self) -> bool:
        return True

    def call(self, command: list[str | Path], *, capture: bool = False) -> int:
        args = [str(part) for part in command]
        if "-e" in args:
            self.pip_installs.append(args[args.index("-e") + 1])
        return 0


@pytest.fixture
def venv(tmp_path: Path) -> FakeVenv:
    return FakeVenv(tmp_path / "venv")


def run_command(venv: FakeVenv, command: str, *, reinstall: bool = False) -> list[str]:
    """Run ``command``'s install step; the specs pip installed."""
    venv.pip_installs.clear()
    venv.ensure(run.command_extras(command), force_install=reinstall)
    return list(venv.pip_installs)


def test_the_demo_installs_only_the_embedded_extra_and_every_other_command_dev() -> None:
    for command in run.COMMANDS:
        expected = ".[embedded]" if command == "demo" else ".[dev]"
        assert run.install_spec(frozenset(run.command_extras(command))) == expected, command


def test_the_extras_run_py_names_exist_and_dev_pulls_in_what_it_says() -> None:
    """INCLUDED_EXTRAS mirrors pyproject.toml: were `dev` to drop "eop[embedded]", a demo
    after a test run would find the embedded servers missing."""
    extras = optional_dependencies()
    for name in (*run.DEV_EXTRAS, *run.DEMO_EXTRAS):
        assert name in extras
    for extra, included in run.INCLUDED_EXTRAS.items():
        for name in included:
            assert f"eop[{name}]" in extras[extra]


def test_a_fresh_virtualenv_gets_the_demo_s_extra_only_for_the_demo(venv: FakeVenv) -> None:
    assert run_command(venv, "demo") == [".[embedded]"]
    assert run_command(venv, "demo") == []


def test_a_test_run_after_the_demo_installs_dev_and_a_demo_after_that_nothing(
    venv: FakeVenv,
) -> None:
    assert run_command(venv, "demo") == [".[embedded]"]
    assert run_command(venv, "test") == [".[dev]"]
    assert run_command(venv, "demo") == []
    assert run_command(venv, "lint") == []


def test_a_demo_after_a_test_run_installs_nothing(venv: FakeVenv) -> None:
    assert run_command(venv, "test") == [".[dev]"]
    for command in ("demo", "chaos-servers", "pytest", "demo"):
        assert run_command(venv, command) == [], command


def test_a_changed_pyproject_reinstalls_every_extra_installed_before(venv: FakeVenv) -> None:
    """A demo never narrows the virtualenv's record: the next test run would reinstall."""
    assert run_command(venv, "test") == [".[dev]"]
    recorded = json.loads(venv.stamp.read_text())
    recorded["pyproject_sha256"] = hashlib.sha256(b"an older pyproject.toml").hexdigest()
    venv.stamp.write_text(json.dumps(recorded))
    assert run_command(venv, "demo") == [".[dev]"]
    assert run_command(venv, "test") == []


def test_reinstall_keeps_the_extras_installed_before(venv: FakeVenv) -> None:
    assert run_command(venv, "test") == [".[dev]"]
    assert run_command(venv, "demo", reinstall=True) == [".[dev]"]


def test_a_stamp_written_before_the_demo_had_its_own_install_still_counts(
    venv: FakeVenv,
) -> None:
    """The stamp every existing virtualenv has: the same keys, spec ".[dev]"."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    old = {"pyproject_sha256": digest, "spec": ".[dev]", "root": str(run.ROOT)}
    venv.stamp.write_text(json.dumps(old, sort_keys=True))
    assert run_command(venv, "test") == []
    assert run_command(venv, "demo") == []


def test_another_checkout_s_install_is_redone_for_this_one(venv: FakeVenv) -> None:
    """EOP_VENV may be shared: the editable install must point at this checkout."""
    assert run_command(venv, "demo") == [".[embedded]"]
    recorded = json.loads(venv.stamp.read_text())
    venv.stamp.write_text(json.dumps({**recorded, "root": "/elsewhere/eop"}))
    assert run_command(venv, "demo") == [".[embedded]"]


def test_an_unreadable_stamp_means_not_installed(venv: FakeVenv) -> None:
    venv.stamp.write_text("not json")
    assert run_command(venv, "demo") == [".[embedded]"]
    venv.stamp.write_text("[]")
    assert run_command(venv, "test") == [".[dev]"]


def test_a_failed_install_leaves_no_stamp(venv: FakeVenv, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next run installs again instead of trusting a half-installed virtualenv."""
    assert run_command(venv, "demo") == [".[embedded]"]
    monkeypatch.setattr(venv, "call", lambda command, *, capture=False: 1)
    with pytest.raises(run.RunError, match=r'pip install -e "\.\[dev\]" failed'):
        run_command(venv, "test")
    assert not venv.stamp.exists()
