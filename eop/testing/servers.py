"""Throwaway databases for tests: the server, a migrated template, a fresh copy per test.

The pytest plugin's fixtures (``pytest_eop``) and eop's own test bed build on
these. A copy of a small template database is much faster than migrating a
new database for every test.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator

from eop import errors
from eop.pg import migrate
from eop.tools import embedded

TEST_DATABASE_URL = "EOP_TEST_DATABASE_URL"
"""The variable naming a PostgreSQL server to use instead of starting one."""


def unique_name(prefix: str) -> str:
    """A database name no other test or session uses, even on a shared server."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def postgres() -> Iterator[embedded.PostgresCluster]:
    """The server of ``EOP_TEST_DATABASE_URL``, else a throwaway embedded one.

    :class:`eop.errors.ServerBinaryNotFound` without either (install the
    ``embedded`` extra).
    """
    url = os.environ.get(TEST_DATABASE_URL)
    if url:
        cluster = embedded.PostgresCluster(url)
        try:
            cluster.ping()
        except errors.DatabaseUnavailable as exc:
            cluster.close()
            raise errors.DatabaseUnavailable(f"{TEST_DATABASE_URL}: {exc}") from exc
        try:
            yield cluster
        finally:
            cluster.close()
        return
    with embedded.PostgresServer() as server:
        yield server


@contextlib.contextmanager
def template_database(
    cluster: embedded.PostgresCluster,
    *,
    schema: str = migrate.DEFAULT_SCHEMA,
    prepare: Callable[[str], None] | None = None,
) -> Iterator[str]:
    """A database with eop's tables at head in ``schema``, dropped on exit; its name.

    ``prepare`` is then called with its psycopg URL, to add the application's
    own tables. Copies are made of it by :func:`database_copy`.
    """
    name = unique_name("eop_test_template")
    cluster.create_database(name, template="template0")
    try:
        migrate.upgrade(cluster.url_for(name), schema)
        if prepare is not None:
            prepare(cluster.url_for(name, driver="psycopg"))
        yield name
    finally:
        cluster.drop_database(name)


@contextlib.contextmanager
def database_copy(cluster: embedded.PostgresCluster, template: str) -> Iterator[str]:
    """A fresh copy of ``template``, dropped on exit; its asyncpg URL."""
    name = unique_name("eop_test")
    # Copying files beats WAL-logging each block for a small template, on our
    # own fsync-less server; a shared server keeps its default.
    own = isinstance(cluster, embedded.PostgresServer)
    url = cluster.create_database(name, template=template, strategy="file_copy" if own else None)
    try:
        yield url
    finally:
        cluster.drop_database(name)
