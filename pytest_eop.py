"""eop's pytest plugin: fixtures for testing eop apps against real, throwaway servers.

pytest loads it in every run of every project where eop is installed (the
``pytest11`` entry point ``eop``), so it stays light: this module imports
pytest only, registers no autouse fixture and no hook that does anything, and
imports eop and starts a server only when a test asks for one of its
fixtures. Their names start with ``eop_``:

- ``eop_postgres`` (session): a throwaway PostgreSQL from the ``embedded``
  extra, or the server of ``EOP_TEST_DATABASE_URL``;
- ``eop_template_database`` (session): a database migrated once (eop's tables
  in ``eop_schema``, plus your tables: ``eop_metadata`` or ``eop_prepare_database``);
- ``eop_database_url``, ``eop_engine``: a fresh copy of it per test;
- ``eop_nats_server``, ``eop_nats_url``, ``eop_nats``, ``eop_jetstream``: a
  nats-server with JetStream per test, and a client connected to it;
- ``eop_app`` (the ``eop_app = module:app`` ini option, or your own fixture)
  and ``eop_test_app``: ``eop.testing.TestApp`` on the test's database.

Without the server binaries a test using them is skipped, except under
``CI=true`` where it fails. The async fixtures need pytest-asyncio
(``pip install 'eop[testing]'``). See docs/testing.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import pytest

try:
    import pytest_asyncio
except ImportError:  # the async fixtures then fail with the way out
    pytest_asyncio = None  # type: ignore[assignment]  # the module, or None without it

if TYPE_CHECKING:
    import sqlalchemy as sa
    from nats.aio.client import Client as NATS
    from nats.js import JetStreamContext
    from sqlalchemy.ext.asyncio import AsyncEngine

    from eop import App
    from eop.testing import TestApp
    from eop.tools import embedded

F = TypeVar("F", bound=Callable[..., Any])


def _async_fixture(func: F) -> F:
    """An async fixture through pytest-asyncio (strict or auto mode alike)."""
    if pytest_asyncio is not None:
        return pytest_asyncio.fixture(func)  # type: ignore[return-value]  # typed as its own, not F

    @functools.wraps(func, assigned=("__name__", "__qualname__", "__doc__"))
    def missing() -> NoReturn:
        pytest.fail(
            f"the fixture {func.__name__} needs pytest-asyncio: pip install 'eop[testing]'",
            pytrace=False,
        )

    return pytest.fixture(name=func.__name__)(missing)


def pytest_addoption(parser: pytest.Parser) -> None:
    """The ``eop_app`` ini option (read only by the ``eop_app`` fixture)."""
    parser.addini("eop_app", "the eop.App the eop_app fixture imports, as module:attribute")


def unavailable(reason: str) -> NoReturn:
    """Skip for want of a server binary; under CI=true, fail instead."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{reason} (CI=true: missing servers fail the run)", pytrace=False)
    pytest.skip(reason)


# -- PostgreSQL


@pytest.fixture(scope="session")
def eop_postgres() -> Iterator[embedded.PostgresCluster]:
    """The session's PostgreSQL: a throwaway server, or ``EOP_TEST_DATABASE_URL``'s."""
    from eop import errors
    from eop.testing import servers

    with contextlib.ExitStack() as stack:
        try:
            cluster = stack.enter_context(servers.postgres())
        except errors.ServerBinaryNotFound as exc:
            unavailable(str(exc))
        except errors.DatabaseUnavailable as exc:
            unreachable = str(exc)
        else:
            yield cluster
            return
    # A server named explicitly: its failure is the run's, never a skip.
    pytest.fail(unreachable, pytrace=False)


@pytest.fixture(scope="session")
def eop_schema() -> str:
    """The schema of eop's tables in the test databases (override to match your app's)."""
    return "eop"


@pytest.fixture(scope="session")
def eop_metadata() -> list[sa.MetaData]:
    """Your SQLAlchemy metadata: their tables are created in the template database.

    Override it, e.g. ``return [Base.metadata]``.
    """
    return []


@pytest.fixture(scope="session")
def eop_prepare_database(eop_metadata: list[sa.MetaData]) -> Callable[[str], None]:
    """What prepares the template database after eop's migrations, given its psycopg URL.

    By default: the tables of ``eop_metadata``, and first the schemas they name
    (``MetaData(schema=...)`` or a table's ``schema=``), which ``create_all``
    does not create. Override it to run your own Alembic migrations instead.
    """

    def prepare(url: str) -> None:
        import sqlalchemy as sa

        engine = sa.create_engine(url)
        try:
            schemas = {t.schema for m in eop_metadata for t in m.tables.values() if t.schema}
            with engine.begin() as conn:
                for schema in sorted(schemas):
                    conn.execute(sa.schema.CreateSchema(schema, if_not_exists=True))
            for metadata in eop_metadata:
                metadata.create_all(engine)
        finally:
            engine.dispose()

    return prepare


@pytest.fixture(scope="session")
def eop_template_database(
    eop_postgres: embedded.PostgresCluster,
    eop_schema: str,
    eop_prepare_database: Callable[[str], None],
) -> Iterator[str]:
    """The name of a database prepared once per session, copied for each test."""
    from eop.testing import servers

    with servers.template_database(
        eop_postgres, schema=eop_schema, prepare=eop_prepare_database
    ) as name:
        yield name


@pytest.fixture
def eop_database_url(
    eop_postgres: embedded.PostgresCluster, eop_template_database: str
) -> Iterator[str]:
    """The asyncpg URL of a fresh copy of the template database, dropped after the test."""
    from eop.testing import servers

    with servers.database_copy(eop_postgres, eop_template_database) as url:
        yield url


@_async_fixture
async def eop_engine(eop_database_url: str) -> AsyncIterator[AsyncEngine]:
    """An async engine on the test's database, disposed after the test."""
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(eop_database_url)
    yield engine
    await engine.dispose()


# -- NATS


@pytest.fixture
def eop_nats_server() -> Iterator[embedded.NatsServer]:
    """A nats-server with JetStream for this test alone, with a temporary store."""
    from eop import errors
    from eop.tools import embedded

    try:
        server = embedded.NatsServer()
    except errors.ServerBinaryNotFound as exc:
        missing = str(exc)
    else:
        with server:
            yield server
        return
    if os.environ.get(embedded.NATS_SERVER_ENV):
        # Named explicitly: a wrong path is the run's error, never a skip.
        pytest.fail(missing, pytrace=False)
    unavailable(missing)


@pytest.fixture
def eop_nats_url(eop_nats_server: embedded.NatsServer) -> str:
    """The test's nats-server URL."""
    return eop_nats_server.url


@_async_fixture
async def eop_nats(eop_nats_url: str) -> AsyncIterator[NATS]:
    """A nats-py client connected to the test's server, closed after the test."""
    import nats

    client = await nats.connect(eop_nats_url, connect_timeout=5)
    yield client
    await client.close()


@pytest.fixture
def eop_jetstream(eop_nats: NATS) -> JetStreamContext:
    """The JetStream context of ``eop_nats``."""
    return eop_nats.jetstream()


# -- the app


@pytest.fixture
def eop_app(request: pytest.FixtureRequest) -> App:
    """The app under test: the ``eop_app = module:app`` ini option, or override this fixture."""
    from eop import App

    path = str(request.config.getini("eop_app") or "")
    if not path:
        pytest.fail(
            "the eop_app fixture needs your app: set `eop_app = module:app` in your pytest "
            "configuration, or define a fixture named eop_app that returns it",
            pytrace=False,
        )
    return App.from_path(path)


@_async_fixture
async def eop_test_app(
    eop_app: App, eop_engine: AsyncEngine, eop_schema: str
) -> AsyncIterator[TestApp]:
    """``eop.testing.TestApp`` running ``eop_app``'s handlers on the test's database."""
    from eop.testing import TestApp

    async with TestApp(eop_app, database=eop_engine, schema=eop_schema, migrate=False) as t:
        yield t
