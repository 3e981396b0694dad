"""Where eop finds its migrations, wherever the module sits in the package."""

from __future__ import annotations

from eop.pg import migrate


def test_migrations_path_is_alembics_script_directory() -> None:
    """Pins the path after a move of eop/pg/migrate.py: Alembic needs env.py and versions/."""
    path = migrate.migrations_path()
    assert (path / "env.py").is_file()
    assert (path / "versions").is_dir()
