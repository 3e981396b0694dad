"""Alembic environment of eop's own migrations.

Run through :mod:`eop.pg.migrate` (``eop db upgrade``), which sets the database
URL and schema in ``config.attributes``; the ``alembic`` command works too,
given an ini file with ``script_location``, ``sqlalchemy.url`` and optionally
``eop_schema`` (or ``-x eop_schema=NAME``). Online only: an asyncpg URL runs on
an async engine, a psycopg URL on a sync one, and a ``Connection`` placed in
``config.attributes["connection"]`` is used as it is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import TYPE_CHECKING

import sqlalchemy as sa
from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from eop import errors
from eop.pg import engines, migrate, models

if TYPE_CHECKING:
    from collections.abc import Coroutine

config = context.config
schema = migrate.configured_schema(config)
target_metadata = models.tables(schema).metadata


def run_migrations(connection: sa.Connection) -> None:
    """Run the requested command on ``connection``, in one transaction."""
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=models.VERSION_TABLE,
        version_table_schema=schema,
        # Only eop's schema, so `alembic check` ignores the host app's tables.
        **migrate.comparison_options(schema),
        # script.py.mako turns this literal back into the run-time schema.
        template_args={"eop_schema": schema},
    )
    with context.begin_transaction():
        # `alembic current` asks not to write; every other command may create
        # the version table, which needs its schema first.
        if not context.get_context().opts.get("dont_mutate", False):
            prepare_schema(connection)
        context.run_migrations()


def prepare_schema(connection: sa.Connection) -> None:
    """Serialise concurrent migrations of this schema, and create it if missing."""
    # Two workers or deploy jobs upgrading at once: the second waits, then
    # finds the tables at head and does nothing.
    lock_key = f"eop.migrations.{schema}"
    connection.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": lock_key})
    exists = connection.execute(
        sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :schema"), {"schema": schema}
    ).first()
    # Only when missing: CREATE SCHEMA IF NOT EXISTS needs the CREATE privilege
    # on the database even when the schema is already there.
    if exists is None:
        quoted = connection.dialect.identifier_preparer.quote_schema(schema)
        connection.execute(sa.text(f"CREATE SCHEMA {quoted}"))


#: The ``db_pooler`` setting (eop.settings): through a transaction-mode pooler,
#: no prepared statement may outlive its transaction (docs/pgbouncer.md).
pooler = config.attributes.get("eop_db_pooler", "auto")


async def run_async_migrations(url: sa.URL) -> None:
    """Run on a fresh async engine, through its sync facade."""
    url, connect_args = engines.asyncpg_url(url)
    engine = create_async_engine(url, poolclass=NullPool, connect_args=connect_args)
    engines.for_pooler(engine.sync_engine, pooler)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(run_migrations)
    finally:
        await engine.dispose()


def run_coroutine(coro: Coroutine[object, object, None]) -> None:
    """asyncio.run, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    # A blocking call from inside a loop: run in a thread of our own rather
    # than fail (the caller's loop is blocked meanwhile either way).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, coro).result()


def run_migrations_online() -> None:
    """Run on the given connection, else on an engine for the configured URL."""
    connection = config.attributes.get("connection")
    if connection is not None:
        run_migrations(connection)
        return
    raw_url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    if not raw_url:
        raise errors.ConfigurationError("no database URL for eop's migrations")
    url = sa.make_url(raw_url)
    if url.get_dialect().is_async:
        run_coroutine(run_async_migrations(url))
        return
    engine = engines.for_pooler(sa.create_engine(url, poolclass=NullPool), pooler)
    try:
        with engine.connect() as sync_connection:
            run_migrations(sync_connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise errors.ConfigurationError("eop's migrations run online only (no --sql)")
run_migrations_online()
