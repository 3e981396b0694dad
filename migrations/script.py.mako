"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
${imports if imports else ""}
from eop import migrate

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade() -> None:
    """Describe what this revision changes."""
    # The schema is chosen at run time: never write its name in a migration.
    schema = migrate.configured_schema(context.config)
    ${(upgrades if upgrades else "pass").replace("schema=" + repr(eop_schema), "schema=schema")}


def downgrade() -> None:
    """Undo :func:`upgrade`."""
    schema = migrate.configured_schema(context.config)
    ${(downgrades if downgrades else "pass").replace("schema=" + repr(eop_schema), "schema=schema")}
