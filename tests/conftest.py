"""The test bed: real PostgreSQL and nats-server, isolated per test.

- PostgreSQL: one throwaway server per session (or the server of
  ``EOP_TEST_DATABASE_URL``), one template database migrated once, and a fresh
  clone of it per test.
- NATS: one nats-server per test, on a free port with a temporary store.

Both come from eop's pytest plugin (``pytest_eop``, the fixtures users get);
the names here are the bed's own, kept for its tests.

Tests under ``tests/integration`` and ``tests/django`` get the ``integration``
marker. A missing server binary skips the tests that need it, except under
``CI=true`` where it fails them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import nats
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from eop import errors
from eop.testing import servers
from eop.tools import embedded
from pytest_eop import unavailable

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator

    from nats.aio.client import Client as NATS
    from nats.js import JetStreamContext
    from sqlalchemy.ext.asyncio import AsyncEngine

# pytester: the tests of eop's pytest plugin run pytest on a user's test file.
pytest_plugins = ["pytester"]

IN_CI = os.environ.get("CI", "").lower() in ("true", "1")
INTEGRATION_DIRS = (Path(__file__).parent / "integration", Path(__file__).parent / "django")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under tests/integration and tests/django as `integration`."""
    for item in items:
        if any(d in item.path.parents for d in INTEGRATION_DIRS):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def postgres(eop_postgres: embedded.PostgresCluster) -> embedded.PostgresCluster:
    """The session's PostgreSQL: a throwaway server, or EOP_TEST_DATABASE_URL's."""
    return eop_postgres


@pytest.fixture(scope="session")
def template_database(eop_template_database: str) -> str:
    """Name of a database migrated to head once per session, cloned by each test."""
    return eop_template_database


@pytest.fixture
def database_url(eop_database_url: str) -> str:
    """asyncpg URL of a fresh database with eop's tables at head, dropped after the test."""
    return eop_database_url


@pytest.fixture
def empty_database_url(postgres: embedded.PostgresCluster) -> Iterator[str]:
    """asyncpg URL of a fresh database without eop's tables, dropped after the test."""
    name = servers.unique_name("eop_test_empty")
    url = postgres.create_database(name, template="template0")
    yield url
    postgres.drop_database(name)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """An async engine on the test's database, disposed after the test."""
    engine = create_async_engine(database_url)
    yield engine
    await engine.dispose()


@pytest.fixture
def make_postgres_server() -> Iterator[Callable[..., embedded.PostgresServer]]:
    """Factory of extra PostgreSQL servers (for tests that stop or kill one), closed after."""
    servers: list[embedded.PostgresServer] = []

    def make(**options: object) -> embedded.PostgresServer:
        try:
            server = embedded.PostgresServer(**options)  # type: ignore[arg-type]
        except errors.ServerBinaryNotFound as exc:
            unavailable(str(exc))
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def nats_server(eop_nats_server: embedded.NatsServer) -> embedded.NatsServer:
    """A nats-server with JetStream for this test alone, with a temporary file store."""
    return eop_nats_server


@pytest.fixture
def nats_url(nats_server: embedded.NatsServer) -> str:
    """The test's nats-server URL."""
    return nats_server.url


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    """A nats-py client connected to the test's server, closed after the test."""
    client = await nats.connect(nats_url, connect_timeout=2, allow_reconnect=True)
    yield client
    await client.close()


@pytest.fixture
def js(nc: NATS) -> JetStreamContext:
    """The JetStream context of :func:`nc`."""
    return nc.jetstream()


# -- hypothesis (the fuzz tests): a fixed, derandomized profile in CI, so a run is repeatable.
try:
    from hypothesis import HealthCheck
    from hypothesis import settings as hypothesis_settings
except ImportError:  # the dev extra brings it; without it the fuzz tests are skipped
    pass
else:
    hypothesis_settings.register_profile(
        "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    hypothesis_settings.register_profile("dev", deadline=None)
    hypothesis_settings.load_profile("ci" if IN_CI else "dev")
