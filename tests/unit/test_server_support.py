"""The nats-server versions eop accepts (eop.broker.server)."""

from __future__ import annotations

import types

import pytest

import eop
from eop.broker import server


def _connected(version: str) -> types.SimpleNamespace:
    from nats.aio.client import ServerVersion

    return types.SimpleNamespace(connected_server_version=ServerVersion(version))


@pytest.mark.parametrize("version", ["2.10.0", "2.10.26", "2.12.8", "2.15.1", "3.0.0"])
def test_2_10_and_newer_are_accepted(version: str) -> None:
    """Every minor from 2.10 on is accepted, and a later major too."""
    server.check_supported(_connected(version), "nats://here")  # type: ignore[arg-type]


def test_an_older_server_is_refused_naming_its_version_and_the_fix() -> None:
    """2.9.10: one sentence with the version, where it is, the minimum and the fix."""
    with pytest.raises(eop.ConfigurationError) as refused:
        server.check_supported(_connected("2.9.10"), "nats://old:4222")  # type: ignore[arg-type]
    assert str(refused.value).startswith("nats-server 2.9.10 at nats://old:4222 is too old")
    assert "2.10 or newer" in str(refused.value)
    assert "Upgrade the server" in str(refused.value)


def test_an_unknown_version_is_not_refused() -> None:
    """Before the server's INFO nats-py says 0.0.0: nothing to judge, nothing refused."""
    assert server.version_of(_connected("0.0.0-unknown")) is None  # type: ignore[arg-type]
    server.check_supported(_connected("0.0.0-unknown"), "nats://here")  # type: ignore[arg-type]
