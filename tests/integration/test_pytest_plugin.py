"""eop's pytest plugin, as a user's suite sees it: pytest run in a fresh process on a user's
test files, outside the repository, the plugin loaded from its entry point."""

from __future__ import annotations

import pytest

import pytest_eop

USER_APP = """
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

import eop

metadata = sa.MetaData()
notes = sa.Table("notes", metadata, sa.Column("body", sa.Text, nullable=False))
# A table in a schema of its own: the default eop_prepare_database creates the schema too.
tags = sa.Table("tags", metadata, sa.Column("name", sa.Text), schema="app")

app = eop.App()


@app.handler(stream="NOTES", subject="NOTES.added", name="notes")
async def add_note(msg: eop.Message, session: AsyncSession) -> None:
    await session.execute(notes.insert().values(body=msg.text()))
"""

USER_TESTS = """
import sqlalchemy as sa
import pytest

from myapp import metadata

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="session")
def eop_metadata():
    return [metadata]


@pytest.fixture(scope="session")
def eop_schema():
    return "kit"


async def count(engine, table):
    async with engine.connect() as conn:
        return await conn.scalar(sa.text(f"SELECT count(*) FROM {table}"))


@pytest.mark.parametrize("run", [1, 2])
async def test_each_test_gets_a_fresh_migrated_copy(eop_engine, run):
    assert await count(eop_engine, "kit.inbox") == 0
    assert await count(eop_engine, "notes") == 0
    assert await count(eop_engine, "app.tags") == 0
    async with eop_engine.begin() as conn:
        await conn.execute(sa.text("INSERT INTO notes VALUES ('left behind')"))


async def test_the_test_app_runs_the_ini_app_on_the_test_database(eop_test_app, eop_engine):
    delivered = await eop_test_app.deliver("NOTES.added", "hello", msg_id="n-1")
    assert delivered.processed
    assert (await eop_test_app.deliver("NOTES.added", "hello", msg_id="n-1")).duplicate
    assert await count(eop_engine, "notes") == 1
    assert await count(eop_engine, "kit.inbox") == 1


async def test_jetstream_is_connected_to_a_server_of_the_test(eop_jetstream, eop_nats_url):
    await eop_jetstream.add_stream(name="NOTES", subjects=["NOTES.>"])
    ack = await eop_jetstream.publish("NOTES.added", b"hi")
    assert ack.seq == 1
    assert eop_nats_url.startswith("nats://127.0.0.1:")


def test_sync_fixtures_need_no_event_loop(eop_database_url, eop_postgres):
    assert eop_database_url.startswith("postgresql+asyncpg://")
"""


def test_a_users_suite_gets_servers_a_database_per_test_and_the_test_app(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fixtures on a fresh machine's path (an embedded PostgreSQL, not
    EOP_TEST_DATABASE_URL): a migrated copy per test in the schema the user picked, with
    the user's tables (eop_metadata); eop_test_app on the app of the `eop_app` ini option;
    a JetStream client on a nats-server of the test's own."""
    monkeypatch.delenv("EOP_TEST_DATABASE_URL", raising=False)
    pytester.makepyfile(myapp=USER_APP, test_user=USER_TESTS)
    pytester.makeini("[pytest]\neop_app = myapp:app\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=5)


def test_servers_named_explicitly_and_wrong_fail_the_run_in_one_line_not_skip(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EOP_TEST_DATABASE_URL naming a server nobody listens on, EOP_NATS_SERVER naming no
    binary: without CI=true too, each test errors with one line naming the variable,
    instead of a driver's traceback or a silent skip."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("EOP_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:1/postgres")
    monkeypatch.setenv("EOP_NATS_SERVER", "/nonexistent/nats-server")
    pytester.makepyfile(
        test_user="""
        def test_db(eop_database_url):
            pass

        def test_nats(eop_nats_url):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(
        ["EOP_TEST_DATABASE_URL: cannot reach PostgreSQL at *", "EOP_NATS_SERVER=* is not an*"]
    )
    assert "Traceback" not in result.stdout.str()


def test_the_plugin_imports_no_eop_and_starts_nothing_unless_a_fixture_is_used(
    pytester: pytest.Pytester,
) -> None:
    """Loaded in every pytest run where eop is installed, the plugin costs an import of
    pytest_eop: a test that uses none of its fixtures finds eop not imported, and
    --fixtures lists the eop_ fixtures."""
    pytester.makepyfile(
        test_plain="""
        import sys

        def test_plain():
            assert "pytest_eop" in sys.modules
            assert [m for m in sys.modules if m == "eop" or m.startswith("eop.")] == []
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=1)
    listing = pytester.runpytest_subprocess("--fixtures", "-p", "no:cacheprovider", timeout=120)
    for name in ("eop_postgres", "eop_database_url", "eop_engine", "eop_test_app"):
        listing.stdout.fnmatch_lines([f"{name}*"])


def test_the_plugins_fixtures_are_all_prefixed_and_none_is_the_test_beds(
    request: pytest.FixtureRequest,
) -> None:
    """No clash with a user's (or eop's own) fixtures: every fixture the plugin defines is
    named eop_*, and the test bed's conftest defines none of those names."""
    from tests import conftest

    plugin = {name for name in vars(pytest_eop) if _is_fixture(getattr(pytest_eop, name))}
    bed = {name for name in vars(conftest) if _is_fixture(getattr(conftest, name))}
    assert plugin
    assert {name for name in plugin if not name.startswith("eop_")} == set()
    assert plugin & bed == set()
    assert request.config.pluginmanager.has_plugin("eop")


def _is_fixture(obj: object) -> bool:
    # pytest 8.4+ wraps a fixture function; earlier ones mark it.
    return type(obj).__name__ == "FixtureFunctionDefinition" or hasattr(
        obj, "_pytestfixturefunction"
    )
