"""The worker's event loop: uvloop when installed and allowed, asyncio's otherwise."""

from __future__ import annotations

import asyncio

import asyncpg
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


@pytest.mark.parametrize("use_uvloop", [True, False])
def test_an_exception_nobody_retrieved_is_logged_described_not_printed_plainly(
    use_uvloop: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """asyncio's default handler would print the plain traceback (bound values
    included); eop's logs loop.error with the described, scrubbed error."""
    import gc

    import structlog

    secret = "CANARY-e1f0"

    async def fail() -> None:
        # As asyncpg raises it: its DataError from the encoder's ValueError.
        raise asyncpg.exceptions.DataError(
            f"invalid input for query argument $1: '{secret}' (not an int)"
        ) from ValueError(f"invalid literal for int() with base 10: '{secret}'")

    async def main() -> None:
        task = asyncio.ensure_future(fail())
        await asyncio.sleep(0.01)
        del task
        gc.collect()

    with structlog.testing.capture_logs() as logs:
        eventloop.run(main(), use_uvloop=use_uvloop)
    [line] = [e for e in logs if e["event"] == "loop.error"]
    assert "never retrieved" in line["what"]
    assert line["error"] == "DataError: invalid input for query argument $1: *** (not an int)"
    assert secret not in str(logs)
    assert secret not in capsys.readouterr().err
