"""Loads an op library and wires its C descriptors into PyTorch.

A library built from C exports ``opforge_op_table``; for each descriptor this
module registers, generically, the fake kernel (from the shape rule), the
autograd formula (from the backward op) and the autocast kernels (from the
policy). Nothing here is specific to any one op.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as _forward_ad

from . import _torch_private as _private
from ._shape import ShapeRule, compile_rules, output_strides  # noqa: F401  (output_strides: the public twin)

MIN_TORCH = (2, 10)
_ERRLEN = 2048

AUTOCAST_NONE, AUTOCAST_LOWER, AUTOCAST_FP32, AUTOCAST_PROMOTE, AUTOCAST_FOLLOW = 0, 1, 2, 3, 4


class _Desc(ctypes.Structure):
    _fields_ = [
        ("schema", ctypes.c_char_p),
        ("cpu", ctypes.c_void_p),
        ("cuda", ctypes.c_void_p),
        ("shape", ctypes.c_char_p),
        ("backward", ctypes.c_char_p),
        ("backward_args", ctypes.c_char_p),
        ("backward_grads", ctypes.c_char_p),
        ("autocast", ctypes.c_int),
        ("flops", ctypes.c_char_p),
        ("meta", ctypes.c_int),
        ("autocast_cuda", ctypes.c_int),
        ("enums", ctypes.c_char_p),
    ]


@dataclass(frozen=True)
class OpDescriptor:
    """One op as declared in C (see csrc/include/opforge/op.h)."""

    namespace: str
    name: str
    schema: str
    devices: tuple[str, ...]
    shape: tuple[ShapeRule, ...]
    backward: str | None
    backward_args: tuple[str, ...]
    backward_grads: tuple[str, ...]
    autocast: int
    flops: str | None = None
    meta: bool = False
    autocast_cuda: int = AUTOCAST_NONE  # the policy under CUDA autocast where it differs (NONE: autocast's)
    enums: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (argument, its values) per str argument with a fixed set

    def autocast_on(self, device: str) -> int:
        """The autocast policy on a device type."""
        return self.autocast_cuda if device == "cuda" and self.autocast_cuda else self.autocast

    def enum_values(self, arg: str) -> tuple[str, ...] | None:
        """The values the str argument ``arg`` takes, in the order whose index the C kernel gets; None
        where the argument takes no fixed set."""
        return dict(self.enums).get(arg)

    def check_enum(self, arg: str, value) -> None:
        """Raises the C kernel's RuntimeError (opf_arg_enum) for a value ``arg`` does not take."""
        values = self.enum_values(arg)
        if value is not None and values is not None and value not in values:
            expected = ", ".join(f"'{v}'" for v in values)
            raise RuntimeError(f"[{self.namespace}::{self.name}] argument '{arg}' must be one of {expected}, "
                               f"got '{value}'")


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch_version() -> None:
    if _torch_version() < MIN_TORCH:
        raise ImportError(
            f"opforge needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (its ops register through the "
            f"stable C ABI of that release); this is torch {torch.__version__}. "
            f"Upgrade with: pip install 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}'"
        )


def _str(b: bytes | None) -> str | None:
    return None if b is None else b.decode()


def _split(b: bytes | None, sep: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in b.decode().split(sep)) if b else ()


class OpLibrary:
    """A loaded op library: its ctypes handle (kept alive) and descriptors.

    ``runtime`` is the library that registers the ops (opforge's own, which
    user op libraries link); None for opforge's own library itself.
    ``namespace`` None: the one compiled into the library (opforge's own,
    whose namespace is a build parameter, exported as opforge_namespace).
    """

    def __init__(self, path: str, namespace: str | None = None, runtime: "OpLibrary | None" = None):
        check_torch_version()
        self.path = os.path.abspath(path)
        try:
            self.dll = ctypes.CDLL(self.path)
        except OSError as e:
            raise ImportError(
                f"cannot load the op library {path}: {e}. A missing torch symbol means this torch "
                f"is older than {MIN_TORCH[0]}.{MIN_TORCH[1]} or the library was built for another torch: "
                "rebuild it"
            ) from e
        if namespace is None:
            compiled_in = getattr(self.dll, "opforge_namespace", None)
            if compiled_in is None or runtime is not None:
                raise ImportError(f"{path} has no namespace compiled in: pass the namespace to load it under")
            compiled_in.restype = ctypes.c_char_p
            namespace = compiled_in().decode()
        self.namespace = namespace
        table_fn = getattr(self.dll, "opforge_op_table", None)
        if table_fn is None:
            raise ImportError(f"{path} exports no opforge_op_table(): declare the ops with OPF_OP_TABLE")
        table_fn.restype = ctypes.POINTER(_Desc)
        table_fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        err = ctypes.create_string_buffer(_ERRLEN)
        table = table_fn(err, ctypes.c_size_t(_ERRLEN))
        if not table:
            raise ImportError(f"opforge: {path}: {err.value.decode()}")
        count = 0
        while table[count].schema is not None:  # the table ends with OPF_OP_END
            count += 1
        # every descriptor is checked before any op is registered: a bad one leaves the namespace free
        self.ops = [self._descriptor(table[i]) for i in range(count)]
        _check_fields(self.ops)
        if runtime is None:
            # opforge's own library registered its schemas and CPU kernels as it was loaded (as a C++
            # extension does, so that a deployed program needs only torch.ops.load_library); what is
            # left is the Python side: fake kernels, autograd, autocast
            self._call("opforge_registered")
            self._call("opforge_init")
        else:
            runtime._call("opforge_register", namespace.encode(), table)
        backward_ops = {name for d in self.ops if d.backward for name in (d.backward, d.backward + "_")}
        for desc in self.ops:
            wire(desc, is_backward=desc.name in backward_ops)
        # lib.<op> is built here, not on first lookup: dynamo cannot trace
        # op_function (it iterates the schema), so a first lookup inside a
        # torch.compile'd function would break the graph
        for desc in self.ops:
            if not hasattr(self, desc.name):  # an op named like an attribute (ops, path) stays torch.ops-only
                setattr(self, desc.name, op_function(op_overload(desc))(_stub(namespace, desc.name)))

    def __getattr__(self, name: str):
        """Only reached for names that are not ops (every op is an attribute, set at load)."""
        raise AttributeError(f"op library '{self.__dict__.get('namespace')}' has no op '{name}'")

    def _call(self, fn: str, *args) -> None:
        err = ctypes.create_string_buffer(_ERRLEN)
        if getattr(self.dll, fn)(*args, err, ctypes.c_size_t(_ERRLEN)) != 0:
            raise RuntimeError(f"opforge: {err.value.decode()}")

    def _descriptor(self, d: _Desc) -> OpDescriptor:
        schema = _str(d.schema)
        name = schema.partition("(")[0].strip()  # as opforge_register reads it
        try:
            parsed = torch._C.parse_schema(schema)
        except RuntimeError as e:
            raise RuntimeError(f"[{self.namespace}::{name}] cannot parse the schema '{schema}': {e}") from e
        enums = _enums(f"{self.namespace}::{name}", parsed, _str(d.enums))
        return OpDescriptor(
            namespace=self.namespace,
            name=name,
            schema=schema,
            devices=tuple(dev for dev, fn in (("cpu", d.cpu), ("cuda", d.cuda)) if fn),
            shape=compile_rules(f"{self.namespace}::{name}", parsed, _str(d.shape), dict(enums)),
            backward=_str(d.backward),
            backward_args=_split(d.backward_args, ","),
            backward_grads=_split(d.backward_grads, ","),
            autocast=d.autocast,
            flops=_str(d.flops),
            meta=bool(d.meta),
            autocast_cuda=d.autocast_cuda,
            enums=enums,
        )

    def descriptor(self, name: str) -> OpDescriptor:
        """The descriptor of the op ``name`` (its schema's name, without the namespace)."""
        for desc in self.ops:
            if desc.name == name:
                return desc
        raise KeyError(f"op library '{self.namespace}' has no op '{name}'")


_POLICIES = (AUTOCAST_NONE, AUTOCAST_LOWER, AUTOCAST_FP32, AUTOCAST_PROMOTE, AUTOCAST_FOLLOW)


def _check_fields(ops: list[OpDescriptor]) -> None:
    """The descriptors' fields that name other things, checked against the schemas before anything is
    registered, so that a mistake is an error at load naming the op and the field (not a ValueError, or
    a failure at the first backward): .backward names an op of the same table, whose arguments
    .backward_args lists one for one and whose results .backward_grads names; every item of those is a
    gradN / outN / needs or an argument of the op; .flops is a product of terms (_flop_factors) whose
    numel(ARG) and size(ARG, d) name tensor arguments; .autocast and .autocast_cuda are policies."""
    by_name = {d.name: d for d in ops}
    for d in ops:
        op = f"{d.namespace}::{d.name}"
        schema = torch._C.parse_schema(d.schema)
        args = [a.name for a in schema.arguments]
        tensors = [a.name for a in schema.arguments if is_tensor_arg(a)]
        for field, value in (("autocast", d.autocast), ("autocast_cuda", d.autocast_cuda)):
            if value not in _POLICIES:
                raise RuntimeError(f"[{op}] .{field} must be one of the OPF_AUTOCAST_* policies "
                                   f"(0-{len(_POLICIES) - 1}), got {value}")
        for _, numel_arg, size_arg, _ in _flop_factors(d):
            named = numel_arg or size_arg
            if named and named not in tensors:
                raise RuntimeError(f"[{op}] .flops names '{named}', which is not a tensor argument of the op "
                                   f"(its tensor arguments: {', '.join(tensors)})")
        if not d.backward:
            continue
        bwd = by_name.get(d.backward)
        if bwd is None:
            raise RuntimeError(f"[{op}] .backward names '{d.backward}', which this library's op table does not "
                               f"declare (its ops: {', '.join(by_name)})")
        for name in d.backward_grads:
            if name not in tensors:
                raise RuntimeError(f"[{op}] .backward_grads names '{name}', which is not a tensor argument of the op "
                                   f"(its tensor arguments: {', '.join(tensors)})")
        returns = len(schema.returns)
        for item in d.backward_args:
            # ARG! or outI!: the backward may write over it; outI!ARG: it writes ARG's gradient over output I
            name, donated, onto = item.partition("!")
            numbered = re.fullmatch(r"(grad|out)(\d+)", name)
            if item == "needs" or name in args and (not donated or name in tensors) and not onto:
                continue
            if numbered and int(numbered.group(2)) < returns and not (donated and numbered.group(1) == "grad") and \
                    (not onto or onto in d.backward_grads):
                continue
            raise RuntimeError(f"[{op}] .backward_args: '{item}' is none of gradI, outI, outI!, outI!ARG (I < "
                               f"{returns}, the op's results; ARG one of .backward_grads), needs, or an argument of "
                               f"the op, ARG! for a tensor (its arguments: {', '.join(args)})")
        bwd_schema = torch._C.parse_schema(bwd.schema)
        bwd_args = [a.name for a in bwd_schema.arguments]
        if len(bwd_args) != len(d.backward_args):
            raise RuntimeError(f"[{op}] .backward_args lists {len(d.backward_args)} values "
                               f"({', '.join(d.backward_args)}), but {d.namespace}::{bwd.name} takes "
                               f"{len(bwd_args)} ({', '.join(bwd_args)})")
        bwd_returns = len(bwd_schema.returns)
        if bwd_returns != len(d.backward_grads):
            raise RuntimeError(f"[{op}] .backward_grads names {len(d.backward_grads)} gradients "
                               f"({', '.join(d.backward_grads)}), but {d.namespace}::{bwd.name} returns {bwd_returns}")


def _enums(op: str, schema, text: str | None) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """A descriptor's .enums ("activation: none|silu; mode: a|b"), checked against the schema."""
    args = {a.name: a for a in schema.arguments}
    out: dict[str, tuple[str, ...]] = {}
    for item in filter(None, (t.strip() for t in (text or "").split(";"))):
        arg, colon, values = (p.strip() for p in item.partition(":"))
        values = tuple(v.strip() for v in values.split("|"))
        if not colon:
            why = "expected 'ARG: VALUE|VALUE|...'"
        elif arg not in args:
            why = f"the schema has no argument '{arg}' (it has {', '.join(args)})"
        elif str(args[arg].type) not in ("str", "Optional[str]"):
            why = f"argument '{arg}' is {args[arg].type}, not str"
        elif arg in out:
            why = f"argument '{arg}' is listed twice"
        elif not all(v.isidentifier() for v in values):
            why = "each value must be a non-empty identifier (letters, digits, '_')"
        elif len(set(values)) != len(values):
            why = "a value is listed twice"
        elif args[arg].has_default_value() and args[arg].default_value not in (None, *values):
            why = f"the schema's default '{args[arg].default_value}' of '{arg}' is not one of the values"
        else:
            out[arg] = values
            continue
        raise RuntimeError(f"[{op}] bad .enums entry '{item}': {why}")
    return tuple(out.items())


# ---- wiring ------------------------------------------------------------------

_libraries: dict[str, torch.library.Library] = {}


def _fragment(namespace: str) -> torch.library.Library:
    if namespace not in _libraries:
        _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _libraries[namespace]


def is_tensor_arg(arg) -> bool:
    """A schema argument that takes a tensor: Tensor, Tensor? or Tensor[]."""
    return "Tensor" in str(arg.type)


def op_overload(desc: OpDescriptor, name: str | None = None) -> torch._ops.OpOverload:
    return getattr(getattr(torch.ops, desc.namespace), name or desc.name).default


def _check_one_device(desc: OpDescriptor, argnames: list[str], args: tuple) -> None:
    """Every tensor argument on one device: a meta tensor beside cpu ones reaches the fake kernel (Meta
    outranks CPU in dispatch), which would otherwise shape a cpu output of uninitialised memory."""
    first = None
    for name, a in zip(argnames, args):
        if isinstance(a, torch.Tensor):
            if first is None:
                first = (name, a.device)
            elif a.device != first[1]:
                raise RuntimeError(
                    f"[{desc.namespace}::{desc.name}] argument '{name}' must be on the device of "
                    f"'{first[0]}' ({first[1]}), got {a.device}"
                )


def _concrete(t: torch.Tensor) -> bool:
    return all(isinstance(v, int) for v in (*t.shape, *t.stride(), t.storage_offset()))


_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _fake_from_kernel(op, args: tuple):
    """The C kernel on meta stand-ins of the arguments (it checks them as it checks real ones and
    allocates its outputs, computing nothing), then fake outputs of the shapes, strides and dtypes it made."""
    unset_fake_temporarily = _private.fake_mode_exit()
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    like = next(a for a in args if isinstance(a, torch.Tensor))
    with unset_fake_temporarily():
        metas = [
            torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a
            for a in args
        ]
        outs = op.redispatch(_CPU_KEYS, *metas)
    if outs is None:  # an op that returns nothing (it writes over its arguments)
        return None
    single = not isinstance(outs, (tuple, list))
    outs = (outs,) if single else tuple(outs)
    fakes = tuple(like.new_empty_strided(o.shape, o.stride(), dtype=o.dtype, device=device) for o in outs)
    return fakes[0] if single else fakes


def _wire_fake(desc: OpDescriptor, argnames: list[str]) -> None:
    rules = desc.shape
    op = op_overload(desc)
    enums = [(argnames.index(arg), arg) for arg, _ in desc.enums]

    def fake(*args):
        for i, arg in enums:  # as the kernel reads them, first; an argument left out takes its (checked) default
            if i < len(args):
                desc.check_enum(arg, args[i])
        _check_one_device(desc, argnames, args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if desc.meta and tensors and all(_concrete(t) for t in tensors) and _private.fake_mode_exit():
            return _fake_from_kernel(op, args)
        # symbolic sizes (torch.compile(dynamic=True)): the descriptor's shape rules
        outs = tuple(r.evaluate(args) for r in rules)
        return outs[0] if len(outs) == 1 else outs if outs else None

    torch.library.register_fake(f"{desc.namespace}::{desc.name}", fake, lib=_fragment(desc.namespace))


def _wire_autograd(desc: OpDescriptor, schema) -> None:
    qualname = f"{desc.namespace}::{desc.name}"
    argnames = [a.name for a in schema.arguments]
    is_tensor = [is_tensor_arg(a) for a in schema.arguments]
    bwd = op_overload(desc, desc.backward)
    # how each backward argument is found: ("grad", i), ("saved", j) or ("const", j)
    plan, saved_from, const_from = [], [], []
    donatable = []  # saved slots of "outN!" and "ARG!" arguments: the backward's to overwrite when no one else's
    # "ARG!" input or "outN!ARG" output -> its saved slot: the in-place backward writes ARG's gradient over it
    written_over = {}
    onto_out = {}  # "outN!ARG": ARG -> N, an output that must have ARG's shape and dtype to take its gradient
    for a in desc.backward_args:
        name, bang, onto = a.partition("!")
        if a == "needs":  # which of backward_grads are wanted, a bit each (ctx.needs_input_grad)
            plan.append(("needs", 0))
        elif a.startswith("grad") and a[4:].isdigit():
            plan.append(("grad", int(a[4:])))
        elif a.startswith("out") and name[3:].isdigit():
            if bang:
                donatable.append(len(saved_from))
            if onto:
                written_over[onto] = len(saved_from)
                onto_out[onto] = int(name[3:])
            plan.append(("saved", len(saved_from)))
            saved_from.append(("out", int(name[3:])))
        elif is_tensor[argnames.index(name)]:
            if bang:
                donatable.append(len(saved_from))
                written_over[name] = len(saved_from)
            plan.append(("saved", len(saved_from)))
            saved_from.append(("in", argnames.index(name)))
        else:
            plan.append(("const", len(const_from)))
            const_from.append(argnames.index(a))
    bwd_inplace = op_overload(desc, desc.backward + "_") if donatable else None

    def inplace_takes(t) -> bool:
        """Whether the in-place backward has a kernel for t's device: its CPU one, or a CUDA one, asked
        at the call (the CUDA library registers its kernels after the ops are wired)."""
        return isinstance(t, torch.Tensor) and (t.is_cpu or t.is_cuda and _private.has_kernel(bwd_inplace, "CUDA"))

    grad_slots = [argnames.index(a) for a in desc.backward_grads]
    # gradient b -> the saved slot the in-place backward wrote it over (it returns the others, in order)
    over = {b: written_over[a] for b, a in enumerate(desc.backward_grads) if a in written_over}
    # gradient b -> (its input, the output written over): the output takes it when it has the input's shape,
    # dtype and device (a forward may leave it empty, or of another dtype: the out-of-place backward then runs)
    onto = [(b, grad_slots[b], onto_out[a]) for b, a in enumerate(desc.backward_grads) if a in onto_out]
    # outputs the backward never gets a gradient for are saved values (e.g. a
    # pre-activation): not differentiable, and no zeros are made for them
    used_grads = {i for k, i in plan if k == "grad"}
    saved_only = sorted({i for kind, i in saved_from if kind == "out"} - used_grads)

    def setup_context(ctx, inputs, output):
        outs = output if isinstance(output, tuple) else (output,)
        if saved_only:
            ctx.mark_non_differentiable(*[outs[i] for i in saved_only])
            ctx.set_materialize_grads(False)
            ctx.out_meta = [dict(size=o.shape, dtype=o.dtype, device=o.device) for o in outs]
        ctx.save_for_backward(*[outs[i] if kind == "out" else inputs[i] for kind, i in saved_from])
        ctx.consts = [inputs[i] for i in const_from]
        # which gradients are wanted, bit b for grad_slots[b] (what ctx.needs_input_grad says, read from the
        # inputs: that tuple's positions differ between torch's generated Function and the lean one); an
        # absent optional tensor is never wanted, so it gets no gradient
        ctx.needs = sum(1 << b for b, i in enumerate(grad_slots)
                        if isinstance(inputs[i], torch.Tensor) and inputs[i].requires_grad)
        ctx.onto_fits = not onto or all(
            not ctx.needs >> b & 1 or (outs[o].shape == inputs[i].shape and outs[o].dtype == inputs[i].dtype and
                                       outs[o].device == inputs[i].device) for b, i, o in onto)

    def backward(ctx, *grads):
        if saved_only:  # grads are not materialised: zeros only where the backward needs one
            grads = tuple(
                g if g is not None or i not in used_grads else torch.zeros(**ctx.out_meta[i]) for i, g in enumerate(grads)
            )
        saved = list(ctx.saved_tensors)
        op = bwd
        if donatable and ctx.onto_fits and all(inplace_takes(saved[slot]) for slot in donatable) and \
                all(saved[slot].is_contiguous() for slot in over.values()) and \
                all(_private.may_donate(ctx, saved, slot) for slot in donatable):
            op = bwd_inplace  # the saved values are ours alone: the backward may overwrite them
        args = [
            grads[i] if k == "grad" else saved[i] if k == "saved" else ctx.needs if k == "needs" else ctx.consts[i]
            for k, i in plan
        ]
        overwritten = {b: saved[slot] for b, slot in over.items()} if op is bwd_inplace else None
        del saved
        recording = _grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        res = _call_below_autograd(op, args)
        res = tuple(res) if isinstance(res, (tuple, list)) else () if res is None else (res,)
        if overwritten:  # gradients written over saved inputs: those tensors, without their autograd history
            rest = iter(res)
            res = tuple(overwritten[b].detach() if b in overwritten else next(rest) for b in range(len(grad_slots)))
        if recording:  # create_graph=True: the results join the graph, and differentiating them raises
            res = _FirstOrderOnly.apply(qualname, res, *[a for a in args if isinstance(a, torch.Tensor)])
        out = [None] * len(argnames)
        for b, (slot, g) in enumerate(zip(grad_slots, res)):
            out[slot] = g if ctx.needs >> b & 1 else None
        return tuple(out)

    # what torch.library.register_autograd registers, behind the checks for
    # the differentiation modes the generated autograd.Function cannot serve
    generated = _private.autograd_kernel(qualname, op_overload(desc), backward, setup_context)
    if generated is None:  # torch's own registration, without the refusals below (torch raises its own errors)
        torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=_fragment(desc.namespace))
        return

    def autograd_kernel(keyset, *args, **kwargs):
        _refuse_unsupported_ad(qualname, args, differentiable=True)
        return generated(keyset, *args, **kwargs)

    _fragment(desc.namespace).impl(desc.name, autograd_kernel, "Autograd", with_keyset=True)
    direct = getattr(generated, "direct", None)
    if direct is not None:
        _DIRECT[qualname] = direct


def _wire_not_differentiable(desc: OpDescriptor) -> None:
    """An op that declares no backward: asking it for a gradient raises
    instead of dropping it."""
    op, qualname = op_overload(desc), f"{desc.namespace}::{desc.name}"

    def autograd_kernel(keyset, *args, **kwargs):
        _refuse_unsupported_ad(qualname, args, differentiable=False)
        return _private.redispatch_below_autograd(op, keyset, args, kwargs)

    _fragment(desc.namespace).impl(desc.name, autograd_kernel, "Autograd", with_keyset=True)


def _call_below_autograd(op: torch._ops.OpOverload, args: list):
    """Runs op without recording it: a backward op inside a backward pass."""
    if _compiling():
        with torch.no_grad():
            return op(*args)
    return _private.call_below_autograd(op, args)


class _FirstOrderOnly(torch.autograd.Function):
    """Puts a backward op's results into a graph being recorded (a backward
    with create_graph=True), wired to the tensors they were computed from, so
    that differentiating them again raises naming the op instead of giving
    zeros or "not used in the graph". The backward ops have no derivative of
    their own."""

    @staticmethod
    def forward(ctx, qualname, results, *inputs):
        ctx.qualname = qualname
        return tuple(r.view_as(r) for r in results)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"[{ctx.qualname}] double backward is not supported: the op's backward has no derivative of its own, "
            "so a gradient taken with create_graph=True cannot be differentiated again (a second grad, "
            "gradgradcheck, a Hessian)"
        )


def _has_tangent(args) -> bool:
    return any(isinstance(a, torch.Tensor) and _unpack_dual(a).tangent is not None for a in args)


_FUNC_TRANSFORMS = {"grad": "torch.func.grad, vjp, jacrev or hessian"}


def _refuse_unsupported_ad(qualname: str, args: tuple, differentiable: bool) -> None:
    """Raises, naming the op, for a derivative it cannot give: forward-mode AD
    (a tangent would be dropped: zeros or None), the torch.func transforms
    (torch's generated autograd.Function does not run under them), and any
    gradient at all of an op without a backward."""
    if _private.forward_ad_active() and _has_tangent(args):
        raise RuntimeError(
            f"[{qualname}] forward-mode AD is not supported (torch.func.jvp, jacfwd, forward_ad dual tensors): "
            + ("the op has a backward only; use reverse mode (torch.autograd.grad, .backward())" if differentiable
               else "the op has no derivative; pass tensors without a tangent")
        )
    if not (_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
        return
    if not differentiable:
        raise RuntimeError(
            f"[{qualname}] has no derivative, but an input requires grad: call it under torch.no_grad() or on "
            "detached inputs"
        )
    transform = _private.functorch_transform()
    if transform is not None:
        where = _FUNC_TRANSFORMS.get(transform, f"torch.func transform '{transform}' with an input that requires grad")
        raise RuntimeError(
            f"[{qualname}] torch.func transforms are not supported with gradients (here {where}): the op's "
            "backward is wired for torch.autograd only; use torch.autograd.grad"
        )


def _cast(value, device_type: str, dtype: torch.dtype):
    if isinstance(value, torch.Tensor):
        eligible = value.is_floating_point() and value.device.type == device_type and value.dtype != torch.float64
        return value.to(dtype) if eligible else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, device_type, dtype) for v in value)
    return value


def _widest(args, device_type: str) -> torch.dtype | None:
    """The promoted dtype of the floating tensors _cast would cast (None: there are none)."""
    dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()
              and a.device.type == device_type and a.dtype != torch.float64]
    return functools.reduce(torch.promote_types, dtypes) if dtypes else None


def _follow(args, optional: list[bool], device_type: str) -> list:
    """AUTOCAST_FOLLOW: float32 parameters (the Tensor? arguments) in the dtype of the first tensor
    argument when that one is 16-bit; everything else as given."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None or first.dtype not in (torch.bfloat16, torch.float16) or first.device.type != device_type:
        return list(args)
    return [a.to(first.dtype) if opt and isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a
            for a, opt in zip(args, optional)]


def _wire_autocast(desc: OpDescriptor) -> None:
    op = op_overload(desc)
    optional = [str(a.type) == "Optional[Tensor]" for a in op._schema.arguments]
    for device in ("cpu", "cuda"):
        policy = desc.autocast_on(device)
        if policy == AUTOCAST_NONE:
            continue
        key_name = _private.autocast_key_name(device)

        def run(*args, device=device, key_name=key_name, policy=policy):
            if policy == AUTOCAST_FOLLOW:
                with _private.autocast_excluded(device, key_name):
                    return op(*_follow(args, optional, device))
            if policy == AUTOCAST_PROMOTE:
                dtype = _widest(args, device)
            else:
                dtype = torch.get_autocast_dtype(device) if policy == AUTOCAST_LOWER else torch.float32
            with _private.autocast_excluded(device, key_name):
                return op(*_cast(args, device, dtype)) if dtype is not None else op(*args)

        _private.set_python_dispatcher_kernel(op, key_name, run)
        _fragment(desc.namespace).impl(desc.name, lambda _ks, *args, run=run: run(*args), key_name, with_keyset=True)


_FLOP_FACTOR = re.compile(r"^(?:(\d+)|numel\((\w+)\)|size\((\w+),(-?\d+)\))$")


def _flop_factors(desc: OpDescriptor) -> list[tuple]:
    """The terms of the descriptor's .flops (none without one), each (integer, numel's argument, size's
    argument, size's dim) with the others None."""
    factors = []
    for term in desc.flops.replace(" ", "").split("*") if desc.flops else ():
        m = _FLOP_FACTOR.match(term)
        if not m:
            raise RuntimeError(f"[{desc.namespace}::{desc.name}] .flops: bad term '{term}' in '{desc.flops}' (a "
                               "product of integers, numel(ARG) and size(ARG,d))")
        factors.append(m.groups())
    return factors


def _wire_flops(desc: OpDescriptor, argnames: list[str]) -> None:
    """Registers the descriptor's FLOP estimate with torch.utils.flop_counter."""
    factors = _flop_factors(desc)  # checked against the schema at load (_check_fields)

    def formula(*args, out_val=None, **kwargs):
        total = 1
        for const, numel_arg, size_arg, dim in factors:
            if const:
                total *= int(const)
            elif numel_arg:
                total *= args[argnames.index(numel_arg)].numel()
            else:
                total *= args[argnames.index(size_arg)].shape[int(dim)]
        return total

    from torch.utils.flop_counter import register_flop_formula

    register_flop_formula(getattr(getattr(torch.ops, desc.namespace), desc.name), get_raw=True)(formula)


def wire(desc: OpDescriptor, is_backward: bool = False) -> None:
    schema = op_overload(desc)._schema
    argnames = [a.name for a in schema.arguments]
    _wire_fake(desc, argnames)
    if desc.flops:
        _wire_flops(desc, argnames)
    if desc.backward:
        _wire_autograd(desc, schema)
    elif not is_backward:
        # A backward op keeps torch's C++ fallback: compiled backward graphs
        # call it with the autograd keys live, where a Python kernel would
        # cost microseconds per call; the generic backward never records it.
        _wire_not_differentiable(desc)
    if desc.autocast != AUTOCAST_NONE or desc.autocast_cuda != AUTOCAST_NONE:
        _wire_autocast(desc)


# "ns::op" -> its autograd.Function's entry without the dispatcher's autograd key (op_function's eager path)
_DIRECT: dict = {}


def _stub(namespace: str, name: str):
    def op(*args):
        pass

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"torch.ops.{namespace}.{name}, skipping the autograd kernel when no input requires grad."
    return op


# ---- calling ops from Python -------------------------------------------------------

_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_tracing = _private.jit_tracing()
_unpack_dual = _forward_ad.unpack_dual


def require_tensors(qualname: str, **named) -> None:
    """For a Python function that reads its tensors before its op checks them: the op's error for an
    argument that is not a tensor ("[ns::op] argument 'x' must be a tensor, got None")."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise RuntimeError(f"[{qualname}] argument '{name}' must be a tensor, got "
                               f"{'None' if t is None else type(t).__name__}")


_MISSING = object()


def _binder(op: torch._ops.OpOverload):
    """bind(args, kwargs) -> the op's arguments in schema order, positional: keywords by name, and the
    schema's defaults for those left out, as torch.ops.<ns>.<op> takes them; a clear RuntimeError
    naming the op and the argument otherwise. Its attributes: count (the schema's arguments) and
    signature (an inspect.Signature of them, for help() and inspect)."""
    import inspect

    arguments = list(op._schema.arguments)
    names = [a.name for a in arguments]
    index = {name: i for i, name in enumerate(names)}
    defaults = [a.default_value if a.has_default_value() else _MISSING for a in arguments]
    qualname = op.name()

    def described() -> str:
        return ", ".join(n if d is _MISSING else f"{n}={d!r}" for n, d in zip(names, defaults))

    def bind(args: tuple, kwargs: dict) -> tuple:
        if len(args) > len(names):
            raise RuntimeError(f"[{qualname}] takes {len(names)} arguments ({described()}), got {len(args)}")
        full = list(args) + [_MISSING] * (len(names) - len(args))
        for key, value in kwargs.items():
            i = index.get(key)
            if i is None:
                raise RuntimeError(f"[{qualname}] got an unexpected keyword argument '{key}'; its arguments are "
                                   f"({described()})")
            if full[i] is not _MISSING:
                raise RuntimeError(f"[{qualname}] got two values for argument '{key}'")
            full[i] = value
        for i, value in enumerate(full):
            if value is _MISSING:
                if defaults[i] is _MISSING:
                    raise RuntimeError(f"[{qualname}] missing argument '{names[i]}' (its arguments are "
                                       f"({described()}))")
                full[i] = defaults[i]
        return tuple(full)

    required = [i for i, a in enumerate(arguments) if a.type.kind() == "TensorType"]
    # raises the clear error for a required Tensor argument given None
    bind.check_tensors = lambda args: require_tensors(qualname, **{names[i]: args[i] for i in required})
    kinds = [inspect.Parameter.KEYWORD_ONLY if a.kwarg_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
             for a in arguments]
    bind.count = len(names)
    bind.signature = inspect.Signature(
        [inspect.Parameter(n, k, default=inspect.Parameter.empty if d is _MISSING else d)
         for n, k, d in zip(names, kinds, defaults)])
    return bind


def op_function(op: torch._ops.OpOverload):
    """Decorator: turns a documented stub into the Python entry point of ``op``.

    The returned function has the stub's name, docstring and signature, ``op``
    as its attribute ``op``, and calls ``op`` directly, skipping its autograd kernel when no gradient can
    flow.

    The autograd formula is registered from Python (the stable C ABI cannot
    register one in C), and entering a Python kernel costs ~8 us per call, most
    of a small op's time. When grad mode is off or no tensor argument requires
    grad, that kernel would only redispatch below autograd; this excludes the
    autograd keys for the call instead (a thread-local flag, restored after).
    When a gradient can flow, plain eager calls (no autocast, no mode, no
    tensor subclass: _torch_private.plain_eager_check) enter the op's
    autograd.Function directly, which is what the autograd kernel would run
    after the hop into Python: a forward with grad costs ~25 us instead of ~36.
    While torch.compile traces, the op is called as is; under forward-mode
    AD the autograd kernel runs, to refuse tangents it cannot propagate.
    Where torch lacks the thread-local functions, the op is always called as is.
    """
    call = _private.op_entry(op)
    tls = _private.autograd_tls()
    may_skip, set_excluded, _ = tls or (None, None, None)
    tensors = [i for i, a in enumerate(op._schema.arguments) if is_tensor_arg(a)]
    qualname, plain = op.name(), _private.plain_eager_check(may_skip)
    bind = _binder(op)

    def fast(*args, **kwargs):
        if kwargs or len(args) != bind.count:
            args = bind(args, kwargs)
        try:
            if _compiling() or _tracing():
                # dynamo traces OpOverloads, not the raw builtin; torch.jit.trace records the op where it is
                # called, so every traced call comes through here (its check compares the recorded source lines)
                return op(*args)
            if _grad_enabled():
                for i in tensors:
                    t = args[i]
                    if t is not None and getattr(t, "requires_grad", False):
                        direct = _DIRECT.get(qualname)
                        if direct is not None and plain is not None and plain(args, tensors):
                            return direct(*args)  # what the autograd key would run, without the hop into it
                        return call(*args)
            if tls is None or not may_skip():
                return call(*args)
            set_excluded(True)
            try:
                return call(*args)
            finally:
                set_excluded(False)
        except NotImplementedError:  # the dispatcher's, when no argument is a tensor: name the first None
            bind.check_tensors(args)
            raise

    def wrap(stub):
        functools.update_wrapper(fast, stub)
        fast.__signature__ = bind.signature  # the schema's names and defaults, which the call takes
        fast.op = op  # what opforge.testing.check and opforge.benchmark.bench take it for
        return fast

    return wrap
