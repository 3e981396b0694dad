"""The worker's event loop: uvloop when installed and allowed, asyncio's otherwise."""

from __future__ import annotations

import asyncio

import pytest

from eop.runtime import eventloop
from eop.settings import Settings


async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_uses_uvloop_when_installed_and_allowed() -> None:
    pytest.importorskip("uvloop")
    assert eventloop.run(loop_module()).startswith("uvloop")


def test_run_uses_asyncio_when_uvloop_is_switched_off() -> None:
    assert eventloop.run(loop_module(), use_uvloop=False).startswith("asyncio")


def test_uvloop_setting_comes_from_the_environment() -> None:
    assert Settings().uvloop is True
    assert Settings.from_env({"EOP_UVLOOP": "0"}).uvloop is False
