"""Which ops the generic tests run, and how: the library's table says which ops there are, and each op's
own test module, tests/python/test_<stem>.py, says how each generic test exercises it, in a module-level
table the test reads:

    FUZZ      fuzz.py                 fuzz case name -> fuzz.Op (draw, check, weight, roundings, ...)
    EXPORT    test_export.py          op -> the op's part of the exported model
    TRAINING  test_training.py        case name -> training.Case (autocast, checkpoint, determinism)
    SWEEP     test_thread_sweep.py    op -> a function giving its thread_sweep.Case list

No other file lists ops, so a new op is its own files: a table in its test module is found by its file.
Each generic test fails, naming the op, when the library has a forward op that no table covers.
"""

from __future__ import annotations

import glob
import importlib
import os
import re
import sys
from types import ModuleType

HERE = os.path.dirname(os.path.abspath(__file__))


def forward_ops() -> list[str]:
    """The library's forward ops, in its table's order: every op but the backward ops its descriptors
    name (.backward) and their in-place variants (that name + "_")."""
    import opforge

    backward = {n for d in opforge.library.ops if d.backward for n in (d.backward, d.backward + "_")}
    return [d.name for d in opforge.library.ops if d.name not in backward]


def _module(name: str) -> ModuleType:
    # the modules beside this one import as top-level modules, as pytest imports them (rootdir conftest)
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    return importlib.import_module(name)


def modules(table: str) -> list[ModuleType]:
    """The test modules beside this file (test_*.py, in file-name order) that assign `table` at module
    level, imported on first use; a module whose text assigns no such name is not imported."""
    assigns = re.compile(rf"^{table}\s*(:[^=\n]*)?=", re.M)
    found = []
    for path in sorted(glob.glob(os.path.join(HERE, "test_*.py"))):
        with open(path, encoding="utf-8") as f:
            if assigns.search(f.read()):
                found.append(_module(os.path.splitext(os.path.basename(path))[0]))
    return found


def entries(table: str) -> dict:
    """Every module's `table` merged: {name: description}, in file-name order. A name two modules
    give is an error naming both."""
    out, where = {}, {}
    for module in modules(table):
        for name, value in getattr(module, table).items():
            if name in out:
                raise ValueError(f"{table}: {name!r} is described in both {where[name]} and {module.__name__}")
            out[name], where[name] = value, module.__name__
    return out


def coverage(table: str, covered) -> str | None:
    """None when the ops `covered` are exactly the library's forward ops, else what differs: the ops no
    test module's `table` covers, and the names it covers that the library lacks."""
    ops, covered = forward_ops(), set(covered)
    missing = [op for op in ops if op not in covered]
    unknown = sorted(covered - set(ops))
    if not missing and not unknown:
        return None
    lines = []
    if missing:
        lines.append(f"forward ops no test module's {table} covers: {', '.join(missing)} "
                     f"(describe each in its tests/python/test_<stem>.py; see tests/python/discover.py)")
    if unknown:
        lines.append(f"{table} covers ops the library lacks: {', '.join(unknown)}")
    return "\n".join(lines)
