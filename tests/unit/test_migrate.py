"""Where eop finds its migrations, wherever the module sits in the package."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from eop.pg import migrate

ROOT = Path(__file__).resolve().parents[2]


def test_migrations_path_is_alembics_script_directory() -> None:
    """Pins the path after a move of eop/pg/migrate.py: Alembic needs env.py and versions/."""
    path = migrate.migrations_path()
    assert (path / "env.py").is_file()
    assert (path / "versions").is_dir()


def test_alembics_env_uses_only_names_eop_defines() -> None:
    """migrations/env.py runs only under Alembic (no import-time check, outside mypy):
    every ``module.name`` it reads of an eop module it imports must exist there."""
    env = migrate.migrations_path() / "env.py"
    tree = ast.parse(env.read_text(), str(env))
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eop"):
            for alias in node.names:
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    assert modules, "env.py imports eop's modules"
    missing = [
        f"{modules[node.value.id]}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in modules
        and not hasattr(importlib.import_module(modules[node.value.id]), node.attr)
    ]
    assert missing == []


def test_a_checkout_finds_the_repositorys_migrations() -> None:
    """Not installed, eop runs the repository's ``migrations/`` (migrate.py sits in eop/pg/)."""
    assert migrate.migrations_path() == ROOT / "migrations"
