"""The Django test project (tests/django/djproject) on the test bed's PostgreSQL.

One database per session, made by ``manage.py migrate`` as a user's would be
(the shop's tables and, through eop's Django migration, eop's); every test
starts from empty tables and its own nats-server.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa

from eop.testing.servers import unique_name

if TYPE_CHECKING:
    from collections.abc import Iterator

    from eop.tools import embedded

HERE = Path(__file__).resolve().parent


def libpq_url(asyncpg_url: str) -> str:
    """``postgresql://...`` of an asyncpg URL: what the project's settings.py reads."""
    url = sa.make_url(asyncpg_url).set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def django_database(postgres: embedded.PostgresCluster) -> Iterator[str]:
    """The project's database (asyncpg URL), migrated by ``manage.py migrate`` in-process."""
    name = unique_name("eop_django")
    url = postgres.create_database(name, template="template0")
    os.environ["DJANGO_SETTINGS_MODULE"] = "djproject.settings"
    os.environ["DJPROJECT_DATABASE_URL"] = libpq_url(url)
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import django
    from django.core.management import call_command
    from django.db import connections

    django.setup()
    call_command("migrate", verbosity=0)
    connections.close_all()
    yield url
    connections.close_all()
    postgres.drop_database(name)


@pytest.fixture
def project(django_database: str) -> str:
    """The project's database emptied for this test: the shop's tables and eop's."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE shop_effect, shop_account, shop_order, shop_step, eop.inbox, "
            "eop.dead_letters, eop.watermarks, eop.retries, eop.outbox, eop.relay_leases, "
            "eop.partitions, eop.members RESTART IDENTITY"
        )
    connection.close()
    return django_database


def query(sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` through Django's connection of the calling thread (closed after)."""
    from django.db import connection

    try:
        with connection.cursor() as cursor:
            cursor.execute(sql, list(params))
            return [tuple(row) for row in cursor.fetchall()]
    finally:
        connection.close()
