"""``linear`` (a GEMM with its bias and activation fused) and ``matmul``, on opforge's GEMM."""

from __future__ import annotations

import ctypes
import math
import time

import torch
import torch.nn.functional as F

from .._lib import _compiling, _tracing, op_function
from .._runtime import SMALL_TRIALS, TORCH_LINEARS, library, ops

__all__ = ["ACTIVATIONS", "linear", "matmul"]

# the names the linear ops' `str activation` takes, read from the library (csrc/kernels/act.h's ACT_NAMES)
ACTIVATIONS = library.descriptor("linear").enum_values("activation")


@op_function(ops.linear.default)
def _linear(x, weight, bias, activation, save_preact=True):
    """(out, preact): see linear."""


_linear_on_torch = library.dll.opforge_linear_on_torch
_linear_on_torch.argtypes = [ctypes.c_int64] * 7 + [ctypes.c_int] * 3 + [ctypes.c_int64] * 2
_linear_on_torch.restype = ctypes.c_int
_matmul_on_torch = library.dll.opforge_matmul_on_torch
_matmul_on_torch.argtypes = [ctypes.c_int64] * 7 + [ctypes.c_int] * 2 + [ctypes.c_int64] * 2
_matmul_on_torch.restype = ctypes.c_int
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter  # no subclass with a behavior of its own
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_autocast, _autocast_dtype, _threads = torch.is_autocast_enabled, torch.get_autocast_dtype, torch.get_num_threads


def _operand_dtype(dtypes) -> torch.dtype | None:
    """The dtype both the op and torch's function run these operands in (autocast's, as both cast), or
    None where they differ (the op's error, not torch's) or opforge's GEMM provider has no torch side."""
    if _autocast("cpu") and all(d in _FLOATS for d in dtypes):
        dt = _autocast_dtype("cpu")
    elif any(d != dtypes[0] for d in dtypes):
        return None
    else:
        dt = dtypes[0]
    return dt if dt in (torch.float32, torch.bfloat16) else None


_KEYS_MAX = 4096  # shapes that change call to call (a growing sequence) start the table again past this


_ABSENT = object()  # _routed's b when the op has one tensor (None is a caller's None: never routed)


# a key routed to torch's function whose classes auto mode re-checks (query's answer 3) is asked again after
# this many calls routed, twice as many, ... up to _RECHECK_LAST (the GEMM provider's RECHECK_FIRST / LAST)
_RECHECK_FIRST, _RECHECK_LAST = 32, 2048
# answers -1 in a row a re-check may have (the provider waits for its samples, two calls of each kernel, which
# the op's calls take) before the key is routed again: a key whose samples never come (a dweight's, with no
# backward) asks no more (the provider gives such a re-check up too, for the class's other keys)
_RECHECK_ASKS = 16


def _routed(kind: str, grads: int, query, a, b=_ABSENT, c=None, extra: tuple = ()) -> bool:
    """Whether the product `kind` of a (and b, c) runs on torch's function: the kept answer of its key
    (TORCH_LINEARS: a known class costs one lookup, ~2 us), else query(key, routed)'s (1 yes, 0 no, both
    final and kept; -1 no and -2 yes for now: auto mode still measures or tries a class, so the key is
    asked again next time; 3 yes, and auto mode re-checks the key's classes: kept as
    [calls routed, the count that asks again, the count last reported, the re-check's calls sent to the
    op], asked again at the re-checks' counts with `routed` the calls sent to torch's function since it
    last asked, which lets the provider sample both kernels on the op's next calls (answers -1, up to
    _RECHECK_ASKS) and move a class whose first samples a busy moment cut short).
    The key is what decides beyond the arguments' sizes: the mode of the call (autocast's dtype),
    the thread count, each tensor's device, dtype, shape and strides, and `extra`. Never routed (the
    op's own path and checks): while compiling or tracing (which record the op), or where an argument
    is a tensor subclass (its own behavior) or not a tensor. Built flat, in one tuple: this runs on
    every eager call of a routed op, and a small call's whole time is tens of microseconds."""
    ta, tb, tc = type(a), type(b), type(c)
    if ta is not _TENSOR and ta is not _PARAMETER or b is not _ABSENT and tb is not _TENSOR and tb is not _PARAMETER \
            or c is not None and tc is not _TENSOR and tc is not _PARAMETER or _compiling() or _tracing():
        return False
    ac = _autocast("cpu") and _autocast_dtype("cpu")
    if b is _ABSENT:
        key = (kind, grads, ac, _threads(), a.is_cpu, a.dtype, a.shape, a.stride(), *extra)
    elif c is None:
        key = (kind, grads, ac, _threads(), a.is_cpu, b.is_cpu, a.dtype, b.dtype, a.shape, b.shape, a.stride(),
               b.stride(), *extra)
    else:
        key = (kind, grads, ac, _threads(), a.is_cpu, b.is_cpu, c.is_cpu, a.dtype, b.dtype, c.dtype, a.shape, b.shape,
               c.shape, a.stride(), b.stride(), c.stride(), *extra)
    known = TORCH_LINEARS.get(key)
    if known is not None:
        if known is True or known is False:
            return known
        if known[0] < known[1] or known[1] < 0:  # routed, re-checked: not asked this time (-1: no more)
            known[0] += 1
            return True
        on_torch = query(key, known[0] - known[2])
        known[2] = known[0]
        known[3] += on_torch == -1
        if on_torch == 3 or on_torch == -1 and known[3] > _RECHECK_ASKS:
            known[1] = known[1] * 2 if known[1] < _RECHECK_LAST else -1
            known[0] += 1
            known[3] = 0
            return True
        if on_torch >= 0:
            TORCH_LINEARS[key] = on_torch == 1
        return on_torch == 1 or on_torch == -2  # (for now: asked again next time)
    on_torch = query(key, 0)  # depends on what the key holds alone
    if on_torch >= 0:
        if len(TORCH_LINEARS) >= _KEYS_MAX:
            TORCH_LINEARS.clear()
        TORCH_LINEARS[key] = [1, _RECHECK_FIRST, 0, 0] if on_torch == 3 else on_torch == 1
    return on_torch == 1 or on_torch == 3 or on_torch == -2


# timed calls of each side for a small class (after one warm-up call each), in alternating order. 6 were too
# few on the first calls of a process: attention of 1-2 heads x 64 queries with a gradient (Zen 4, 2 threads)
# went to the op in 4 of 32 fresh processes, where it runs 0.81x SDPA; 20 rounds sent it to SDPA in all 32,
# at 5.9 ms of probing a class instead of 2.0
_SMALL_ROUNDS = 20
# the op's best time must beat torch's by this factor: a near tie takes torch's function (the op's side of a
# small call pays Python's autograd hop, whose cost varies more than a kernel's)
_OWN_MARGIN = 1.03


# calls of a small class answered by its first timing; the next is timed again and settles it
_SMALL_AGAIN = 64


def _small_class(key, own, theirs, inputs, needs_grad: bool) -> int:
    """query()'s answer for a small class auto mode times whole (_routed's codes), for small problems,
    where an op's fixed costs (its autograd formula is Python's) can outweigh its kernel's speed: timed
    on its first call (_timed_whole) and answered by that timing for now (-2 torch's function, -1 the
    op) for _SMALL_AGAIN calls, then timed again and settled (1, 0) on each side's best time of the two
    timings, the op's only where it wins by _OWN_MARGIN. A first timing runs among the process's first
    calls (cold caches, fresh pages, other threads starting): on a 2-core Zen 4, with 6 rounds a side, it
    sent one head x 64 queries (with a gradient), where the op runs 0.81x SDPA, to the op in 4 of 32
    fresh processes; two heads x 128, a near tie in steady state, went either way."""
    trial = SMALL_TRIALS.get(key)
    if trial is None:
        if len(SMALL_TRIALS) >= _KEYS_MAX:
            SMALL_TRIALS.clear()
        trial = SMALL_TRIALS[key] = [0, *_timed_whole(own, theirs, inputs, needs_grad)]
    trial[0] += 1
    if trial[0] <= _SMALL_AGAIN:
        return -2 if trial[2] <= trial[1] * _OWN_MARGIN else -1
    own_s, theirs_s = _timed_whole(own, theirs, inputs, needs_grad)
    SMALL_TRIALS.pop(key, None)  # another thread may have settled it while this one timed
    return int(min(theirs_s, trial[2]) <= min(own_s, trial[1]) * _OWN_MARGIN)


def _timed_whole(own, theirs, inputs, needs_grad: bool) -> tuple[float, float]:
    """own(*inputs)'s and theirs(*inputs)'s best times, timed whole: the forward, and the backward of a
    gradient of ones when needs_grad, the best of _SMALL_ROUNDS calls each after a warm-up call each,
    the two sides' order swapped every round (whichever runs second finds the other's memory freed and
    its caches warm). On copies of the inputs (same strides), in the caller's modes (grad, autocast);
    draws no random numbers."""
    args = [t.detach().clone().requires_grad_(needs_grad) for t in inputs]
    best = [math.inf, math.inf]
    sides = ((0, own), (1, theirs))
    for r in range(_SMALL_ROUNDS + 1):
        for side, fn in sides if r % 2 else sides[::-1]:
            t0 = time.perf_counter()
            out = fn(*args)
            if needs_grad:
                torch.autograd.grad(out, args, torch.ones_like(out))
            if r > 0:  # the first call of each warms up
                best[side] = min(best[side], time.perf_counter() - t0)
    return best[0], best[1]


def _off_the_cpu(x, weight, bias) -> bool:
    """Whether x, weight and bias (when given) are all tensors, none of them on the CPU."""
    return isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and not (x.is_cpu or weight.is_cpu) \
        and (bias is None or isinstance(bias, torch.Tensor) and not bias.is_cpu)


def _plain_on_torch(x, weight, bias, needs_grad) -> bool:
    """Whether a plain linear (no activation) of these operands, eager and on plain CPU tensors, has every
    product on torch's GEMM (the provider's mode torch, or classes auto mode settled for torch): the op
    would then fuse nothing F.linear does not, and only add its autograd hop through Python."""

    def query(key, routed: int) -> int:
        if not (x.is_cpu and weight.is_cpu and (bias is None or bias.is_cpu)) or weight.dim() != 2 or x.dim() < 1:
            return 0
        dt = _operand_dtype([x.dtype, weight.dtype] + ([] if bias is None else [bias.dtype]))
        if dt is None or bias is not None and bias.dim() != 1:
            return 0
        k = x.shape[-1]
        if x.dim() == 2:
            m, (rsx, csx) = x.shape[0], x.stride()
        elif x.is_contiguous():
            m, rsx, csx = x.numel() // max(k, 1), k, 1
        else:
            return 0
        if weight.shape[1] != k:
            return 0
        return _linear_on_torch(m, weight.shape[0], k, rsx, csx, *weight.stride(), dt == torch.bfloat16,
                                bias is not None, needs_grad, _threads(), routed)

    return _routed("linear", needs_grad, query, x, weight, bias)


def _mm_on_torch(a, b, needs) -> bool:
    """The same for a 2-d matmul (needs: 1 a's gradient, 2 b's): torch.mm runs it then."""

    def query(key, routed: int) -> int:
        if not (a.is_cpu and b.is_cpu) or a.dim() != 2 or b.dim() != 2:
            return 0
        dt = _operand_dtype([a.dtype, b.dtype])
        if dt is None or a.shape[1] != b.shape[0]:
            return 0
        return _matmul_on_torch(a.shape[0], b.shape[1], a.shape[1], *a.stride(), *b.stride(), dt == torch.bfloat16,
                                needs, _threads(), routed)

    return _routed("matmul", needs, query, a, b)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = "none",
           recompute: bool = False):
    """``act(x @ weight.T + bias)`` in one pass: ``torch.nn.functional.linear``
    with the bias and the activation applied while each output tile is in
    registers.

    Args:
        x: (..., in_features), any strides (read in place).
        weight: (out_features, in_features) as ``nn.Linear`` stores it, any strides.
        bias: (out_features,) or None.
        activation: "none", "relu", "gelu" (exact, erf), "gelu_tanh" or "silu".
        recompute: keep no pre-activation for the backward; the backward
            recomputes it (x @ weight.T + bias) a row chunk at a time. Saves
            an (..., out_features) tensor between forward and backward for one
            more GEMM in the backward (four instead of three).

    float32 runs opforge's GEMM (AVX-512 or AVX2 micro-kernel where
    available); bfloat16 the same GEMM on bfloat16 pairs where the CPU has
    AVX512-BF16 (AMX-BF16 tiles where it has those), else (and float16 always) on operands converted to float32
    while packed (float32 accumulation, one rounding); float64 a reference
    loop (for gradcheck). The pre-activation is kept for the backward only
    when an activation is applied, a gradient is needed (grad mode on and an
    input requires grad) and recompute is off: inference writes the output
    alone. The backward reuses the kept pre-activation as its scratch when
    the graph is not retained. Under autocast the op runs in the autocast
    dtype (policy lower), as F.linear does.

    A plain product (activation "none") whose every GEMM, forward and backward, the GEMM provider runs on
    torch's own (``OPFORGE_GEMM=torch``, or classes auto mode measured faster there) is ``F.linear``
    itself in eager mode: the op would fuse nothing there, and its autograd formula, registered from
    Python, costs ~60-140 us a step more than F.linear's. Auto mode's first calls of a class still run
    the op, which measures them; ``torch.compile`` and ``torch.jit.trace`` record the op.

    opforge's linear has CPU kernels only: a plain product whose operands all lie on another device (a
    model moved to the GPU, the meta device) is ``F.linear`` there, in every mode, so a model whose
    projections call this function runs wherever its parameters are. With an activation, or with
    operands on different devices, the op runs and names what it refuses.
    """
    if activation in (None, "none") and _off_the_cpu(x, weight, bias):
        return F.linear(x, weight, bias)
    needs_grad = torch.is_grad_enabled() and (  # getattr: the op checks the types, and names a None
        getattr(x, "requires_grad", False) or getattr(weight, "requires_grad", False)
        or getattr(bias, "requires_grad", False))
    if activation in (None, "none") and _plain_on_torch(x, weight, bias, needs_grad):
        return F.linear(x, weight, bias)
    return _linear(x, weight, bias, "none" if activation is None else activation, needs_grad and not recompute)[0]


@op_function(ops.matmul.default)
def _matmul(a, b):
    """The op: see matmul."""


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-d (M,K)·(K,N) or batched 3-d (B,M,K)·(B,K,N) tensors of
    any strides (transposed operands are read in place); float32, bfloat16 and
    float16 accumulate in float32, float64 runs a reference loop. Under autocast
    it runs in the autocast dtype (policy lower), as torch.matmul does.

    A 2-d product whose GEMMs, forward and the backward's that a gradient needs, the GEMM provider runs
    on torch's own (``OPFORGE_GEMM=torch``, or classes auto mode measured faster there) is ``torch.mm``
    itself in eager mode: the same GEMM, without the op's dispatch and autograd hop (4-6 us a call)."""
    needs = torch.is_grad_enabled() and (getattr(a, "requires_grad", False) | getattr(b, "requires_grad", False) << 1)
    if _mm_on_torch(a, b, needs):
        return torch.mm(a, b)
    return _matmul(a, b)


matmul.op = _matmul.op  # what opforge.testing.check and opforge.benchmark.bench take it for
