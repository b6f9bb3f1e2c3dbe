"""Every private torch internal opforge uses, each behind a fallback.

The stable C ABI is promised across releases; nothing under ``torch._`` is.
The C library keeps working on a newer torch, so the Python wiring must too:
each internal is looked up here, once, and when it is missing, renamed or
raises, a public path that gives the same values and gradients takes over
(only slower, or with torch's own error message instead of ours). No other
module of opforge touches a private torch name.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.autograd.forward_ad as _forward_ad

# torch as opforge reads it: the tests hide names here to take the fallbacks,
# leaving torch's own uses of them intact
_torch, _C, _forward_ad = torch, torch._C, _forward_ad


def _attr(obj, path: str):
    """obj.a.b.c, or None when any step is missing."""
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


# ---- calling an op without its autograd kernel ---------------------------------

_AUTOGRAD = _attr(_C, "DispatchKey.AutogradFunctionality")


def autograd_tls():
    """(may_skip, set_excluded, is_excluded) for the autograd keys' thread-local exclusion, or
    None when the functions are missing or do not round-trip: callers then call
    ops normally (through the autograd kernel, which redispatches). may_skip():
    the keys are not already excluded and no forward-AD level is open, in one
    call, as it runs on every op call."""
    is_excluded = _attr(_C, "_dispatch_tls_is_dispatch_key_excluded")
    set_excluded = _attr(_C, "_dispatch_tls_set_dispatch_key_excluded")
    if is_excluded is None or set_excluded is None or _AUTOGRAD is None:
        return None
    try:
        before = is_excluded(_AUTOGRAD)
        set_excluded(_AUTOGRAD, not before)
        flipped = is_excluded(_AUTOGRAD)
        set_excluded(_AUTOGRAD, before)
        if flipped is before or is_excluded(_AUTOGRAD) is not before:
            return None
    except Exception:
        return None
    fwd = _forward_ad
    if not isinstance(getattr(fwd, "_current_level", None), int):
        return None

    def may_skip(key=_AUTOGRAD):
        return not is_excluded(key) and fwd._current_level < 0

    return may_skip, functools.partial(set_excluded, _AUTOGRAD), functools.partial(is_excluded, _AUTOGRAD)


def op_entry(op):
    """The C++ entry point of an OpOverload (without OpOverload.__call__'s Python
    frame), or the overload itself."""
    entry = getattr(op, "_op", None)
    return entry if callable(entry) else op


def call_below_autograd(op, args: list):
    """op(*args) without recording it: a backward op inside a backward pass."""
    tls = _tls
    if tls is not None:
        _, set_excluded, is_excluded = tls
        if is_excluded():
            return op_entry(op)(*args)
        set_excluded(True)
        try:
            return op_entry(op)(*args)
        finally:
            set_excluded(False)
    with torch.no_grad():  # the autograd kernel sees no grad mode and only redispatches
        return op(*args)


def redispatch_below_autograd(op, keyset, args: tuple, kwargs: dict):
    """From an autograd kernel: the kernels below autograd, with nested calls kept below it too."""
    below = _attr(_C, "_AutoDispatchBelowAutograd")
    after = _attr(_C, "_after_autograd_keyset")
    if below is not None and after is not None:
        with below():
            return op.redispatch(keyset & after, *args, **kwargs)
    # a C kernel calls no further ops: dropping the autograd keys suffices
    return op.redispatch(keyset.remove(_AUTOGRAD), *args, **kwargs)


def forward_ad_active() -> bool:
    """Whether a forward-AD level is open; True when that cannot be told (the callers' safe side)."""
    level = getattr(_forward_ad, "_current_level", None)
    return not isinstance(level, int) or level >= 0


def functorch_transform() -> str | None:
    """The innermost torch.func transform running ('grad', 'vmap', ...), or None.
    None as well when torch no longer exposes the interpreter stack: the op then
    runs under the transform without opforge's refusal."""
    peek = _attr(_C, "_functorch.peek_interpreter_stack")
    try:
        interpreter = peek() if peek is not None else None
        return None if interpreter is None else str(interpreter.key()).rpartition(".")[2].lower()
    except Exception:
        return None


# ---- autograd registration -------------------------------------------------------------


def lean_autograd_kernel(op, backward, setup_context):
    """What torch's register_autograd kernel does, less its per-call walks of the
    schema (filling defaults, checking for out= arguments: a third of that
    kernel's time on a small input, 26 against 17 us per forward): an autograd.Function
    whose forward runs op below autograd then calls setup_context(ctx, inputs,
    output) with the inputs the dispatcher left out restored to their defaults,
    and whose backward returns backward(ctx, *grads). None for a schema with
    keyword-only, mutable or tensor-list arguments, or when torch lacks a piece."""
    below, after = _attr(_C, "_AutoDispatchBelowAutograd"), _attr(_C, "_after_autograd_keyset")
    any_requires_grad, grad_enabled = _attr(_C, "_any_requires_grad"), _attr(_C, "is_grad_enabled")
    schema = getattr(op, "_schema", None)
    if any(x is None for x in (below, after, any_requires_grad, grad_enabled, schema)):
        return None
    arguments = list(schema.arguments)
    mutable = any(a.alias_info is not None and a.alias_info.is_write for a in arguments)
    if mutable or any(a.kwarg_only or "[]" in str(a.type) for a in arguments) or any(
            "[]" in str(r.type) for r in schema.returns):
        return None
    defaults = tuple(a.default_value if a.has_default_value() else None for a in arguments)

    entry = op_entry(op)

    def forward(ctx, keyset, *args):  # redispatch_below_autograd, with its pieces looked up once
        with below():  # keyset None: called by direct(), not from the dispatcher's autograd key
            result = entry(*args) if keyset is None else op.redispatch(keyset & after, *args)
        setup_context(ctx, args + defaults[len(args):], result)
        return result

    def backward_with_keyset(ctx, *grads):
        return (None, *backward(ctx, *grads))

    name = f"{op._namespace}_{op._opname}_{op._overloadname}"
    function = type(f"GeneratedBackwardFor_{name}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward_with_keyset)})

    def kernel(keyset, *args, **kwargs):
        if grad_enabled() and any_requires_grad(*args):
            return function.apply(keyset, *args)
        return redispatch_below_autograd(op, keyset, args, kwargs)

    def direct(*args):
        return function.apply(None, *args)

    kernel.direct = direct
    return kernel


def jit_tracing():
    """A function telling whether torch.jit.trace is recording (False where torch no longer says)."""
    state = _attr(_C, "_get_tracing_state")
    if state is None:
        return lambda: False

    def tracing() -> bool:
        try:
            return state() is not None
        except Exception:
            return False

    return tracing


def plain_eager_check(may_skip):
    """A function ok(args, tensor_positions): whether an eager call of an op may
    enter its autograd.Function directly (the `direct` of lean_autograd_kernel)
    instead of through the dispatcher's autograd key, which would call the same
    Function after a C++-to-Python hop and opforge's refusal checks (~20 us a
    call). The caller has ruled out torch.compile and torch.jit.trace. True only
    where nothing above or at the autograd key could act: may_skip() (autograd_tls's:
    the autograd keys not excluded -- below another op's autograd kernel nothing is
    recorded -- and no forward-AD level), no autocast, no torch-function or
    dispatch mode, no torch.func transform, and every tensor argument a plain
    Tensor or Parameter (a subclass such as DTensor or FakeTensor keeps the
    dispatcher's path). None when torch lacks a piece (and False when one
    raises): the dispatcher's path then."""
    any_autocast = _attr(_C, "_is_any_autocast_enabled")
    function_modes = _attr(_C, "_len_torch_function_stack")
    dispatch_modes = _attr(_C, "_len_torch_dispatch_stack")
    peek = _attr(_C, "_functorch.peek_interpreter_stack")
    if any(f is None for f in (may_skip, any_autocast, function_modes, dispatch_modes, peek)):
        return None
    tensor, parameter = torch.Tensor, torch.nn.Parameter

    def ok(args, positions) -> bool:
        try:
            if not may_skip() or any_autocast() or function_modes() or dispatch_modes() or peek() is not None:
                return False
        except Exception:  # a piece changed under a newer torch: the dispatcher's path
            return False
        for i in positions:
            t = args[i]
            if t is not None and type(t) is not tensor and type(t) is not parameter:
                return False
        return True

    return ok


class _Capture:
    """Stands in for a torch.library.Library to take the kernel register_autograd makes."""

    def __init__(self):
        self.kernel = None

    def impl(self, name, kernel, key, with_keyset=False):
        if key == "Autograd" and with_keyset:
            self.kernel = kernel


def autograd_kernel(qualname: str, op, backward, setup_context):
    """The Autograd kernel torch.library.register_autograd would register, without
    registering it (opforge wraps it in its own checks), or None when it cannot be
    had: the caller then registers through register_autograd itself. Where torch's
    pieces allow, opforge's own lean form of it (lean_autograd_kernel)."""
    lean = lean_autograd_kernel(op, backward, setup_context)
    if lean is not None:
        return lean
    try:
        autograd = _attr(_torch, "_library.autograd")
        return autograd.make_autograd_impl(op, autograd.Info(backward, setup_context))
    except Exception:
        pass
    capture = _Capture()
    try:
        torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=capture)
    except Exception:
        return None
    return capture.kernel


# ---- donating a saved output to the backward -----------------------------------------------


def has_kernel(op: torch._ops.OpOverload, key: str) -> bool:
    """Whether op has a kernel registered for the dispatch key (False where torch no longer says)."""
    query = _attr(_C, "_dispatch_has_kernel_for_dispatch_key")
    try:
        return bool(query(op.name(), key))
    except Exception:
        return False


def may_donate(ctx, saved: list, slot: int) -> bool:
    """Whether the backward may overwrite saved[slot] (a forward output saved
    only for it, or an input whose gradient it writes over it): eager mode, a graph that is not retained (the saved values
    are used once), and after the node lets go of its saved values, nothing
    but `saved` refers to the tensor or its storage (not the caller, not a
    view, not a saved-tensor hook's cache). False when any count cannot be
    read: the backward then takes its out-of-place form."""
    keep_graph = _attr(_C, "_autograd._get_current_graph_task_keep_graph")
    storage_use_count = _attr(_C, "_storage_Use_Count")
    if torch.compiler.is_compiling() or keep_graph is None or storage_use_count is None:
        return False
    if not hasattr(ctx, "maybe_clear_saved_tensors"):
        return False
    try:
        if keep_graph():
            return False
        ctx.maybe_clear_saved_tensors()
        t = saved[slot]
        if not isinstance(t, torch.Tensor) or t._use_count() != 1:
            return False
        storage = t.untyped_storage()
        # references: saved's slot, t, getrefcount's argument; storage: t's and `storage`
        return sys.getrefcount(t) == 3 and storage_use_count(storage._cdata) == 2
    except Exception:
        return False


# ---- autocast ----------------------------------------------------------------------------------

_BACKEND_KEY = {"cpu": "CPU", "cuda": "CUDA"}


def autocast_key_name(device: str) -> str:
    """The dispatch key autocast uses for a device type: 'AutocastCPU', ..."""
    for_device = _attr(_C, "_dispatch_key_for_device")
    try:
        return "Autocast" + for_device(device)
    except Exception:
        return "Autocast" + _BACKEND_KEY[device]


def autocast_excluded(device: str, key_name: str):
    """A context in which the op's own autocast kernel is not entered again."""
    guard, keyset = _attr(_C, "_ExcludeDispatchKeyGuard"), _attr(_C, "DispatchKeySet")
    key = _attr(_C, f"DispatchKey.{key_name}")
    if guard is not None and keyset is not None and key is not None:
        try:
            return guard(keyset(key))
        except Exception:
            pass
    return torch.autocast(device_type=device, enabled=False)


def set_python_dispatcher_kernel(op, key_name: str, kernel) -> None:
    """The kernel the Python dispatcher (used while torch.compile traces) runs for
    the key. Without py_impl the Python dispatcher falls through to the
    dispatcher's own registration of the same kernel."""
    key = _attr(_C, f"DispatchKey.{key_name}")
    py_kernels, py_impl = getattr(op, "py_kernels", None), getattr(op, "py_impl", None)
    if key is None or py_impl is None:
        return
    try:
        if isinstance(py_kernels, dict) and op.has_kernel_for_dispatch_key(key):
            py_kernels.pop(key, None)
        py_impl(key)(kernel)
    except Exception:
        pass


# ---- fake tensors -----------------------------------------------------------------------------------


def fake_mode_exit():
    """torch's context leaving fake mode for real (meta) tensors
    (unset_fake_temporarily), or None when missing: fake kernels then keep to
    the descriptors' shape rules."""
    try:
        import torch._subclasses.fake_tensor  # noqa: F401
    except Exception:
        return None
    unset = _attr(_torch, "_subclasses.fake_tensor.unset_fake_temporarily")
    return unset if callable(unset) else None


_tls = autograd_tls()
