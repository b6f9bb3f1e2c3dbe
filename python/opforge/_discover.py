"""Packages made of one module per op (opforge.functional, opforge.references): each module is found
by its file, so adding an op edits no shared list."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def op_modules(package: str, path) -> list[ModuleType]:
    """Every module of the package (``__name__``, ``__path__``) but those named with a leading
    underscore (shared helpers), imported in the order of their names."""
    names = sorted(m.name for m in pkgutil.iter_modules(path) if not m.name.startswith("_"))
    return [importlib.import_module(f"{package}.{name}") for name in names]


def reexport(namespace: dict, modules: list[ModuleType]) -> list[str]:
    """Puts each module's ``__all__`` into namespace (the package's globals()) and returns the names.

    A module named as a function it exports (functional's ``linear``) is the package's attribute until
    then; afterwards the function is, and the module stays importable (``from .linear import ...``
    reads sys.modules)."""
    exported: dict[str, str] = {}
    for module in modules:
        for name in module.__all__:
            if name in exported:
                raise ImportError(f"{module.__name__} and {exported[name]} both export {name!r}")
            exported[name] = module.__name__
            namespace[name] = getattr(module, name)
    return list(exported)
