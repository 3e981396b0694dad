"""The docs name code that exists: every file, module, function and test they point at.

docs/design.md sends a reader to the code and the tests behind each invariant
(``pg/sql_transaction.translate_commit``,
``tests/unit/test_batch.py::test_...``). A rename that leaves such a pointer
behind sends the reader nowhere, silently; this test reads every backquoted
reference in the docs, CONTRIBUTING.md and the README and checks that what it
names is there, by parsing the code (nothing is imported).
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "CONTRIBUTING.md", ROOT / "README.md"])

#: eop's folders a bare module path starts with (``protocol/batch``): a path that starts
#: with one of them and names no module is a broken reference, not some other text.
EOP_FOLDERS = frozenset(p.name for p in (ROOT / "eop").iterdir() if p.is_dir())

_CODE = re.compile(r"`([^`\n]+)`")
_TEST = re.compile(r"^(tests/[\w/]+\.py)::(\w+)")
_FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml")
#: ``protocol/batch``, ``pg/sql/inbox.claim``, ``protocol/batch.BatchProcessor._commit``,
#: optionally called (``Compactor.prepare()``).
_MODULE = re.compile(r"^([a-z_]+(?:/[a-z_]+)+)(?:\.([A-Za-z_][\w.]*))?(?:\(.*\))?$")


def references() -> Iterator[tuple[str, str]]:
    """Every backquoted text of the docs that could name code, with where it stands."""
    for doc in DOCS:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for text in _CODE.findall(line):
                text = text.strip()
                if "/" in text and " " not in text and "*" not in text:
                    yield f"{doc.relative_to(ROOT)}:{number}", text


def module_file(path: str) -> Path | None:
    """The source of ``path`` (``pg/sql/inbox``), relative to ``eop/`` or to the root."""
    for base in (ROOT / "eop" / path, ROOT / path):
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py")
        if (base / "__init__.py").is_file():
            return base / "__init__.py"
    return None


@functools.cache
def defined(source: Path) -> dict[str, frozenset[str]]:
    """The names a module defines or imports at its top, each class with its members."""
    found: dict[str, frozenset[str]] = {}
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef):
            found[node.name] = frozenset(_members(node))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found[node.name] = frozenset()
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                found[alias.asname or alias.name.split(".")[0]] = frozenset()
        else:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        found[name.id] = frozenset()
    return found


def _members(cls: ast.ClassDef) -> Iterator[str]:
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    yield target.id
                elif isinstance(target, ast.Attribute):
                    yield target.attr


def broken(text: str) -> str | None:
    """Why the reference ``text`` names nothing, or None when it names what exists."""
    test = _TEST.match(text)
    if test:
        source = ROOT / test.group(1)
        if not source.is_file():
            return "no such test file"
        if not re.search(rf"def {test.group(2)}\b", source.read_text(encoding="utf-8")):
            return f"{test.group(1)} has no {test.group(2)}"
        return None
    if text.endswith(_FILE_SUFFIXES):
        exists = (ROOT / text).exists() or (ROOT / "eop" / text).exists()
        return None if exists else "no such file"
    module = _MODULE.match(text)
    if module is None:
        return None
    source = module_file(module.group(1))
    if source is None:
        return "no such module" if module.group(1).split("/")[0] in EOP_FOLDERS else None
    if module.group(2) is None:
        return None
    name, *member = module.group(2).split(".")
    names = defined(source)
    if name not in names:
        return f"{module.group(1)} has no {name}"
    if member and names[name] and member[0] not in names[name]:
        return f"{name} has no {member[0]}"
    return None


def test_the_reference_reader_finds_what_is_there_and_flags_what_is_not() -> None:
    """The checker itself: a real module, function, method and test pass; renamed ones fail."""
    assert broken("protocol/batch") is None
    assert broken("pg/sql_transaction.translate_commit") is None
    assert broken("protocol/batch.BatchProcessor._commit_and_ack") is None
    here = "tests/unit/test_doc_references.py"
    assert broken(f"{here}::test_every_code_reference_in_the_docs_exists") is None
    assert broken("pg/transactions._commit") == "pg/transactions has no _commit"
    assert broken("protocol/batch.BatchProcessor._gone") == "BatchProcessor has no _gone"
    assert broken("broker/partitions") == "no such module"
    assert broken(f"{here}::test_gone") == f"{here} has no test_gone"
    assert broken("docs/gone.md") == "no such file"


def test_every_code_reference_in_the_docs_exists() -> None:
    """No file, module, name or test the docs point at is missing (renamed or deleted)."""
    missing = [f"{where}: `{text}`: {why}" for where, text in references() if (why := broken(text))]
    if missing:
        pytest.fail("the docs point at code that is not there:\n" + "\n".join(missing))
