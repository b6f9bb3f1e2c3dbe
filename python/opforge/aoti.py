"""AOTInductor: models compiled ahead of time that call opforge's C directly.

    ep = torch.export.export(model, (x,))
    path = torch._inductor.aoti_compile_and_package(ep, inductor_configs=opforge.aoti_config())

:func:`aoti_config` gives inductor, for every op of the library that has a C
shim (csrc/torch/aoti.c), the C declaration it calls the shim through
(``aot_inductor.custom_ops_to_c_shims``) and how to link the library
(``aot_inductor.custom_op_libs``). The compiled model then calls each op's
CPU kernel as a C function: no dispatcher, no Python, no proxy executor, and
no registration -- a process that loads the package needs libopforge.so at the
path it was compiled against (or on LD_LIBRARY_PATH), not ``import opforge``.
Without these entries, inductor calls custom ops through its proxy executor,
which looks them up in the dispatcher: the process must have loaded the
library (``torch.ops.load_library(opforge.library_path())``, which registers
the ops, or ``import opforge``).

The declarations are derived from the ops' schemas; the library states the
parameter list of each shim it defines, and an op whose list differs from the
one derived here is refused (an error naming it), not called with the wrong
arguments.
"""

from __future__ import annotations

import ctypes
import os
import re
import shlex

import torch

from ._lib import OpLibrary, op_overload


def _c_type(t) -> str | None:
    """The C type inductor passes for a schema type (cpp_wrapper_cpu.py, c_type_for_prim_type)."""
    if isinstance(t, torch.OptionalType):
        inner = _c_type(t.getElementType())
        return None if inner is None else inner + ("*" if inner.endswith("*") else " *")
    if isinstance(t, torch.TensorType):
        return "AtenTensorHandle"
    if isinstance(t, torch.FloatType):
        return "double"
    if isinstance(t, torch.IntType):
        return "int64_t"
    if isinstance(t, torch.BoolType):
        return "int32_t"
    if isinstance(t, torch.StringType):
        return "const char *"  # a C string inductor writes as a literal; the shim copies it into a torch string
    return None  # lists, devices...: no shim


def c_parameters(schema) -> str | None:
    """The shim's parameters for a schema's arguments, outputs left out; None where a type has no C form."""
    params = []
    for arg in schema.arguments:
        c = _c_type(arg.type)
        if c is None:
            return None
        params.append(f"{c} {arg.name}" if not c.endswith("*") else f"{c}{arg.name}")
    return ", ".join(params)


def _same(a: str, b: str) -> bool:
    return re.sub(r"\s+", "", a) == re.sub(r"\s+", "", b)


def _shims(library: OpLibrary) -> dict[str, tuple[str, int]]:
    """op name -> (C parameters as the library writes them, number of outputs)."""
    shim_at = getattr(library.dll, "opforge_aoti_shim_at", None)
    if shim_at is None:
        return {}
    shim_at.argtypes = [ctypes.c_int] + [ctypes.POINTER(ctypes.c_char_p)] * 2 + [ctypes.POINTER(ctypes.c_int)]
    out, i = {}, 0
    op, params, nout = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_int()
    while shim_at(i, ctypes.byref(op), ctypes.byref(params), ctypes.byref(nout)):
        out[op.value.decode()] = (params.value.decode().strip()[1:-1], nout.value)  # without its parentheses
        i += 1
    return out


def _torch_shim_names(device: str = "cpu") -> set[str]:
    """The aoti_torch_<device>_* functions torch's own headers declare: a custom op of the same name
    would clash with them in the generated C++, so it keeps the proxy executor."""
    header = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc", "inductor", "aoti_torch",
                          "generated", f"c_shim_{device}.h")
    try:
        with open(header) as f:
            return set(re.findall(rf"\baoti_torch_{device}_(\w+)\s*\(", f.read()))
    except OSError:
        return set()


def shim_declarations(library: OpLibrary) -> dict[torch._ops.OpOverload, list[str]]:
    """{op: [its C declaration]} for every op of ``library`` that has a CPU shim.

    Inductor calls ``aoti_torch_cpu_<op>`` (the op's name without its namespace); the library's
    symbol is ``<namespace>_aoti_cpu_<op>``, and the declaration binds the one to the other with an
    asm label, so libraries built under different namespaces do not collide."""
    shims = _shims(library)
    taken = _torch_shim_names()
    decls = {}
    for desc in library.ops:
        if desc.name not in shims or "cpu" not in desc.devices or desc.name in taken:
            continue
        overload = op_overload(desc)
        schema = overload._schema
        params, nout = shims[desc.name]
        derived = c_parameters(schema)
        if derived is None or not _same(derived, params) or nout != len(schema.returns):
            raise RuntimeError(
                f"[{desc.namespace}::{desc.name}] its C shim takes ({params}) and {nout} outputs, but the schema "
                f"'{desc.schema}' gives ({derived}) and {len(schema.returns)}: update OPF_AOTI_OPS in "
                "csrc/torch/aoti.c"
            )
        c_args = ", ".join([params] + [f"AtenTensorHandle *ret{i}" for i in range(nout)])
        decls[overload] = [
            f'AOTITorchError aoti_torch_cpu_{desc.name}({c_args}) '
            f'__asm__("{desc.namespace}_aoti_cpu_{desc.name}")'
        ]
    return decls


def link_flags(library: OpLibrary) -> list[str]:
    """The ``custom_op_libs`` entry for ``library``: inductor writes each entry as ``-l<entry>`` into a
    command line it splits with shlex, so the entry also carries the directory to search and to record
    as the model's run path (the package then loads the library from where it was compiled against)."""
    directory, name = os.path.split(library.path)
    d = shlex.quote(directory)
    return [f"{shlex.quote(':' + name)} -L{d} -Wl,-rpath,{d}"]


def aoti_config(library: OpLibrary | None = None) -> dict:
    """The inductor config entries that make an AOTInductor-compiled model call ``library``'s ops
    (default: opforge's own) through their C shims::

        torch._inductor.aoti_compile_and_package(ep, inductor_configs=opforge.aoti_config())

    Merge with your other entries (a dict). CPU only: a model on another device keeps the proxy executor."""
    if library is None:
        from ._runtime import library
    return {
        "aot_inductor.custom_ops_to_c_shims": shim_declarations(library),
        "aot_inductor.custom_op_libs": link_flags(library),
    }
