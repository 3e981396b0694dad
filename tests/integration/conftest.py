"""Fixtures shared by the integration tests that run `eop` as subprocesses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .test_cli import Workers, eop_env


@pytest.fixture
def workers(database_url: str, nats_url: str, tmp_path: Path) -> Iterator[Workers]:
    """A pool of `eop worker` subprocesses on the test's servers, killed if still running."""
    pool = Workers(eop_env(database_url, nats_url), tmp_path)
    yield pool
    for proc in pool.procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
