"""The shape notation of a descriptor's ``.shape`` (documented in csrc/include/opforge/op.h).

A rule is compiled once, against the op's schema, when its library loads: a
typo fails there, naming the op. Fake kernels evaluate the compiled rule on
the arguments' sizes, which may be symbolic (torch.compile(dynamic=True)), so
evaluation only slices and indexes ``Tensor.shape`` and never asks for an int.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

FORMS = (
    "like:ARG (ARG's sizes, dtype and dense strides)",
    "[SIZES] [dtype=ARG|DTYPE|promote(ARG|DTYPE,...)] [perm=I,J,...] [if ARG and ARG ...], SIZES a comma list "
    "of ARG[i], ARG[i:j] and integers",
)

DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool")
}

_ITEM = re.compile(r"^(?:(?P<int>-?\d+)|(?P<arg>\w+)\[(?:(?P<index>-?\d+)|(?P<start>-?\d*):(?P<stop>-?\d*))\])$")
_OPTIONS = re.compile(r"^(?:dtype=(?P<dtype>\w+|promote\([\w,\s]*\)))?\s*(?:perm=(?P<perm>\d+(?:,\d+)*))?\s*(?:if\s+(?P<when>\w+(?:\s+and\s+\w+)*))?$")


def output_strides(sizes, strides) -> list:
    """Python twin of opf_output_strides (csrc/runtime/nditer.c): the strides the
    C kernels give a new output shaped like a tensor with these sizes/strides."""
    dims = [d for d, s in enumerate(sizes) if s != 1]
    dense = all(s != 0 for s in sizes)
    if dense:
        expected = 1
        for d in sorted(dims, key=lambda d: strides[d]):  # stable, as the C sort
            if strides[d] != expected:
                dense = False
                break
            expected *= sizes[d]
    if dense:
        return list(strides)
    out, step = [0] * len(sizes), 1
    for d in range(len(sizes) - 1, -1, -1):
        out[d] = step
        step *= max(sizes[d], 1)
    return out


@dataclass(frozen=True)
class ShapeRule:
    """One output's rule, its argument names resolved to schema positions.

    sizes: ("int", n) | ("index", arg, i) | ("slice", arg, start, stop) per item.
    dtype: an argument's position or a dtype, or a tuple of them to promote (torch.promote_types);
    None: the first tensor argument's.
    """

    text: str
    op: str  # "ns::name", for messages
    output: int
    argnames: tuple[str, ...]
    defaults: tuple
    like: int | None = None
    sizes: tuple = ()
    dtype: int | torch.dtype | tuple | None = None
    perm: tuple[int, ...] | None = None
    when: tuple[int, ...] = ()
    off: tuple = ()  # per `when` argument, the enum value that counts as false (its first), else None

    def __str__(self) -> str:
        return self.text

    def evaluate(self, args: tuple) -> torch.Tensor:
        """A new (fake) tensor as the rule describes, made on the device of the first tensor argument."""
        args = tuple(args) + self.defaults[len(args) :]  # arguments left out take their schema defaults
        if self.like is not None:
            t = args[self.like]
            return t.new_empty_strided(t.shape, output_strides(t.shape, t.stride()))
        base = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if base is None:
            raise RuntimeError(f"[{self.op}] output {self.output} ('{self.text}'): no tensor argument to take the device from")
        dtype = self._dtype(args, base)
        if not all(_given(args[i], off) for i, off in zip(self.when, self.off)):
            return base.new_empty((0,), dtype=dtype)  # dtype=ARG of an ARG left out: the first tensor's
        sizes = []
        for item in self.sizes:
            if item[0] == "int":
                sizes.append(item[1])
                continue
            t, i = args[item[1]], item[2]
            if item[0] == "index":
                if not -t.dim() <= i < t.dim():
                    raise RuntimeError(
                        f"[{self.op}] argument '{self.argnames[item[1]]}' must have at least "
                        f"{i + 1 if i >= 0 else -i} dimensions (output {self.output}: '{self.text}'), got {t.dim()}"
                    )
                sizes.append(t.shape[i])
            else:
                sizes.extend(t.shape[i : item[3]])
        if self.perm is not None and len(self.perm) != len(sizes):
            raise RuntimeError(
                f"[{self.op}] output {self.output} ('{self.text}') has {len(sizes)} sizes for a "
                f"permutation of {len(self.perm)}"
            )
        out = base.new_empty(sizes, dtype=dtype)
        return out if self.perm is None else out.permute(self.perm)

    def _dtype(self, args: tuple, base: torch.Tensor) -> torch.dtype:
        """dtype=: an argument's (the first tensor's for one left out), a fixed one, or their promotion."""
        items = self.dtype if isinstance(self.dtype, tuple) else (self.dtype,)
        dtypes = [base.dtype if i is None or (isinstance(i, int) and args[i] is None) else
                  args[i].dtype if isinstance(i, int) else i for i in items]
        return functools.reduce(torch.promote_types, dtypes)


def _given(v, off=None) -> bool:
    """An `if` argument holds: given, and a tensor or a true value (activation 0 is not, nor an enum's
    first value, the 0 its kernel sees: activation "none")."""
    return v is not None and (isinstance(v, torch.Tensor) or (bool(v) and (off is None or v != off)))


def _bad(op: str, output: int, text: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"[{op}] bad shape rule '{text}' for output {output}: {why}. Valid forms: {'; '.join(FORMS)}; "
        f"DTYPE one of {', '.join(DTYPES)}"
    )


def _closing(text: str) -> int:
    """The index of the ']' that closes text[0], or -1."""
    depth = 0
    for i, c in enumerate(text):
        depth += c == "["
        depth -= c == "]"
        if depth == 0:
            return i
    return -1


def compile_rules(op: str, schema: torch._C.FunctionSchema, shape: str | None,
                  enums: dict[str, tuple[str, ...]] | None = None) -> tuple[ShapeRule, ...]:
    """The ';'-separated rules of a descriptor, one per output of the schema, checked against it;
    enums: the descriptor's, argument -> its values."""
    texts = [t.strip() for t in shape.split(";")] if shape else []
    if len(texts) != len(schema.returns):
        raise RuntimeError(
            f"[{op}] the descriptor's .shape has {len(texts)} rule(s) for the schema's {len(schema.returns)} "
            f"output(s): give one per output, ';'-separated. Valid forms: {'; '.join(FORMS)}"
        )
    return tuple(_compile(op, schema, k, t, enums or {}) for k, t in enumerate(texts))


def _compile(op: str, schema, output: int, text: str, enums: dict[str, tuple[str, ...]]) -> ShapeRule:
    argnames = tuple(a.name for a in schema.arguments)
    defaults = tuple(a.default_value if a.has_default_value() else None for a in schema.arguments)
    # "Tensor" or "Tensor?" for the tensor arguments a rule may read, the schema's type otherwise
    types = {a.name: {"Tensor": "Tensor", "Optional[Tensor]": "Tensor?"}.get(str(a.type), str(a.type)) for a in schema.arguments}

    def arg(name: str, tensor: bool = True) -> int:
        if name not in types:
            raise _bad(op, output, text, f"no argument '{name}' in the schema (it has {', '.join(argnames)})")
        if tensor and types[name] not in ("Tensor", "Tensor?"):
            raise _bad(op, output, text, f"argument '{name}' is {types[name]}, not a Tensor")
        return argnames.index(name)

    def dtype_item(name: str) -> int | torch.dtype:
        if name in DTYPES:
            return DTYPES[name]
        i = arg(name)
        if types[name] != "Tensor" and i not in when:
            raise _bad(op, output, text, f"dtype={options['dtype']}: an optional argument may be None: "
                                         f"take '{name}' under 'if {name}'")
        return i

    common = dict(text=text, op=op, output=output, argnames=argnames, defaults=defaults)
    if text.startswith("like:"):
        i = arg(text[5:].strip())
        if types[argnames[i]] != "Tensor":
            raise _bad(op, output, text, f"like: takes a Tensor argument, '{argnames[i]}' is {types[argnames[i]]}")
        return ShapeRule(like=i, **common)
    end = _closing(text) if text.startswith("[") else -1
    if end < 0:
        raise _bad(op, output, text, "it starts with neither 'like:' nor a bracketed size list")
    options = _OPTIONS.match(text[end + 1 :].strip())
    if not options:
        raise _bad(op, output, text, f"cannot read the options '{text[end + 1:].strip()}'")
    when = tuple(arg(n, tensor=False) for n in options["when"].split() if n != "and") if options["when"] else ()
    sizes = []
    for item in filter(None, (s.strip() for s in text[1:end].split(","))):
        m = _ITEM.match(item)
        if not m:
            raise _bad(op, output, text, f"cannot read the size '{item}'")
        if m["int"] is not None:
            sizes.append(("int", int(m["int"])))
            continue
        i = arg(m["arg"])
        if types[m["arg"]] != "Tensor" and i not in when:
            raise _bad(op, output, text, f"'{m['arg']}' may be None: read its sizes under 'if {m['arg']}'")
        if m["index"] is not None:
            sizes.append(("index", i, int(m["index"])))
        else:
            sizes.append(("slice", i, int(m["start"]) if m["start"] else None, int(m["stop"]) if m["stop"] else None))
    if options["dtype"] and options["dtype"].startswith("promote("):
        names = [n.strip() for n in options["dtype"][len("promote("):-1].split(",")]
        if len(names) < 2 or not all(names):
            raise _bad(op, output, text, f"dtype={options['dtype']}: promote takes two or more ARG|DTYPE items")
        dtype = tuple(dtype_item(n) for n in names)
    elif options["dtype"]:
        dtype = dtype_item(options["dtype"])
    else:
        dtype = next((s[1] for s in sizes if s[0] != "int"), None)
        if dtype is None:
            raise _bad(op, output, text, "no argument in the sizes to take the dtype from: give dtype=")
        if types[argnames[dtype]] != "Tensor" and dtype not in when:
            raise _bad(op, output, text, f"the dtype would come from '{argnames[dtype]}', which may be None: give dtype=")
    perm = tuple(int(p) for p in options["perm"].split(",")) if options["perm"] else None
    if perm is not None:
        if sorted(perm) != list(range(len(perm))):
            raise _bad(op, output, text, f"perm={options['perm']} is not a permutation of 0..{len(perm) - 1}")
        if all(s[0] != "slice" for s in sizes) and len(sizes) != len(perm):
            raise _bad(op, output, text, f"{len(sizes)} sizes for a permutation of {len(perm)}")
    off = tuple(enums[argnames[i]][0] if argnames[i] in enums else None for i in when)
    return ShapeRule(sizes=tuple(sizes), dtype=dtype, perm=perm, when=when, off=off, **common)
