"""Every op on empty and tiny shapes (each dim 0 in turn, 1, small odd sizes; grouped-query head
counts down to 0; GEMM-based ops with M, N and K each 0 and 1), forward and backward, float32,
bfloat16 and float64, at torch.set_num_threads(t) for t in THREADS and on every ISA this CPU runs.

Why: plans over threads (workers per task count, split-K, decode chunks, GEMM plans, row chunks,
grain sizes) divide by counts that an empty dim can make 0, and some plans depend on the thread
count: a division by zero is a SIGFPE that kills the whole run (test_attention's empty-head shapes
died so on a 16-core Xeon). 64 threads on a small machine plans as a large one does. The
references here are written out (no torch SDPA: its CPU flash kernel itself divides by zero on
empty heads, queries or keys).

Each result is compared with the float64 PyTorch reference on the same (rounded) inputs: exactly
where the reference is empty or all zeros (no key, no class, K = 0), within the dtype's tolerance
otherwise; and, per ISA, bit for bit across thread counts (README, Determinism: every op, forward
and backward, gives the same bits at any thread count).

The standalone pthread backend is not reachable from Python (the glue always installs torch's
pool): tests/c/test_sweep.c sweeps it through OPFORGE_NUM_THREADS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F

import opforge
import opforge.references as refs
from opforge.testing import assert_close

pytestmark = pytest.mark.slow

THREADS = (1, 2, 3, 7, 16, 64)
ISAS = opforge.supported_isas()
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
DTYPES = (F32, BF16, F64)
# against float64 on the rounded inputs: float32 sums of a few products; 16-bit types round once
# in float32 compute (bfloat16 attention also rounds P and dS); gradients pass more roundings
TOL = {F64: 1e-10, F32: 2e-5, BF16: 2e-2}
GTOL = {F64: 1e-9, F32: 1e-4, BF16: 5e-2}


def _grid(shape, seed):
    """Values k / 8 in [-1, 1]: exact in every dtype, so a short GEMM's sums are exact in float32 too."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, tuple(shape), generator=g, dtype=torch.int64).to(F64) / 8


def _randn(shape, seed):
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=F64)


@dataclass
class Case:
    """One call: make(dtype) gives the op's arguments; fn (opforge) and ref (PyTorch, float64)
    take them and return their outputs; grads: the arguments whose gradients are checked."""

    label: str
    make: Callable[[torch.dtype], tuple]
    fn: Callable[..., Sequence[torch.Tensor]]
    ref: Callable[..., Sequence[torch.Tensor]]
    grads: tuple[int, ...] = ()
    dtypes: tuple[torch.dtype, ...] = DTYPES
    retain_graph: bool = False  # linear: the backward that keeps the saved pre-activation


def _run(fn, args, grads, cots, retain_graph=False):
    """fn's outputs, then the gradients of sum(out * cot) for the arguments in grads (zeros where
    unused); cots: one cotangent per differentiable output, made here on the first call."""
    args = list(args)
    leaves = []
    for i in grads:
        args[i] = args[i].detach().requires_grad_()
        leaves.append(args[i])
    if not grads:
        with torch.no_grad():
            return [o for o in fn(*args)], cots
    outs = list(fn(*args))
    diff = [o for o in outs if o.requires_grad]
    if cots is None:
        cots = [_grid(o.shape, 100 + i).to(o.dtype) for i, o in enumerate(diff)]
    got = [None] * len(leaves)
    if diff:
        got = torch.autograd.grad(diff, leaves, [c.to(o.dtype) for c, o in zip(cots, diff)], allow_unused=True,
                                  retain_graph=retain_graph)
    return [o.detach() for o in outs] + [torch.zeros_like(x) if g is None else g for g, x in zip(got, leaves)], cots


def _to64(a):
    return a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a


def _same_bits(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _check(got, want, dtype, nout, exact, what):
    assert len(got) == len(want), f"{what}: {len(got)} results, want {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        name = f"{what} result {i} ({'output' if i < nout else 'gradient'})"
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)}, want {tuple(w.shape)}"
        assert g.dtype == dtype, f"{name}: dtype {g.dtype}, want {dtype}"
        if w.numel() == 0:
            continue
        if exact and bool((w == 0).all()):  # nothing to sum (no key, K = 0, no row): exact zeros
            bad = g.double() != 0
            assert not bad.any(), (f"{name}: want exact zeros, got {int(bad.sum())} nonzero, first "
                                   f"{g.flatten()[bad.flatten().nonzero()[0]].item()!r}")
            continue
        tol = (TOL if i < nout else GTOL)[dtype]
        assert_close(g, w, dtype, name, atol=tol, rtol=tol)


def sweep(case: Case, dtype: torch.dtype):
    """The case on every ISA and thread count: against the reference, and bit for bit against the
    first thread count of its ISA."""
    args = case.make(dtype)
    exact = any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in args)  # an empty operand: sums of nothing
    cots = want = None
    nout = None
    for isa in ISAS:
        opforge.set_isa(isa)
        first = None
        for t in THREADS:
            torch.set_num_threads(t)
            what = f"{case.label} {dtype} isa={isa} threads={t}"
            got, cots = _run(case.fn, args, case.grads, cots, case.retain_graph)
            if want is None:
                nout = len(got) - len(case.grads)
                want, _ = _run(case.ref, [_to64(a) for a in args], case.grads, [c.double() for c in cots or []])
            _check(got, want, dtype, nout, exact, what)
            if first is None:
                first = (t, got)
                continue
            for i, (a, b) in enumerate(zip(got, first[1])):
                assert _same_bits(a, b), f"{what}: result {i} differs from threads={first[0]} bit for bit"


@pytest.fixture(autouse=True)
def _restore_threads_and_isa():
    threads, isa = torch.get_num_threads(), opforge.get_isa()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        opforge.set_isa("auto" if isa == opforge.isa_best() else isa)


# ---- dispersion_correction, glu, softmax: elementwise and row ops ------------------------------------------

# the last, wide, splits over threads (the elementwise grains are 16384 and 32768 elements)
ELEMENTWISE = [(), (0,), (1,), (7,), (17,), (0, 5), (5, 0), (3, 0, 2), (2, 3, 5), (1, 1, 1), (129, 257)]


def _dc_cases():
    cases = []
    for shape in ELEMENTWISE + ["t"]:
        def make(dt, shape=shape):
            if shape == "t":  # transposed: strided, read in place
                return ((torch.rand(5, 3, generator=torch.Generator().manual_seed(1), dtype=F64) + 0.25).to(dt).t(), 0.7)
            return ((torch.rand(shape, generator=torch.Generator().manual_seed(1), dtype=F64) + 0.25).to(dt), 0.7)
        cases.append(Case(f"dispersion_correction {shape}", make, lambda x, a: (opforge.dispersion_correction(x, a),),
                          lambda x, a: (refs.dispersion_correction(x, a),), grads=(0,)))
    return cases


GLU = {"swiglu": (lambda g, u: opforge.swiglu(g, u), 4),
       "geglu": (lambda g, u: opforge.geglu(g, u), 2),
       "geglu_tanh": (lambda g, u: opforge.geglu(g, u, approximate="tanh"), 3)}


def _glu_cases():
    cases = []
    names = list(GLU)
    for i, shape in enumerate(ELEMENTWISE):
        name = names[i % 3]
        fn, code = GLU[name]
        cases.append(Case(f"{name} {shape}", lambda dt, s=shape: ((_randn(s, 1) * 3).to(dt), _randn(s, 2).to(dt)),
                          lambda g, u, fn=fn: (fn(g, u),), lambda g, u, code=code: (refs.glu(g, u, code),),
                          grads=(0, 1)))
    for i, shape in enumerate([(0, 4), (3, 0), (2, 6), (1, 2), (2, 0, 10)]):  # packed (..., 2F): two views
        name = names[i % 3]
        fn, code = GLU[name]
        cases.append(Case(f"{name} packed {shape}", lambda dt, s=shape: ((_randn(s, 3) * 3).to(dt),),
                          lambda x, fn=fn: (fn(x, None),),
                          lambda x, code=code: (refs.glu(*x.chunk(2, -1), code),), grads=(0,)))
    return cases


SOFTMAX = [((), 0), ((0,), 0), ((1,), 0), ((17,), -1), ((5, 0), -1), ((5, 0), 0), ((0, 5), -1), ((0, 5), 0),
           ((3, 7), -1), ((3, 7), 0), ((2, 3, 5), 1), ((2, 0, 3), 2), ((1, 1, 1), 1), ("t", 0), ((64, 520), -1),
           ((520, 64), 0)]


def _softmax_cases():
    cases = []
    for log in (False, True):
        op, ref = (opforge.log_softmax, F.log_softmax) if log else (opforge.softmax, F.softmax)
        for shape, dim in SOFTMAX:
            def make(dt, shape=shape, dim=dim):
                x = _randn((7, 5), 4).t() if shape == "t" else _randn(shape, 4)
                return ((x * 2).to(dt), dim)
            cases.append(Case(f"{op.__name__} {shape} dim={dim}", make, lambda x, d, op=op: (op(x, d),),
                              lambda x, d, ref=ref: (ref(x, d),), grads=(0,)))
    return cases


# ---- norms -------------------------------------------------------------------------------------------

NORM = [(0, 5), (5, 0), (0, 0), (1, 1), (1, 7), (3, 1), (7,), (2, 3, 7), (3, 0, 5), (17, 3), "t", (70, 257)]


def _norm_x(shape, seed):
    return _randn((17, 5), seed).t() if shape == "t" else _randn(shape, seed)


def _hidden(shape):
    return 17 if shape == "t" else shape[-1]


def _norm_cases():
    cases = []
    for i, shape in enumerate(NORM):
        h = _hidden(shape)
        weighted, offset = i % 3 != 1, i % 4 == 3

        def make(dt, shape=shape, h=h, weighted=weighted):
            w = _randn((h,), 2).to(dt) if weighted else None
            return (_norm_x(shape, 1).to(dt), w, _norm_x(shape, 3).to(dt), _randn((h,), 4).to(dt) if weighted else None)

        gw = (1,) if weighted else ()
        cases.append(Case(f"rms_norm {shape} weight={weighted} offset={offset}", make,
                          lambda x, w, r, b, o=offset: (opforge.rms_norm(x, w, 1e-6, o),),
                          lambda x, w, r, b, o=offset: refs.rms_norm(x, w, 1e-6, o), grads=(0, *gw)))
        cases.append(Case(f"add_rms_norm {shape} weight={weighted} offset={offset}", make,
                          lambda x, w, r, b, o=offset: opforge.add_rms_norm(x, r, w, 1e-5, o),
                          lambda x, w, r, b, o=offset: refs.add_rms_norm(x, r, w, 1e-5, o), grads=(0, 2, *gw)))
        gb = (1, 3) if weighted else ()
        cases.append(Case(f"layer_norm {shape} weight/bias={weighted}", make,
                          lambda x, w, r, b: (opforge.layer_norm(x, w, b, 1e-5),),
                          lambda x, w, r, b: refs.layer_norm(x, w, b, 1e-5), grads=(0, *gb)))
    return cases


# ---- rope ----------------------------------------------------------------------------------------------

# (B, Hq, Hk, N, D, R, cos layout): "nr" (N, R), "bnr" (B, N, R), "b1nr" (B, 1, N, R), "pos" a table of 5
# rows picked by position_ids (B, N), "pos1" a table of one row and position_ids (1, N)
ROPE = [(0, 2, 1, 3, 4, 4, "nr"), (1, 0, 0, 3, 4, 4, "nr"), (1, 2, 0, 3, 4, 4, "bnr"), (1, 0, 2, 3, 4, 4, "pos"),
        (1, 2, 1, 0, 4, 4, "pos"), (1, 2, 1, 0, 4, 4, "b1nr"), (1, 2, 1, 3, 0, 0, "nr"), (1, 2, 1, 3, 5, 0, "nr"),
        (1, 1, 1, 1, 2, 2, "nr"), (1, 1, 1, 1, 2, 2, "pos1"), (2, 3, 1, 5, 7, 4, "bnr"), (2, 4, 2, 7, 10, 6, "pos"),
        (3, 2, 2, 17, 6, 6, "b1nr"), (2, 1, 3, 3, 9, 8, "pos1"), (2, 4, 2, 100, 32, 32, "pos")]


def _rope_cases():
    cases = []
    for b, hq, hk, n, d, r, lay in ROPE:
        for inter in (False, True):
            def make(dt, b=b, hq=hq, hk=hk, n=n, d=d, r=r, lay=lay, inter=inter):
                q, k = _randn((b, hq, n, d), 1).to(dt), _randn((b, hk, n, d), 2).to(dt)
                rows = {"pos": 5, "pos1": 1}.get(lay, n)
                cos, sin = refs.rope_cos_sin(rows, r, interleaved=inter)
                pos = None
                if lay == "bnr":
                    cos, sin = cos.expand(b, n, r) * 1, sin.expand(b, n, r) * 1
                elif lay == "b1nr":
                    cos, sin = cos.expand(b, 1, n, r) * 1, sin.expand(b, 1, n, r) * 1
                elif lay == "pos":
                    pos = torch.randint(0, 5, (b, n), generator=torch.Generator().manual_seed(3))
                elif lay == "pos1":
                    pos = torch.zeros(1, n, dtype=torch.int64)
                return q, k, cos.to(dt), sin.to(dt), pos, inter

            cases.append(Case(f"rope B={b} Hq={hq} Hk={hk} N={n} D={d} R={r} {lay} interleaved={inter}", make,
                              opforge.rope, refs.rope, grads=(0, 1)))
    return cases


# ---- matmul, linear, linear_cross_entropy: GEMMs with M, N and K each 0 and 1 ------------------------------

# (M, K, N)
MKN = [(0, 5, 3), (5, 0, 3), (5, 3, 0), (1, 5, 3), (5, 1, 3), (5, 3, 1), (1, 1, 1), (0, 0, 0), (7, 17, 5),
       (2, 3, 2), (17, 7, 3), (37, 64, 600)]  # the last splits over threads


def _matmul_cases():
    cases = []
    for m, k, n in MKN:
        cases.append(Case(f"matmul M={m} K={k} N={n}", lambda dt, m=m, k=k, n=n: (_grid((m, k), 1).to(dt),
                                                                                  _grid((k, n), 2).to(dt)),
                          lambda a, b: (opforge.matmul(a, b),), lambda a, b: (a @ b,), grads=(0, 1)))
    for bt, m, k, n in [(0, 3, 4, 5), (1, 3, 4, 5), (3, 0, 4, 5), (3, 2, 0, 5), (3, 2, 4, 0), (3, 1, 1, 1),
                        (2, 5, 3, 7)]:
        cases.append(Case(f"matmul B={bt} M={m} K={k} N={n}",
                          lambda dt, bt=bt, m=m, k=k, n=n: (_grid((bt, m, k), 3).to(dt), _grid((bt, k, n), 4).to(dt)),
                          lambda a, b: (opforge.matmul(a, b),), lambda a, b: (a @ b,), grads=(0, 1)))
    cases.append(Case("matmul transposed a", lambda dt: (_grid((7, 5), 5).to(dt).t(), _grid((7, 3), 6).to(dt)),
                      lambda a, b: (opforge.matmul(a, b),), lambda a, b: (a @ b,), grads=(0, 1)))
    return cases


ACTS = ["none", "relu", "gelu", "gelu_tanh", "silu"]
# (activation, bias, recompute, retain_graph): stored pre-activation donated to the backward (in place),
# kept (retained graph), recomputed, and no activation
LINEAR_VARIANTS = [("gelu", True, False, False), ("silu", False, False, True), ("gelu_tanh", True, True, False),
                   ("none", True, False, False), ("relu", False, False, False)]


def _linear_cases():
    cases = []
    shapes = [((m,), k, n) for m, k, n in MKN] + [((2, 0), 5, 3), ((2, 3), 17, 7), ((0, 3), 4, 2)]
    for lead, k, n in shapes:
        for act, bias, recompute, retain in LINEAR_VARIANTS:
            code = ACTS.index(act)

            def make(dt, lead=lead, k=k, n=n, bias=bias):
                return (_grid((*lead, k), 1).to(dt), _grid((n, k), 2).to(dt), _grid((n,), 3).to(dt) if bias else None)

            cases.append(Case(f"linear x={(*lead, k)} N={n} {act} bias={bias} recompute={recompute} retain={retain}",
                              make, lambda x, w, b, a=act, r=recompute: (opforge.linear(x, w, b, a, r),),
                              lambda x, w, b, c=code: refs.linear(x, w, b, c), grads=(0, 1, 2) if bias else (0, 1),
                              retain_graph=retain))
    return cases


REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _targets(shape, classes, seed, ignored):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, max(classes, 1), shape, generator=g) if classes else torch.full(shape, -100)
    if ignored and t.numel():
        t.view(-1)[:: max(2, t.numel() // 2)] = -100
    return t


def _lce_cases():
    cases = []
    # (T lead dims, H, V); V = 0 only with every target ignored
    shapes = [((0,), 4, 5), ((3,), 0, 5), ((3,), 4, 0), ((1,), 4, 5), ((3,), 1, 5), ((3,), 4, 1), ((1,), 1, 1),
              ((0,), 0, 0), ((7,), 9, 11), ((2, 0), 3, 4), ((2, 3), 5, 7), ((64,), 32, 300)]
    variants = [("mean", False, 0.0, None, True), ("sum", True, 0.1, 2.0, True), ("none", True, 0.0, None, True),
                ("mean", True, 0.2, 4.0, False)]  # last: the op asked for no gradients in the forward
    for lead, h, v in shapes:
        for red, bias, ls, cap, cg in variants:
            ls = ls if v else 0.0  # no class: torch's smoothing term is 0 * (eps / 0) = NaN, opforge's 0
            def make(dt, lead=lead, h=h, v=v, bias=bias):
                return (_grid((*lead, h), 1).to(dt), _grid((v, h), 2).to(dt), _targets(lead, v, 3, True),
                        _grid((v,), 4).to(dt) if bias else None)

            def fn(x, w, t, b, red=red, ls=ls, cap=cap, cg=cg):
                if cg:
                    return (opforge.linear_cross_entropy(x, w, t, b, label_smoothing=ls, reduction=red, softcap=cap),)
                # the op itself, with compute_grad off: the backward recomputes the blocks from lse
                return (opforge.ops.linear_cross_entropy(x.reshape(t.numel(), x.shape[-1]), w, t.reshape(-1), b, -100, ls,
                                                         REDUCTIONS[red], cap, False)[0],)

            def ref(x, w, t, b, red=red, ls=ls, cap=cap):
                loss = refs._lce_loss(x.reshape(t.numel(), x.shape[-1]), w, t.reshape(-1), b, -100, ls,
                                      REDUCTIONS[red], cap)
                return (loss.reshape(t.shape) if red == "none" else loss,)

            cases.append(Case(f"linear_cross_entropy hidden={(*lead, h)} V={v} {red} bias={bias} smoothing={ls} "
                              f"softcap={cap} compute_grad={cg}", make, fn, ref, grads=(0, 1, 3) if bias else (0, 1)))
    return cases


# ---- cross_entropy -------------------------------------------------------------------------------------


def _ce_cases():
    cases = []
    # (lead dims of logits, C, ignore some targets); C = 0 only with every target ignored
    shapes = [((0,), 5, False), ((3,), 0, True), ((0,), 0, False), ((1,), 1, False), ((1,), 5, False),
              ((7,), 1, True), ((3,), 2, True), ((7,), 17, True), ((), 5, False), ((2, 0), 4, False),
              ((2, 3), 5, True), ((5,), 3, "all"), ((300,), 257, True)]
    variants = [("mean", False, 0.0, None), ("sum", True, 0.1, None), ("none", True, 0.0, 2.0),
                ("mean", True, 0.2, 4.0)]
    for lead, c, ignored in shapes:
        for red, weighted, ls, cap in variants:
            ls = ls if c else 0.0  # no class: torch's smoothing term is 0 * (eps / 0) = NaN, opforge's 0
            def make(dt, lead=lead, c=c, ignored=ignored, weighted=weighted):
                t = torch.full(lead, -100) if ignored == "all" else _targets(lead, c, 2, ignored)
                w = (_randn((c,), 3).abs() + 0.5).to(dt) if weighted else None
                return ((_randn((*lead, c), 1) * 2).to(dt), t, w)

            def fn(x, t, w, red=red, ls=ls, cap=cap):
                return (opforge.cross_entropy(x, t, w, label_smoothing=ls, reduction=red, softcap=cap),)

            def ref(x, t, w, red=red, ls=ls, cap=cap):
                z = x if cap is None else cap * torch.tanh(x / cap)  # as refs.cross_entropy, whose reshape(-1, 0) fails
                loss = F.cross_entropy(z.reshape(t.numel(), z.shape[-1]), t.reshape(-1), w, ignore_index=-100,
                                       reduction=red, label_smoothing=ls)
                return (loss.reshape(t.shape) if red == "none" else loss,)

            cases.append(Case(f"cross_entropy logits={(*lead, c)} ignored={ignored} {red} weight={weighted} "
                              f"smoothing={ls} softcap={cap}", make, fn, ref, grads=(0,)))
    return cases


# ---- attention and attention_decode ----------------------------------------------------------------------


def _attention64(q, k, v, keep, causal, scale):
    """softmax(q k^T scale, masked) v per head, K/V heads repeated for grouped-query attention (no
    head at all: none to repeat), rows with no key zeros; for float64 inputs."""
    h, hkv = q.shape[1], k.shape[1]
    if h == 0:
        k, v = k[:, :0], v[:, :0]
    elif hkv != h:
        k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    return torch.exp(scores - lse).nan_to_num(0.0) @ v


# (B, H, Hkv, N, S, D, Dv); N <= 4 runs the flash-decoding driver, a lone query block over >= 2 key blocks splits
ATTENTION = [(0, 2, 2, 5, 7, 8, 8), (2, 0, 0, 5, 7, 8, 8), (2, 0, 2, 5, 7, 8, 8), (2, 0, 0, 1, 7, 8, 8),
             (2, 0, 2, 1, 7, 8, 8), (2, 2, 2, 0, 7, 8, 8), (2, 4, 2, 5, 0, 8, 8), (2, 2, 1, 1, 0, 8, 8),
             (2, 4, 2, 0, 0, 8, 8), (1, 2, 2, 5, 7, 0, 8), (1, 2, 2, 2, 7, 0, 3), (1, 2, 2, 5, 7, 8, 0),
             (1, 1, 1, 1, 1, 1, 1), (1, 3, 1, 2, 3, 5, 3), (2, 4, 2, 5, 17, 7, 5), (1, 1, 1, 3, 70, 8, 8),
             (1, 1, 1, 7, 130, 8, 8), (1, 6, 3, 4, 9, 4, 4), (3, 1, 1, 17, 5, 3, 2), (2, 4, 2, 130, 130, 16, 16)]


def _attention_cases():
    cases = []
    for b, h, hkv, n, s, d, dv in ATTENTION:
        for kind in ("plain", "causal", "mask"):
            scale = 0.3 if d == 0 or kind == "mask" else None

            def make(dt, b=b, h=h, hkv=hkv, n=n, s=s, d=d, dv=dv, kind=kind):
                mask = None
                if kind == "mask":  # every row keeps key 0: no row fully masked (its gradient is torch's NaN)
                    mask = torch.rand(n, s, generator=torch.Generator().manual_seed(4)) > 0.5
                    mask[:, :1] = True
                return (_randn((b, h, n, d), 1).to(dt), _randn((b, hkv, s, d), 2).to(dt),
                        _randn((b, hkv, s, dv), 3).to(dt), mask)

            def fn(q, k, v, mask, kind=kind, scale=scale):
                return (opforge.scaled_dot_product_attention(q, k, v, mask, is_causal=kind == "causal", scale=scale,
                                                             enable_gqa=True),)

            def ref(q, k, v, mask, kind=kind, scale=scale):
                return (_attention64(q, k, v, mask, kind == "causal", scale),)

            cases.append(Case(f"attention B={b} H={h} Hkv={hkv} N={n} S={s} D={d} Dv={dv} {kind}", make, fn, ref,
                              grads=(0, 1, 2)))
    return cases


# (B, H, Hkv, N, S_max, D, Dv, seq_lens)
DECODE = [(0, 4, 2, 1, 9, 8, 8, []), (2, 0, 0, 1, 9, 8, 8, [9, 3]), (2, 0, 2, 1, 9, 8, 8, [9, 3]),
          (2, 4, 2, 1, 0, 8, 8, [0, 0]), (2, 4, 2, 0, 9, 8, 8, [9, 3]), (1, 2, 2, 1, 5, 0, 4, [5]),
          (1, 2, 2, 1, 5, 4, 0, [5]), (1, 1, 1, 1, 1, 1, 1, [1]), (3, 4, 2, 1, 11, 8, 6, [11, 0, 5]),
          (2, 6, 2, 3, 70, 5, 7, [70, 3]), (2, 3, 3, 16, 17, 8, 8, [17, 16]), (1, 2, 1, 2, 130, 8, 8, [130]),
          (2, 4, 1, 5, 7, 3, 3, [2, 7]), (2, 8, 2, 2, 700, 16, 16, [700, 650])]


def _decode_cases():
    cases = []
    for i, (b, h, hkv, n, s, d, dv, lens) in enumerate(DECODE):
        for causal in (False, True):
            scale = 0.3 if d == 0 else None

            def make(dt, b=b, h=h, hkv=hkv, n=n, s=s, d=d, dv=dv, lens=lens, i=i):
                seq = torch.tensor(lens, dtype=torch.int64 if i % 2 else torch.int32)
                # the cache as a slice of a longer (B, S_buf, Hkv, D) buffer, read in place
                k = _randn((b, s + 3, hkv, d), 2).transpose(1, 2)[:, :, :s]
                return _randn((b, h, n, d), 1).to(dt), k.to(dt), _randn((b, hkv, s, dv), 3).to(dt), seq

            def fn(q, k, v, seq, causal=causal, scale=scale):
                return (opforge.attention_decode(q, k, v, seq, scale, causal),)

            def ref(q, k, v, seq, causal=causal, scale=scale):
                n, s = q.shape[2], k.shape[2]
                limit = seq.to(torch.int64).view(-1, 1, 1, 1)
                if causal:
                    limit = limit - n + 1 + torch.arange(n).view(1, 1, n, 1)
                return (_attention64(q, k, v, torch.arange(s) < limit, False, scale),)

            cases.append(Case(f"attention_decode B={b} H={h} Hkv={hkv} N={n} S_max={s} D={d} Dv={dv} lens={lens} "
                              f"causal={causal}", make, fn, ref))
    return cases


CASES = {
    "dispersion_correction": _dc_cases,
    "glu": _glu_cases,
    "softmax": _softmax_cases,
    "norm": _norm_cases,
    "rope": _rope_cases,
    "matmul": _matmul_cases,
    "linear": _linear_cases,
    "linear_cross_entropy": _lce_cases,
    "cross_entropy": _ce_cases,
    "attention": _attention_cases,
    "attention_decode": _decode_cases,
}


def test_every_registered_op_is_swept():
    """A new op gets a sweep here: every forward op of the library belongs to a family of CASES."""
    family = {"matmul": "matmul", "linear": "linear", "attention": "attention", "attention_decode": "attention_decode",
              "rms_norm": "norm", "add_rms_norm": "norm", "layer_norm": "norm", "glu": "glu", "rope": "rope",
              "softmax": "softmax", "log_softmax": "softmax", "cross_entropy": "cross_entropy",
              "dispersion_correction": "dispersion_correction", "linear_cross_entropy": "linear_cross_entropy",
              "linear_cross_entropy_none": "linear_cross_entropy"}
    forward = [d.name for d in opforge.library.ops if not d.name.endswith(("_backward", "_backward_"))]
    missing = [name for name in forward if family.get(name) not in CASES]
    assert not missing, f"ops without a thread sweep: {missing}"


def _dtypes(case):
    """The case's dtypes; float32 and bfloat16 alone for the wide shapes that split over threads (the
    plans are the same for float64, the time is not)."""
    wide = max((a.numel() for a in case.make(F32) if isinstance(a, torch.Tensor)), default=0) > 4096
    return (F32, BF16) if wide else case.dtypes


SWEEP = [pytest.param(case, dtype, id=f"{case.label} {str(dtype)[6:]}")
         for make in CASES.values() for case in make() for dtype in _dtypes(case)]


@pytest.mark.parametrize("case, dtype", SWEEP)
def test_sweep(case, dtype):
    sweep(case, dtype)
