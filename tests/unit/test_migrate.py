"""Where eop's Alembic scripts are found."""

from __future__ import annotations

from pathlib import Path

from eop.pg import migrate

ROOT = Path(__file__).resolve().parents[2]


def test_a_checkout_finds_the_repositorys_migrations() -> None:
    """Not installed, eop runs the repository's ``migrations/`` (migrate.py sits in eop/pg/)."""
    assert migrate.migrations_path() == ROOT / "migrations"
