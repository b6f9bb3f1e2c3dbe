"""PyTorch references of opforge's own ops, one per registered op, with the
op's own signature, and the inputs `opforge check` runs them on.

One module per op stem (the stem of its ``csrc/torch/<op>.c``) defines the
references of its ops and their backwards, the inputs functions, and
``REFERENCES``, op name -> :class:`Reference`; this package imports every
module it holds, re-exports each one's ``__all__`` and merges their
``REFERENCES`` here, so a new op's reference is a new file.

Each reference computes in the dtype it is given (the check hands it float64
copies of the op's inputs). The tests and benchmarks import these, so what is
timed and what is checked is what is tested.
"""

from __future__ import annotations

from .._discover import op_modules, reexport
from ._common import Reference

_modules = op_modules(__name__, __path__)
__all__ = ["REFERENCES", "Reference", *reexport(globals(), _modules)]

REFERENCES: dict[str, Reference] = {}
for _module in _modules:
    if twice := REFERENCES.keys() & _module.REFERENCES.keys():
        raise ImportError(f"{_module.__name__} gives references of ops another module gives: {sorted(twice)}")
    REFERENCES.update(_module.REFERENCES)
