"""eop's import graph: no circle, and imports flow down the layers CONTRIBUTING.md maps.

The graph counts every import of an eop module: at the top of a module,
inside functions, and under ``TYPE_CHECKING``, since each of them ties the
two modules together for a reader as much as for the interpreter.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Modules in a folder of a lower layer that run the ``eop`` command, so in the cli layer:
#: the chaos harness's workers (``python -m eop.tools.chaos.armed``, its old path's alias
#: too) and Django's management commands. A ``__main__`` module is one as well.
ENTRY_POINTS = (
    "eop.tools.chaos.armed",
    "eop.chaos.armed",
    "eop.contrib.django.cli",
    "eop.contrib.django.management",
)

#: Old paths of modules that moved, kept as aliases (CONTRIBUTING.md, "Moved"): each in its
#: target's layer, and loaded by ``eop worker`` no more than its target.
MOVED: Mapping[str, str] = {
    "eop.embedded": "eop.tools.embedded",
    "eop.embedded_cluster": "eop.tools.embedded_cluster",
    "eop.chaos": "eop.tools.chaos",
    "eop.spark": "eop.contrib.spark",
}

#: The layers of CONTRIBUTING.md, lowest first: a module imports its own layer and those below.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "core",
        (
            "eop.errors",
            "eop.redaction",
            "eop.error_text",
            "eop.nats_access",
            "eop.rules",
            "eop.settings",
            "eop.log",
            "eop.faults",
            "eop.backoff",
            "eop.futures",
            "eop.scratch_owners",
        ),
    ),
    (
        "domain",
        (
            "eop.wire",
            "eop.message",
            "eop.payload",
            "eop.writes",
            "eop.handler",
            "eop.types",
        ),
    ),
    ("edges", ("eop.broker", "eop.pg")),
    ("app", ("eop.app",)),
    ("observe", ("eop.observe",)),
    ("protocol", ("eop.protocol",)),
    ("runtime", ("eop.runtime",)),
    ("api", ("eop",)),
    ("operations", ("eop.ops",)),
    ("contrib", ("eop.contrib", "eop.spark")),
    ("tools", ("eop.tools", "eop.chaos", "eop.embedded", "eop.embedded_cluster")),
    ("testing", ("eop.testing",)),
    ("cli", ("eop.cli", "eop.__main__", *ENTRY_POINTS)),
)

#: Feature packages: one concern read in one folder, its modules in several layers. Each
#: module is named here with its layer (the name of a row of LAYERS; of two rows of one
#: name, the first). A module of the package left out has no layer and fails the test,
#: rather than inheriting one: a new module says where it sits.
FEATURES: Mapping[str, Mapping[str, str]] = {
    "eop.outbox": {
        "eop.outbox": "api",  # eop.outbox.add
        "eop.outbox.outgoing": "domain",
        "eop.outbox.publishing": "domain",
        "eop.outbox.table": "edges",
        "eop.outbox.sql": "edges",
        "eop.outbox.notifications": "edges",
        "eop.outbox.jetstream_publisher": "edges",
        "eop.outbox.relay": "protocol",
        "eop.outbox.process": "runtime",
        "eop.outbox.operations": "operations",
        "eop.outbox.cli": "cli",
    },
    "eop.ordering": {
        "eop.ordering": "edges",  # no code: below each of its modules
        "eop.ordering.partitions": "edges",
        "eop.ordering.ownership": "edges",
        "eop.ordering.sql": "edges",
        "eop.ordering.keys": "protocol",
        "eop.ordering.heads": "protocol",
        "eop.ordering.share": "runtime",
        "eop.ordering.lanes": "runtime",
        "eop.ordering.status": "operations",
    },
}

#: What ``eop worker`` must never load: the developer tools, the integrations, the test kit
#: (and the old paths of those that moved).
TOOLS = ("eop.tools", "eop.contrib", "eop.testing", *MOVED)

#: Pairs of sides of one layer that must not know each other, each side its packages and
#: the feature packages' modules that belong to it.
APART: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (
        ("eop.broker", "eop.outbox.jetstream_publisher", "eop.ordering.partitions"),
        (
            "eop.pg",
            "eop.outbox.table",
            "eop.outbox.sql",
            "eop.outbox.notifications",
            "eop.ordering.ownership",
            "eop.ordering.sql",
        ),
    ),
)


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module at ``path`` (a package is its ``__init__``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the ``eop`` package under ``root`` and the eop modules it imports."""
    modules = {module_name(p, root): p for p in (root / "eop").rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    # `from eop import log` imports the module eop.log, not eop.
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else known(base))
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or (prefix != "eop" and module.startswith(prefix + "."))


def _rank(layer: str) -> int:
    return next(rank for rank, (name, _) in enumerate(LAYERS) if name == layer)


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s layer (entry points are the CLI's; a
    feature package's modules, the layer :data:`FEATURES` names)."""
    if module.endswith(".__main__"):
        return len(LAYERS) - 1
    for package, members in FEATURES.items():
        if _matches(module, package):
            if module not in members:
                raise AssertionError(
                    f"{module} is in no layer: name it in FEATURES and CONTRIBUTING.md"
                )
            return _rank(members[module])
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _matches(module, prefix) and (best is None or len(prefix) > len(best[1])):
                best = (rank, prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and CONTRIBUTING.md")
    return best[0]


def upward(graph: Mapping[str, set[str]]) -> Iterator[str]:
    """Each import from a lower layer to a higher one, as ``a -> b``."""
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(module):
                yield f"{module} ({LAYERS[layer_of(module)][0]}) -> {target}"


def test_eop_has_no_import_circle() -> None:
    """No two eop modules import each other, however indirectly or lazily."""
    assert circles(import_graph(ROOT)) == []


def test_imports_flow_down_the_layers() -> None:
    """No module imports one of a higher layer, and every module has a layer."""
    assert list(upward(import_graph(ROOT))) == []


def test_broker_and_pg_do_not_know_each_other() -> None:
    """NATS and PostgreSQL meet in the protocol only."""
    graph = import_graph(ROOT)

    def on(module: str, side: tuple[str, ...]) -> bool:
        return any(_matches(module, prefix) for prefix in side)

    crossing = [
        f"{m} -> {t}"
        for a, b in APART
        for m, targets in graph.items()
        for t in targets
        if (on(m, a) and on(t, b)) or (on(m, b) and on(t, a))
    ]
    assert crossing == []


def test_each_module_a_feature_package_names_exists_in_a_layer_that_exists() -> None:
    """FEATURES names no module that is gone, nor a layer LAYERS lacks."""
    graph = import_graph(ROOT)
    named = {module: layer for members in FEATURES.values() for module, layer in members.items()}
    assert sorted(m for m in named if m not in graph) == []
    assert sorted(layer for layer in named.values() if layer not in dict(LAYERS)) == []


def copy_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the eop package whose ``module`` imports ``line`` inside a function."""
    for path in (ROOT / "eop").rglob("*.py"):
        copy = tmp_path / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    target = tmp_path / Path(*module.split(".")).with_suffix(".py")
    target.write_text(target.read_text() + f"\n\ndef _late() -> None:\n    {line}\n")
    return tmp_path


def test_the_checks_see_a_circle_closed_by_an_import_in_a_function(tmp_path: Path) -> None:
    """The circle check fails on a circle added on purpose, made by a lazy import."""
    graph = import_graph(copy_with(tmp_path, "eop.errors", "from eop import log"))
    assert any({"eop.errors", "eop.log"} <= set(circle) for circle in circles(graph))


def test_the_checks_see_an_import_up_the_layers(tmp_path: Path) -> None:
    """The layer check fails on a core module importing the runtime, even lazily."""
    graph = import_graph(copy_with(tmp_path, "eop.log", "from eop.runtime import worker"))
    assert "eop.log (core) -> eop.runtime.worker" in list(upward(graph))


def test_the_checks_see_a_feature_module_importing_up_its_own_package(tmp_path: Path) -> None:
    """A feature package's module keeps its own layer: the outbox's outgoing message
    (domain) importing its relay (protocol) is an import up the layers."""
    graph = import_graph(copy_with(tmp_path, "eop.outbox.outgoing", "from eop.outbox import relay"))
    assert "eop.outbox.outgoing (domain) -> eop.outbox.relay" in list(upward(graph))


def test_a_feature_packages_module_not_named_has_no_layer() -> None:
    """A module added to a feature package takes no layer from its folder: it fails until
    FEATURES names it."""
    with pytest.raises(AssertionError, match=r"eop\.outbox\.unnamed is in no layer"):
        layer_of("eop.outbox.unnamed")


def test_each_folder_of_eop_is_one_layer() -> None:
    """The layers are the folders: every module of a package folder of eop (but a feature
    package's) is in the folder's one layer, save the entry points that run ``eop``."""
    layers: dict[str, set[str]] = {}
    for module in import_graph(ROOT):
        parts = module.split(".")
        if len(parts) < 2 or not (ROOT / "eop" / parts[1]).is_dir():
            continue  # eop/__init__ and the modules beside it: no folder
        entry = module.endswith(".__main__") or any(_matches(module, e) for e in ENTRY_POINTS)
        if entry or any(_matches(module, package) for package in FEATURES):
            continue
        layers.setdefault(parts[1], set()).add(LAYERS[layer_of(module)][0])
    mixed = {folder: sorted(found) for folder, found in layers.items() if len(found) > 1}
    assert mixed == {}
    folders = {folder: min(found) for folder, found in layers.items()}
    pinned = {"ops": "operations", "contrib": "contrib", "tools": "tools", "testing": "testing"}
    assert {folder: folders.get(folder) for folder in pinned} == pinned


def test_eop_worker_loads_none_of_the_tools(tmp_path: Path) -> None:
    """``eop worker`` imports nothing of eop.tools (chaos, bench, demo, the embedded
    servers), eop.contrib (Spark, Django) or the test kit."""
    code = (
        "import sys\n"
        "from eop import cli\n"
        "cli.main(['worker', 'no_such_module_xyz:app'])\n"
        "print(' '.join(m for m in sys.modules if m.startswith('eop')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    loaded = set(done.stdout.split())
    assert "eop.runtime.worker" in loaded, done.stderr  # it got as far as the worker
    assert sorted(m for m in loaded if any(_matches(m, tool) for tool in TOOLS)) == []


#: CONTRIBUTING asks for modules under about this many lines.
MODULE_LINES = 500

#: The modules still over it, each with the most lines it may have and the seam along
#: which it is to be split. One that shrinks under the limit must leave this list, and
#: none may grow: a new module over the limit fails the test until it is split.
LARGER: Mapping[str, tuple[int, str]] = {}


def test_modules_stay_under_the_size_limit_or_are_named_with_their_seam() -> None:
    """No module over MODULE_LINES lines but those of LARGER, none of those growing past
    its ceiling, and none listed there once it is back under the limit."""
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for path in (ROOT / "eop").rglob("*.py")
    }
    over = {name: n for name, n in sizes.items() if n > MODULE_LINES}
    unlisted = {name: n for name, n in over.items() if name not in LARGER}
    grown = {name: n for name, n in over.items() if name in LARGER and n > LARGER[name][0]}
    split = sorted(name for name in LARGER if sizes.get(name, 0) <= MODULE_LINES)
    assert (unlisted, grown, split) == ({}, {}, [])
