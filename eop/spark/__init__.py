"""An alias of :mod:`eop.contrib.spark`, where eop's Spark integration moved: import that instead.

``from eop.spark import session, sink`` and ``eop.spark.jobs.backfill(...)``
keep working: each name is that module of :mod:`eop.contrib.spark` (the same
object), imported when first asked for, so that importing this alias imports
no PySpark. ``import eop.spark.jobs`` does not: name the new path. ``python -m
eop.spark`` is ``python -m eop.contrib.spark`` (spark-submit's entry point).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from eop.contrib import spark as _moved


def __getattr__(name: str) -> ModuleType:
    """The module ``name`` of :mod:`eop.contrib.spark`."""
    if name.startswith("__"):  # the import system's probes (__all__...): no module of eop's
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    target = f"{_moved.__name__}.{name}"
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name != target:
            raise  # the module exists, something it imports does not (PySpark)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
