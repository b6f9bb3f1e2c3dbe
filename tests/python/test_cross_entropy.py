"""The fused cross_entropy against F.cross_entropy: the grid of reduction x
ignore_index x label_smoothing x weight per dtype (values and gradients vs
float64), softcap against its formula, class-last layouts, gradcheck,
opcheck, torch.compile, autocast, thread counts, ISAs, edge cases and every
error."""

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fuzz
import opforge
import thread_sweep
import training
from opforge import functional as OF

CE = torch.ops.opforge.cross_entropy.default
CEB = torch.ops.opforge.cross_entropy_backward.default
# Against float64 torch on the same (rounded) logits and weights. The loss is
# lse - z_t (and the smoothing sums) per row in float32, then a float64 sum of
# the rows rounded once: float32 ~1e-6 relative per row. 16-bit types: the
# loss rounded once to the type (half an ulp). Gradients: softmax - one-hot,
# one rounding.
TOL = {
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.bfloat16: dict(rtol=8e-3, atol=8e-3),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
}
GRAD_TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-6),
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-3),
    torch.float16: dict(rtol=2e-3, atol=2e-4),
}


def inputs(n, c, dtype, ignore, weight, scale=3.0):
    x = (torch.randn(n, c) * scale).to(dtype)
    t = torch.randint(0, c, (n,))
    if ignore:
        t[::3] = -100
    w = (torch.rand(c) + 0.5).to(dtype) if weight else None
    return x, t, w


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(
    "reduction, ignore, smoothing, weight",
    list(itertools.product(["mean", "sum", "none"], [False, True], [0.0, 0.2], [False, True])),
)
def test_grid_matches_torch(reduction, ignore, smoothing, weight, dtype):
    x, t, w = inputs(37, 123, dtype, ignore, weight)
    x = x.requires_grad_()
    xr = x.detach().double().requires_grad_()
    wr = None if w is None else w.double()
    got = OF.cross_entropy(x, t, w, label_smoothing=smoothing, reduction=reduction)
    want = F.cross_entropy(xr, t, wr, label_smoothing=smoothing, reduction=reduction)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    g = torch.randn(want.shape)
    got.backward(g.to(dtype))
    want.backward(g.double())
    torch.testing.assert_close(x.grad.double(), xr.grad, **GRAD_TOL[dtype])
    if ignore:
        assert (x.grad[t == -100] == 0).all()


@pytest.mark.parametrize("n, c", [(1, 1), (3, 7), (4, 4097), (2, 32000)])
def test_sizes(n, c):
    x, t, _ = inputs(n, c, torch.float32, False, False)
    x.requires_grad_()
    xr = x.detach().double().requires_grad_()
    OF.cross_entropy(x, t).backward()
    F.cross_entropy(xr, t).backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, **GRAD_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("smoothing, weight", [(0.0, False), (0.1, True)])
def test_softcap_matches_the_formula(smoothing, weight, dtype):
    cap = 30.0
    x, t, w = inputs(37, 500, dtype, True, weight, scale=40.0)
    x = x.requires_grad_()
    xr = x.detach().double().requires_grad_()
    wr = None if w is None else w.double()
    got = OF.cross_entropy(x, t, w, label_smoothing=smoothing, softcap=cap)
    want = F.cross_entropy(cap * torch.tanh(xr / cap), t, wr, label_smoothing=smoothing)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    got.backward()
    want.backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, **GRAD_TOL[dtype])


def test_class_dim_last_and_unbatched():
    x = torch.randn(2, 5, 3, 11, requires_grad=True)  # (..., C)
    t = torch.randint(0, 11, (2, 5, 3))
    t[0, 1] = -100
    xr = x.detach().clone().requires_grad_()
    got = OF.cross_entropy(x, t, reduction="none")
    want = F.cross_entropy(xr.movedim(-1, 1), t, reduction="none")  # torch: class dim 1
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, **GRAD_TOL[torch.float32])
    # a class-last view of torch's (N, C, d) layout is read in place
    xc = torch.randn(4, 9, 6)
    tc = torch.randint(0, 9, (4, 6))
    torch.testing.assert_close(OF.cross_entropy(xc.movedim(1, -1), tc), F.cross_entropy(xc, tc), **TOL[torch.float32])
    # one sample: (C,) and a 0-d target, as torch accepts
    x1, t1 = torch.randn(7), torch.tensor(3)
    torch.testing.assert_close(OF.cross_entropy(x1, t1), F.cross_entropy(x1, t1), **TOL[torch.float32])


def test_strided_logits_target_and_weight():
    x = torch.randn(50, 24).t()  # (24, 50) with class stride 24
    t = torch.randint(0, 50, (48,))[::2]
    w = torch.rand(100)[::2] + 0.5
    torch.testing.assert_close(OF.cross_entropy(x, t, w, label_smoothing=0.1),
                               F.cross_entropy(x, t, w, label_smoothing=0.1), **TOL[torch.float32])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing, weight, softcap", [(0.0, False, None), (0.3, True, None), (0.1, True, 2.0)])
def test_gradcheck_float64(reduction, smoothing, weight, softcap):
    x, t, w = inputs(6, 5, torch.float64, True, weight)
    x.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a: OF.cross_entropy(a, t, w, label_smoothing=smoothing, reduction=reduction, softcap=softcap), (x,))


def test_minus_inf_logits_and_rows():
    x = torch.randn(5, 9)
    x[:, ::4] = float("-inf")
    t = torch.tensor([1, 2, 3, 5, 0])  # row 4's target has logit -inf: loss inf, as torch
    x[3] = float("-inf")  # a row of -inf only: NaN, as torch
    x = x.requires_grad_()
    got = OF.cross_entropy(x, t, reduction="none")
    want = F.cross_entropy(x.detach(), t, reduction="none")
    torch.testing.assert_close(got, want, equal_nan=True)
    assert got[4].item() == float("inf") and got[3].isnan()
    # finite rows: finite gradients, exact 0 at the -inf logits
    (g,) = torch.autograd.grad(got[:3].sum(), x)
    assert torch.isfinite(g[:3]).all() and (g[:3, ::4] == 0).all()


def test_all_rows_ignored():
    x = torch.randn(4, 6, requires_grad=True)
    t = torch.full((4,), -100)
    for red, smoothing in itertools.product(["mean", "sum", "none"], [0.0, 0.1]):
        got = OF.cross_entropy(x, t, reduction=red, label_smoothing=smoothing)
        want = F.cross_entropy(x.detach(), t, reduction=red, label_smoothing=smoothing)
        torch.testing.assert_close(got, want, equal_nan=True)
        (g,) = torch.autograd.grad(got.sum(), x)
        assert (g == 0).all()


def test_other_ignore_index():
    x, t, _ = inputs(20, 8, torch.float32, False, False)
    t[::2] = 3
    torch.testing.assert_close(OF.cross_entropy(x, t, ignore_index=3), F.cross_entropy(x, t, ignore_index=3))


def test_opcheck():
    x, t, w = inputs(7, 13, torch.float32, True, True)
    opcheck(CE, (x, t, None, -100, 0.0, 1, None))
    opcheck(CE, (x.requires_grad_(), t, w, -100, 0.1, 0, 5.0))
    opcheck(CE, (torch.randn(2, 3, 13), torch.randint(0, 13, (2, 3)), None, -100, 0.0, 2, None))
    losses, loss, lse = CE(x.detach(), t, w, -100, 0.1, 1, None)
    opcheck(CEB, (torch.randn(7), torch.tensor(1.0), x.detach(), t, w, lse, -100, 0.1, 1, None))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(dynamic):
    torch._dynamo.reset()
    w = torch.rand(17) + 0.5

    def block(a, t):
        return OF.cross_entropy(a, t, w, label_smoothing=0.1) + OF.cross_entropy(a, t, reduction="none").sum()

    compiled = torch.compile(block, fullgraph=True, dynamic=dynamic)
    for rows in (6, 9):
        x, t, _ = inputs(rows, 17, torch.float32, True, False)
        x.requires_grad_()
        xr = x.detach().clone().requires_grad_()
        out = compiled(x, t)
        out.backward()
        ref = F.cross_entropy(xr, t, w, label_smoothing=0.1) + F.cross_entropy(xr, t, reduction="none").sum()
        ref.backward()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)


def test_compile_refuses_what_eager_refuses():
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, t: OF.cross_entropy(a, t, softcap=-1.0), fullgraph=True)
    with pytest.raises(Exception, match="argument 'softcap' must be > 0"):
        compiled(torch.randn(3, 4), torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_runs_in_float32_as_torch(dtype):
    x, t, _ = inputs(9, 31, torch.float32, True, False)
    xl = x.to(dtype).requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        got = OF.cross_entropy(xl, t)
        want = F.cross_entropy(xl.detach(), t)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, F.cross_entropy(xl.detach().float(), t), **TOL[torch.float32])
    got.backward()
    assert xl.grad.dtype == dtype


@pytest.mark.parametrize("reduction, smoothing", [("mean", 0.0), ("sum", 0.1), ("none", 0.0)])
def test_same_bits_on_1_and_2_threads(reduction, smoothing):
    x, t, w = inputs(333, 1000, torch.float32, True, True)
    x.requires_grad_()
    saved = torch.get_num_threads()
    res = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x.grad = None
            loss = OF.cross_entropy(x, t, w, label_smoothing=smoothing, reduction=reduction)
            loss.sum().backward()
            res.append((loss.detach(), x.grad.clone()))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


def test_every_isa_agrees():
    x, t, w = inputs(37, 4097, torch.float32, True, True)
    outs = {}
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            xi = x.clone().requires_grad_()
            loss = OF.cross_entropy(xi, t, w, label_smoothing=0.1, softcap=20.0)
            loss.backward()
            outs[isa] = (loss.detach(), xi.grad)
    finally:
        opforge.set_isa("auto")
    for isa, (loss, g) in outs.items():
        torch.testing.assert_close(loss, outs["ref"][0], rtol=1e-5, atol=1e-6, msg=f"{isa} vs ref")
        torch.testing.assert_close(g, outs["ref"][1], rtol=1e-4, atol=1e-7, msg=f"{isa} vs ref")


def test_nn_module_is_a_drop_in():
    w = torch.rand(10) + 0.5
    ref = torch.nn.CrossEntropyLoss(weight=w, ignore_index=2, label_smoothing=0.05)
    mod = opforge.nn.CrossEntropyLoss(weight=w, ignore_index=2, label_smoothing=0.05)
    assert set(mod.state_dict()) == set(ref.state_dict()) == {"weight"}
    x, t = torch.randn(8, 10), torch.randint(0, 10, (8,))
    torch.testing.assert_close(mod(x, t), ref(x, t), **TOL[torch.float32])
    capped = opforge.nn.CrossEntropyLoss(reduction="sum", softcap=5.0)
    torch.testing.assert_close(capped(x, t), F.cross_entropy(5.0 * torch.tanh(x / 5.0), t, reduction="sum"),
                               **TOL[torch.float32])
    # torch's layouts: (C,), and (N, C, d1, ...) with the class dim at 1, also where d1 == C (a class-last
    # reading would pass the target's shape check there and be silently wrong)
    for shape in [(10,), (4, 10, 10), (3, 10, 5, 2)]:
        x = torch.randn(*shape, requires_grad=True)
        t = torch.randint(0, 10, shape[:1] + shape[2:] if len(shape) > 1 else ())
        for reduction in ("mean", "none"):
            a = torch.nn.CrossEntropyLoss(weight=w, label_smoothing=0.05, reduction=reduction)(x, t)
            b = opforge.nn.CrossEntropyLoss(weight=w, label_smoothing=0.05, reduction=reduction)(x, t)
            torch.testing.assert_close(b, a, **TOL[torch.float32])
            torch.testing.assert_close(torch.autograd.grad(b.sum(), x)[0], torch.autograd.grad(a.sum(), x)[0],
                                       **TOL[torch.float32])


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: OF.cross_entropy(torch.randn(3, 5), torch.tensor([0, 5, 1])),
         r"\[opforge::cross_entropy\] argument 'target' must hold class indices in \[0, 5\) or ignore_index \(-100\), got 5 at row 1"),
        (lambda: OF.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, -3])), r"got -3 at row 2"),
        (lambda: OF.cross_entropy(torch.randn(2, 5, 3), torch.randint(0, 5, (2, 3))),
         r"\[opforge::cross_entropy\] argument 'target' \[2, 3\] has the shape of torch's \(N, C, d1, ...\) layout, "
         r"but the class dim is logits' LAST here: pass logits.movedim\(1, -1\)"),
        (lambda: OF.cross_entropy(torch.randn(3, 5), torch.tensor([0.0, 1.0, 2.0])),
         r"argument 'target' must be int64 class indices, got float32"),
        (lambda: OF.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1])),
         r"argument 'target' must have the shape of 'logits without its last \(class\) dim' \[3\], got \[2\]"),
        (lambda: OF.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), torch.rand(4)),
         r"\[opforge::cross_entropy\] argument 'weight' must have size\(0\) == logits.size\(-1\) = 5, got 4 "
         r"\(weight: \[4\], logits: \[3, 5\]\)"),
        (lambda: OF.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), torch.rand(1, 5)),
         r"\[opforge::cross_entropy\] argument 'weight' must have 1 dim \(C,\), got 2: \[1, 5\]"),
        (lambda: OF.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), torch.rand(5).double()),
         r"argument 'weight' must have the dtype of 'logits' \(float32\), got float64"),
        (lambda: OF.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), softcap=0.0),
         r"argument 'softcap' must be > 0 or None, got 0"),
        (lambda: OF.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), label_smoothing=1.5),
         r"argument 'label_smoothing' must be in \[0, 1\], got 1.5"),
        (lambda: OF.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), reduction="avg"),
         r"\[opforge::cross_entropy\] argument 'reduction' must be one of 'none', 'mean', 'sum', got 'avg'"),
        (lambda: CE(torch.randn(3, 5), torch.tensor([0, 1, 2]), None, -100, 0.0, 7, None),
         r"argument 'reduction' must be 0 \(none\), 1 \(mean\) or 2 \(sum\), got 7"),
        (lambda: OF.cross_entropy(torch.tensor(1.0), torch.tensor(0)),
         r"argument 'logits' must have at least 1 dim"),
        (lambda: OF.cross_entropy(torch.ones(3, 5, dtype=torch.int64), torch.tensor([0, 1, 2])),
         r"argument 'logits' must be a floating-point tensor"),
    ],
)
def test_bad_input(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


# ---- what the generic tests run of this op (tests/python/discover.py) ------------------------------------

# fuzz.py: random rows and classes near the vector widths and lane chunks, weights, smoothing, softcap,
# reductions, ignored rows, -inf logits, layouts, dtypes, ISAs and threads, against float64 torch

CE_MARKS = (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 123, 4097, 32000)  # vectors, lane chunks, vocab


def _fuzz_draw(rng, c):
    nlead = rng.choices((0, 1, 2), (0.1, 0.7, 0.2))[0]
    lead = [fuzz.dim(rng, 64 if nlead == 2 else 300, CE_MARKS[:13], zero=0.02) for _ in range(nlead)]
    classes = max(1, fuzz.dim(rng, 32000, CE_MARKS, zero=0.0))
    while math.prod(lead) * classes > 1_500_000:
        lead[lead.index(max(lead))] //= 2
    c["shape"] = lead + [classes]
    c["layout"] = fuzz.layout(rng, c["shape"], expand=False)
    c["weight"] = rng.random() < 0.4
    c["smoothing"] = rng.choice((0.0, 0.0, 0.1, 1.0, round(rng.uniform(0, 1), 3)))
    c["softcap"] = rng.choice((None, None, 30.0, 1.5))
    c["reduction"] = rng.choice(("mean", "sum", "none"))
    c["ignore"] = rng.choice((0.0, 0.0, 0.3, 1.0))  # share of rows whose target is ignore_index
    c["specials"] = rng.random() < 0.2
    c["grad"] = rng.random() < 0.7
    return fuzz.seconds(c, 0, 0, math.prod(c["shape"]) * 60)


def _fuzz_describe(c):
    return (f"logits={tuple(c['shape'])}{fuzz.layout_str(c['layout'])} weight={c['weight']} "
            f"smoothing={c['smoothing']} softcap={c['softcap']} reduction={c['reduction']} ignore={c['ignore']} "
            f"specials={c['specials']} grad={c['grad']}")


def _fuzz_check(c, gen, dtype, dt, call):
    base, view = fuzz.make(gen, c["shape"], dtype, c["layout"], scale=3.0)
    classes = c["shape"][-1]
    if c["specials"] and base.numel():
        idx = torch.randint(0, base.numel(), (min(base.numel(), 32),), generator=gen)
        base.view(-1)[idx] = -math.inf
    base.requires_grad_(c["grad"])
    x = view(base)
    lead = c["shape"][:-1]
    t = torch.randint(0, classes, lead, generator=gen)
    t[torch.rand(lead, generator=gen) < c["ignore"]] = -100
    w = (torch.rand(classes, generator=gen, dtype=torch.float64) + 0.25).to(dtype) if c["weight"] else None
    cap, eps, red = c["softcap"], c["smoothing"], c["reduction"]
    loss_shape = lead if red == "none" else []
    g = fuzz.random_tensor(gen, loss_shape, dtype)

    def forward_backward():
        loss = opforge.functional.cross_entropy(x, t, w, label_smoothing=eps, reduction=red, softcap=cap)
        return loss, (torch.autograd.grad(loss, x, g)[0] if c["grad"] else None)

    if c["grad"]:
        loss, dx = call(forward_backward)
    else:
        with torch.no_grad():
            loss, dx = call(forward_backward)
    x64 = x.detach().double().requires_grad_()
    w64 = None if w is None else w.double()
    with torch.enable_grad():
        z = x64 if cap is None else cap * torch.tanh(x64 / cap)
        flat, tf = z.reshape(-1, classes), t.reshape(-1)
        want = F.cross_entropy(flat, tf, w64, label_smoothing=eps, reduction=red)
        want = want.reshape(lead) if red == "none" else want
        gwant = torch.autograd.grad(want, x64, g.double())[0] if c["grad"] else None
    if gwant is not None:  # ignored rows get 0 (cross_entropy.h); torch's log_softmax backward turns an
        gwant = gwant.masked_fill((t == -100)[..., None], 0.0)  # ignored row of -inf into NaN (0 * NaN)
    u = fuzz.U_ACC[dt]
    zd = z.detach().reshape(-1, classes)
    keep = tf != -100
    wt = torch.ones_like(tf, dtype=torch.float64) if w64 is None else w64[tf.clamp_min(0)]
    wc = float(classes) if w64 is None else float(w64.sum())
    lse = torch.logsumexp(zd, -1)
    # a row's terms: w_t (|lse| + |z_t|) and the smoothing sum's (eps/C) sum_j w_j (|lse| + |z_j|)
    zt = zd.gather(1, tf.clamp_min(0)[:, None])[:, 0]
    wj = torch.ones(classes, dtype=torch.float64) if w64 is None else w64
    smooth = (wj * zd.abs().nan_to_num(0.0, 0.0, 0.0)).sum(-1) + wc * lse.abs()
    terms = (wt * (lse.abs() + zt.abs()) + eps / classes * smooth).nan_to_num(0.0, 0.0, 0.0) * keep
    row_b = (fuzz.C_FN * u * (1 + (0 if cap is None else cap)) + fuzz.c_sum(classes) * u) * terms
    if red == "none":
        lb = row_b.reshape(lead) + fuzz.out_tol(want.detach(), dt)
    else:
        total_w = float((wt * keep).sum())
        lb = (row_b.sum() + fuzz.c_sum(max(1, tf.numel())) * u * terms.sum()) / (total_w if red == "mean" and total_w else 1.0)
        lb = lb + fuzz.out_tol(want.detach(), dt)
    checks = [fuzz.Check("loss", loss, want.detach(), lb, dtype)]
    if c["grad"]:
        scale = g.double().abs().reshape(-1) if red == "none" else torch.full((tf.numel(),), abs(float(g)))
        if red == "mean":
            total_w = float((wt * keep).sum())
            scale = scale / (total_w if total_w else 1.0)
        p = torch.softmax(zd, -1).nan_to_num(0.0, 0.0, 0.0)
        a = (scale * ((1 - eps) * wt + eps / classes * wc))[:, None]
        err_p = fuzz.C_FN * u * (1 + zd.abs().nan_to_num(0.0, 0.0, 0.0) + lse.abs().nan_to_num(0.0, 0.0, 0.0)[:, None])
        gb = a * p * err_p + (scale * (1 + wt))[:, None] * fuzz.C_FN * u * (eps / classes + (1 - eps))
        checks.append(fuzz.Check("dlogits", dx, gwant, (4 * gb).reshape(gwant.shape) + fuzz.out_tol(gwant, dt), dtype))
    return checks


FUZZ = {
    # cross_entropy.c (lse saved in float64): float32 from the 16-bit inputs to the rounded results
    "cross_entropy": fuzz.Op(_fuzz_draw, _fuzz_check, _fuzz_describe, weight=0.15, order=9,
                             rounded={("*", "*"): ()}),
}


# test_export.py: the op's part of the exported model; its target is the model's as given, so a target out
# of range is this op's to refuse


def _export(g, hidden, vocab, max_len):
    def run(x, target, head):
        return (OF.cross_entropy((x @ head.T).reshape(-1, vocab), target.reshape(-1)),)

    return {"head": torch.randn(vocab, hidden, generator=g) / hidden**0.5}, run


EXPORT = {"cross_entropy": _export}


# test_training.py: autocast, checkpointing and determinism

TRAINING = {
    "cross_entropy": training.Case(
        ("cross_entropy",),
        lambda dt, big: [training.randn(3000 if big else 37, 50, dtype=dt), training.target(3000 if big else 37, 50)],
        (0,),
        OF.cross_entropy,
        F.cross_entropy,
        autocast="fp32"),
}


# test_thread_sweep.py: empty and tiny shapes at 1-64 threads


def _sweep_cases():
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
                t = torch.full(lead, -100) if ignored == "all" else thread_sweep.targets(lead, c, 2, ignored)
                w = (thread_sweep.randn((c,), 3).abs() + 0.5).to(dt) if weighted else None
                return ((thread_sweep.randn((*lead, c), 1) * 2).to(dt), t, w)

            def fn(x, t, w, red=red, ls=ls, cap=cap):
                return (opforge.cross_entropy(x, t, w, label_smoothing=ls, reduction=red, softcap=cap),)

            def ref(x, t, w, red=red, ls=ls, cap=cap):
                z = x if cap is None else cap * torch.tanh(x / cap)  # as refs.cross_entropy, whose reshape(-1, 0) fails
                loss = F.cross_entropy(z.reshape(t.numel(), z.shape[-1]), t.reshape(-1), w, ignore_index=-100,
                                       reduction=red, label_smoothing=ls)
                return (loss.reshape(t.shape) if red == "none" else loss,)

            cases.append(thread_sweep.Case(f"cross_entropy logits={(*lead, c)} ignored={ignored} {red} "
                                           f"weight={weighted} smoothing={ls} softcap={cap}", make, fn, ref, grads=(0,)))
    return cases


SWEEP = {"cross_entropy": _sweep_cases}


def test_torchs_positional_order_is_named():
    x, t = torch.randn(3, 5), torch.randint(0, 5, (3,))
    with pytest.raises(RuntimeError, match=r"\[opforge::cross_entropy\] argument 'ignore_index' must be an int, got "
                                           r"None: .*not F.cross_entropy's positional order"):
        OF.cross_entropy(x, t, None, None, -100)
    torch.testing.assert_close(OF.cross_entropy(x, t, ignore_index=np.int64(2)), F.cross_entropy(x, t, ignore_index=2))
