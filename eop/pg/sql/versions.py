"""Where a database records eop's revisions when a host app's Alembic runs them.

In standalone use eop's history is its own version table (``<schema>.eop_alembic_version``,
read through Alembic). A host app may run eop's revisions as a branch of its own
history instead (migrations/README.md): its version table, ``alembic_version``
unless it configured another, then records eop's head beside its own. Such a
table is found by its shape, a ``version_num`` column, in any schema the role can
read.
"""

from __future__ import annotations

import sqlalchemy as sa

from eop.pg.sql.base import Bound

_VERSION_TABLES = sa.text(
    "SELECT c.table_schema, c.table_name FROM information_schema.columns c"
    " WHERE c.column_name = 'version_num'"
    " AND NOT (c.table_schema = :p_schema AND c.table_name = :p_own)"
    " ORDER BY c.table_schema, c.table_name"
)


def version_tables(schema: str, own_table: str) -> Bound:
    """The schema and name of every Alembic version table but eop's own in ``schema``."""
    return _VERSION_TABLES, {"p_schema": schema, "p_own": own_table}


_TABLE_EXISTS = sa.text(
    "SELECT to_regclass(format('%I.%I', CAST(:p_schema AS text), CAST(:p_name AS text)))"
    " IS NOT NULL"
)


def table_exists(schema: str, name: str) -> Bound:
    """Whether ``schema.name`` exists (its name quoted as PostgreSQL would need it)."""
    return _TABLE_EXISTS, {"p_schema": schema, "p_name": name}


def versions_in(table_schema: str, table_name: str) -> sa.Select[str]:
    """Every revision a version table records."""
    column = sa.column("version_num", sa.String)
    return sa.select(column).select_from(sa.table(table_name, column, schema=table_schema))
