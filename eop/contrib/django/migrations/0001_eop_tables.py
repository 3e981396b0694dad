"""eop's tables, by eop's own Alembic migrations, so that ``manage.py migrate`` makes them.

Also in the test databases Django's test runner creates. eop's Alembic
history stays the one truth: this runs ``eop db upgrade`` to head on the
database being migrated (its own connection, psycopg), at the time it is
applied; after upgrading eop, run ``manage.py eop db upgrade`` (the worker
says so until then). Reversing it leaves the tables: ``manage.py eop db
downgrade base`` drops them.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations


def upgrade(apps: Any, schema_editor: Any) -> None:
    """``eop db upgrade`` on the database ``schema_editor`` migrates."""
    from eop.contrib.django import conf
    from eop.pg import migrate

    database = schema_editor.connection.settings_dict
    url = conf.database_url(database, "psycopg").render_as_string(hide_password=False)
    migrate.upgrade(url, schema=conf.settings(database=database).schema)


class Migration(migrations.Migration):
    """Runs eop's Alembic upgrade; outside Django's transaction, as Alembic has its own."""

    atomic = False
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [
        migrations.RunPython(upgrade, migrations.RunPython.noop, elidable=False)
    ]
