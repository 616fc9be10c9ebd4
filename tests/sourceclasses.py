"""Every class defined in llmgw's modules (or the harness's), found by importing each (what
a structural test walks: records defined twice, error classes outside the tree)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import llmgw

# Run by alembic alone (it reads alembic.context.config at import); __main__ runs the CLI.
_NOT_IMPORTED = (".migrations.", ".__main__")


def llmgw_modules(package: ModuleType = llmgw) -> list[ModuleType]:
    """Every module of package (llmgw, or llmgw_harness), imported."""
    found = []
    for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        if not any(part in info.name + "." for part in _NOT_IMPORTED):
            found.append(importlib.import_module(info.name))
    return found


def classes_of(modules: list[ModuleType]) -> list[type]:
    """The classes each module defines itself (not those it imports)."""
    return [obj for module in modules for obj in vars(module).values()
            if inspect.isclass(obj) and obj.__module__ == module.__name__]
