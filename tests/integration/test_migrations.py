"""eop's migrations: they match the models, round-trip, and keep to their own schema."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from eop import errors
from eop.pg import migrate, models
from eop.tools import embedded

if TYPE_CHECKING:
    from pathlib import Path

    from sqlalchemy.ext.asyncio import AsyncEngine


def sync_url(url: str) -> str:
    return sa.make_url(url).set(drivername="postgresql+psycopg").render_as_string(False)


def query(url: str, sql: str) -> list[tuple[object, ...]]:
    engine = sa.create_engine(sync_url(url), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(sa.text(sql))]
    finally:
        engine.dispose()


def tables_in(url: str, schema: str) -> set[str]:
    rows = query(url, f"SELECT tablename FROM pg_tables WHERE schemaname = '{schema}'")
    return {str(name) for (name,) in rows}


def test_fresh_upgrade_matches_the_models(empty_database_url: str) -> None:
    """A fresh upgrade reaches head; autogenerate finds no change (eop's check and alembic's)."""
    migrate.upgrade(empty_database_url)
    assert migrate.current(empty_database_url) == migrate.head()
    migrate.check(empty_database_url)
    command.check(migrate.alembic_config(empty_database_url))
    assert tables_in(empty_database_url, "eop") == {
        "inbox",
        "dead_letters",
        "watermarks",
        "retries",
        "outbox",
        "relay_leases",
        "spark_reports",
        "partitions",
        "members",
        "ack_floors",
        "handovers",
        "eop_alembic_version",
    }


@pytest.mark.parametrize("step", [migrate.upgrade, migrate.downgrade])
def test_a_revision_that_does_not_exist_is_one_line_naming_the_ones_that_do(
    step: Any, database_url: str
) -> None:
    """`eop db upgrade nosuchrev` (or downgrade) is a ConfigurationError naming eop's
    revisions, one line, not Alembic's traceback; the tables stay at head."""
    with pytest.raises(errors.ConfigurationError, match=r"nosuchrev.*eop_0001") as caught:
        step(database_url, revision="nosuchrev")
    assert "\n" not in str(caught.value)
    assert migrate.current(database_url) == migrate.head()


def test_alembic_command_line_runs_eop_environment(empty_database_url: str, tmp_path: Path) -> None:
    """The `alembic` CLI works on eop's environment with an ini file and -x eop_schema."""
    ini = tmp_path / "alembic.ini"
    ini.write_text(
        textwrap.dedent(f"""\
        [alembic]
        script_location = {migrate.migrations_path()}
        path_separator = os
        sqlalchemy.url = {empty_database_url.replace("%", "%%")}
        """)
    )
    alembic = [sys.executable, "-m", "alembic", "-c", str(ini), "-x", "eop_schema=cli_eop"]
    outputs = {}
    for args in (["upgrade", "head"], ["check"], ["current"]):
        result = subprocess.run(alembic + args, capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr
        outputs[args[0]] = result.stdout
    assert "No new upgrade operations detected" in outputs["check"]
    assert outputs["current"].startswith(migrate.head())
    migrate.check(empty_database_url, schema="cli_eop")


def test_downgrade_to_base_then_upgrade_round_trips(database_url: str) -> None:
    """Downgrade to base drops eop's tables (not the schema); upgrading again matches the models."""
    migrate.downgrade(database_url, revision="base")
    assert migrate.current(database_url) is None
    assert tables_in(database_url, "eop") == {"eop_alembic_version"}
    migrate.upgrade(database_url)
    migrate.check(database_url)
    migrate.downgrade(database_url, revision="eop_0003")
    assert "retries" not in tables_in(database_url, "eop")
    assert "msg_id_digest" not in columns_of(database_url, "eop", "inbox")
    migrate.downgrade(database_url, revision="eop_0002")
    assert "replayed_at" not in columns_of(database_url, "eop", "dead_letters")
    migrate.downgrade(database_url, revision="eop_0001")
    assert "watermarks" not in tables_in(database_url, "eop")
    migrate.upgrade(database_url)
    migrate.check(database_url)


def columns_of(url: str, schema: str, table: str) -> set[str]:
    rows = query(
        url,
        "SELECT column_name FROM information_schema.columns "
        f"WHERE table_schema = '{schema}' AND table_name = '{table}'",
    )
    return {str(name) for (name,) in rows}


def test_replay_columns_upgrade_over_existing_dead_letters(database_url: str) -> None:
    """eop_0003 over a table with dead letters: they start at generation 0, never replayed."""
    migrate.downgrade(database_url, revision="eop_0002")
    query(database_url, "SELECT 1")
    engine = sa.create_engine(sync_url(database_url), poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO eop.dead_letters (subscription, stream, stream_epoch, stream_seq,"
                " fingerprint, subject, headers, payload, reason, error, delivery_count)"
                " VALUES ('h', 'S', 'e', 1, '\\x00', 'S.a', '{}', '\\x01', 'rejected', 'no', 1)"
            )
        )
    engine.dispose()
    migrate.upgrade(database_url)
    migrate.check(database_url)
    rows = query(database_url, "SELECT replay_generation, replayed_at FROM eop.dead_letters")
    assert rows == [(0, None)]


def test_msg_id_digest_upgrade_and_downgrade_over_existing_rows(database_url: str) -> None:
    """eop_0004 fills the digest of kept msg-ids; its downgrade drops msg-ids too long to index."""
    migrate.downgrade(database_url, revision="eop_0003")
    insert = (
        "INSERT INTO eop.inbox (subscription, stream, stream_epoch, stream_seq, fingerprint,"
        " msg_id, subject, outcome, delivery_count) VALUES"
        " ('h', 'S', 'e', 1, '\\x00', 'id-1', 'S.a', 'processed', 1),"
        " ('h', 'S', 'e', 2, '\\x00', NULL, 'S.a', 'processed', 1)"
    )
    query_all(database_url, insert)
    migrate.upgrade(database_url)
    migrate.check(database_url)
    rows = query(
        database_url,
        "SELECT stream_seq, msg_id_digest = sha256('id-1'::bytea), msg_id_digest IS NULL"
        " FROM eop.inbox ORDER BY stream_seq",
    )
    assert rows == [(1, True, False), (2, None, True)]
    migrate.downgrade(database_url, revision="eop_0010")  # the inbox's key as eop_0004 knew it
    long_id = "".join(f"{i:x}" for i in range(2000))  # hex counting: pglz cannot shrink it
    query_all(
        database_url,
        "INSERT INTO eop.inbox (subscription, stream, stream_epoch, stream_seq, fingerprint,"
        " msg_id, msg_id_digest, subject, outcome, delivery_count) VALUES"
        f" ('h', 'S', 'e', 3, '\\x00', '{long_id}', '\\x01', 'S.a', 'processed', 1)",
    )
    migrate.downgrade(database_url, revision="eop_0003")
    rows = query(database_url, "SELECT stream_seq, msg_id FROM eop.inbox ORDER BY stream_seq")
    assert rows == [(1, "id-1"), (2, None), (3, None)]


def query_all(url: str, sql: str) -> None:
    engine = sa.create_engine(sync_url(url), poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text(sql))
    engine.dispose()


def test_version_table_is_eop_own_and_host_alembic_version_untouched(
    empty_database_url: str,
) -> None:
    """eop's revision goes to <schema>.eop_alembic_version; the host's alembic_version stays."""
    query(empty_database_url, "SELECT 1")  # connectivity
    host = sa.create_engine(sync_url(empty_database_url), poolclass=NullPool)
    with host.begin() as conn:
        conn.execute(sa.text("CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)"))
        conn.execute(sa.text("INSERT INTO alembic_version VALUES ('host_rev_1')"))
    host.dispose()
    migrate.upgrade(empty_database_url)
    assert query(empty_database_url, "SELECT version_num FROM public.alembic_version") == [
        ("host_rev_1",)
    ]
    assert query(empty_database_url, f"SELECT version_num FROM eop.{models.VERSION_TABLE}") == [
        (migrate.head(),)
    ]
    assert tables_in(empty_database_url, "public") == {"alembic_version"}


def test_a_non_default_schema_holds_everything(empty_database_url: str) -> None:
    """With schema='billing_eop', tables and version table live there, and `eop` stays absent."""
    migrate.upgrade(empty_database_url, schema="billing_eop")
    assert tables_in(empty_database_url, "billing_eop") == {
        "inbox", "dead_letters", "watermarks", "retries", "outbox", "relay_leases",
        "spark_reports", "partitions", "members", "ack_floors", "handovers", models.VERSION_TABLE,
    }  # fmt: skip
    migrate.check(empty_database_url, schema="billing_eop")
    assert migrate.current(empty_database_url, schema="eop") is None
    assert query(empty_database_url, "SELECT 1 FROM pg_namespace WHERE nspname = 'eop'") == []


def test_check_fails_clearly_on_an_unmigrated_database(empty_database_url: str) -> None:
    """check() on a database eop never migrated says to run `eop db upgrade`, and writes nothing."""
    with pytest.raises(errors.SchemaNotReady, match=r"missing .*run `eop db upgrade`"):
        migrate.check(empty_database_url)
    assert migrate.current(empty_database_url) is None
    assert query(empty_database_url, "SELECT 1 FROM pg_namespace WHERE nspname = 'eop'") == []


def test_tables_behind_head_name_the_upgrade_command_django_projects_need(
    database_url: str,
) -> None:
    """Tables one revision behind say to run `eop db upgrade`, and under Django its
    `manage.py eop db upgrade` form: Django recorded eop's migration as applied when it
    first made the tables, so `manage.py migrate` would do nothing."""
    previous = migrate._script().get_revision(migrate.head()).down_revision
    assert isinstance(previous, str)
    migrate.downgrade(database_url, revision=previous)
    with pytest.raises(errors.SchemaNotReady, match="not at head") as caught:
        migrate.check(database_url)
    assert "run `eop db upgrade` (in a Django project: python manage.py eop db upgrade)" in str(
        caught.value
    )


def test_check_fails_on_a_hand_altered_table(database_url: str) -> None:
    """A table changed outside the migrations is reported as differing from the models."""
    query(database_url, "SELECT 1")
    engine = sa.create_engine(sync_url(database_url), poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP INDEX eop.inbox_msg_id_key"))
        conn.execute(sa.text("ALTER TABLE eop.dead_letters ADD COLUMN extra int"))
    engine.dispose()
    with pytest.raises(errors.SchemaNotReady, match="differ from eop's models") as caught:
        migrate.check(database_url)
    assert "inbox_msg_id_key" in str(caught.value)
    assert "extra" in str(caught.value)


async def test_ensure_ready_accepts_head_and_rejects_the_rest(
    engine: AsyncEngine, empty_database_url: str
) -> None:
    """ensure_ready passes at head; fails on missing tables and on a revision newer than eop's."""
    await migrate.ensure_ready(engine, "eop")
    empty = create_async_engine(empty_database_url)
    try:
        with pytest.raises(errors.SchemaNotReady, match="run `eop db upgrade`"):
            await migrate.ensure_ready(empty, "eop")
    finally:
        await empty.dispose()
    async with engine.begin() as conn:
        await conn.execute(
            sa.text(f"UPDATE eop.{models.VERSION_TABLE} SET version_num = 'eop_9999'")
        )
    with pytest.raises(errors.SchemaNotReady, match="newer eop"):
        await migrate.ensure_ready(engine, "eop")


async def test_unreachable_database_is_unavailable_and_password_redacted() -> None:
    """A server that does not answer raises DatabaseUnavailable; the URL's password never shows."""
    url = f"postgresql+asyncpg://app:s3cret-pw@127.0.0.1:{embedded.free_port()}/app"
    for call in (migrate.upgrade, migrate.current, migrate.check):
        with pytest.raises(errors.DatabaseUnavailable) as caught:
            await asyncio.to_thread(call, url)
        assert "s3cret-pw" not in str(caught.value)
        assert "***" in str(caught.value)
    engine = create_async_engine(url)
    with pytest.raises(errors.DatabaseUnavailable) as caught:
        await migrate.ensure_ready(engine, "eop")
    await engine.dispose()
    assert "s3cret-pw" not in str(caught.value)


def test_migrations_run_on_a_given_connection(empty_database_url: str) -> None:
    """A Connection in config.attributes['connection'] is used as is; its owner commits."""
    engine = sa.create_engine(sync_url(empty_database_url), poolclass=NullPool)
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))  # the caller's transaction is already open
        config = migrate.alembic_config(empty_database_url)
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
        conn.commit()
    engine.dispose()
    migrate.check(empty_database_url)


async def test_concurrent_upgrades_from_threads_serialise(empty_database_url: str) -> None:
    """Upgrades run in threads while this event loop runs; concurrent ones wait for each other."""
    runs = [asyncio.to_thread(migrate.upgrade, empty_database_url) for _ in range(4)]
    await asyncio.gather(*runs)
    assert await asyncio.to_thread(migrate.current, empty_database_url) == migrate.head()


def test_concurrent_upgrades_from_processes_serialise(empty_database_url: str) -> None:
    """Upgrades racing from several processes (deploy jobs, workers) wait on one another."""
    # Each process imports first, then waits for the same instant, so that
    # the upgrades themselves overlap.
    code = (
        "import sys, time; from eop.pg import migrate; import asyncpg, sqlalchemy.ext.asyncio; "
        "time.sleep(max(0.0, float(sys.argv[2]) - time.time())); migrate.upgrade(sys.argv[1])"
    )
    go = str(time.time() + 2.0)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, empty_database_url, go], stderr=subprocess.PIPE
        )
        for _ in range(4)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr.decode()
    migrate.check(empty_database_url)


def test_a_blocking_call_inside_a_running_loop_still_works(empty_database_url: str) -> None:
    """Called straight from a coroutine (blocking it), upgrade does not trip on the running loop."""

    async def main() -> None:
        migrate.upgrade(empty_database_url)

    asyncio.run(main())
    migrate.check(empty_database_url)


HOST_ENV = """\
from alembic import context
import sqlalchemy as sa
import eop.pg.models

host_metadata = sa.MetaData()
sa.Table("accounts", host_metadata, sa.Column("id", sa.Integer, primary_key=True))
schema = context.config.get_main_option("eop_schema")
target_metadata = [host_metadata, eop.pg.models.tables(schema).metadata]

def include_name(name, type_, parent_names):
    return type_ != "schema" or name in (None, schema)

engine = sa.create_engine(context.config.get_main_option("sqlalchemy.url"))
with engine.connect() as connection:
    context.configure(
        connection=connection, target_metadata=target_metadata,
        include_schemas=True, include_name=include_name,
    )
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""

HOST_REVISION = """\
from alembic import op
import sqlalchemy as sa

revision = "host_0001"
down_revision = None
branch_labels = ("host",)
depends_on = None

def upgrade():
    op.create_table("accounts", sa.Column("id", sa.Integer, primary_key=True))

def downgrade():
    op.drop_table("accounts")
"""


def host_config(url: str, tmp_path: Path, eop_schema: str) -> Config:
    """A host app's Alembic environment in ``tmp_path`` that runs eop's revisions as a
    branch of its own history (migrations/README.md), on ``url``."""
    (tmp_path / "versions").mkdir()
    (tmp_path / "env.py").write_text(HOST_ENV)
    (tmp_path / "versions" / "host_0001.py").write_text(HOST_REVISION)
    ini = tmp_path / "alembic.ini"
    ini.write_text(
        textwrap.dedent(f"""\
        [alembic]
        script_location = {tmp_path}
        path_separator = newline
        version_locations =
            {tmp_path / "versions"}
            {migrate.migrations_path() / "versions"}
        sqlalchemy.url = {sync_url(url).replace("%", "%%")}
        eop_schema = {eop_schema}
        """)
    )
    return Config(str(ini))


def test_host_environment_can_run_eop_revisions_as_a_branch(
    empty_database_url: str, tmp_path: Path
) -> None:
    """As migrations/README.md says: eop's versions in a host's version_locations, upgrade heads."""
    config = host_config(empty_database_url, tmp_path, "host_eop")
    command.upgrade(config, "heads")
    command.check(config)
    versions = query(empty_database_url, "SELECT version_num FROM public.alembic_version")
    assert sorted(versions) == [(migrate.head(),), ("host_0001",)]
    assert tables_in(empty_database_url, "host_eop") == {
        "inbox", "dead_letters", "watermarks", "retries", "outbox", "relay_leases",
        "spark_reports", "partitions", "members", "ack_floors", "handovers",
    }  # fmt: skip
    assert tables_in(empty_database_url, "public") == {"alembic_version", "accounts"}


def test_eop_reads_its_revisions_from_a_host_environment_that_runs_them(
    empty_database_url: str, tmp_path: Path
) -> None:
    """A host app whose Alembic runs eop's revisions records eop's head in its own
    ``alembic_version``: a worker starts, ``eop db current`` and ``check`` read it there,
    ``eop db upgrade`` refuses (it would begin a second history over existing tables),
    and a database behind head says to run the host's ``alembic upgrade heads``."""
    config = host_config(empty_database_url, tmp_path, "eop")
    command.upgrade(config, "heads")
    assert migrate.current(empty_database_url) == migrate.head()
    assert migrate.recorded(empty_database_url).host_table == "public.alembic_version"
    migrate.check(empty_database_url)
    engine = create_async_engine(empty_database_url, poolclass=NullPool)
    try:
        asyncio.run(migrate.ensure_ready(engine, "eop"))
        for call in (migrate.upgrade, migrate.downgrade):
            with pytest.raises(errors.ConfigurationError, match=r"public\.alembic_version records"):
                call(empty_database_url)
        assert tables_in(empty_database_url, "eop") >= {"inbox", "dead_letters"}
        assert models.VERSION_TABLE not in tables_in(empty_database_url, "eop")
        query_all(empty_database_url, "ALTER TABLE eop.inbox ADD COLUMN extra int")
        with pytest.raises(errors.SchemaNotReady, match="extra"):
            migrate.check(empty_database_url)
        command.downgrade(config, "eop@-1")
        with pytest.raises(errors.SchemaNotReady, match="run `alembic upgrade heads`"):
            asyncio.run(migrate.ensure_ready(engine, "eop"))
    finally:
        asyncio.run(engine.dispose())
