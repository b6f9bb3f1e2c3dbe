"""linear_cross_entropy (fused LM head + cross-entropy) against float64 PyTorch: the loss and every
gradient over reduction x ignore_index x label_smoothing x bias x softcap per dtype, block boundaries,
gradcheck, opcheck, torch.compile, autocast, thread-count determinism, all-ignored batches, the nn
module and each error message."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fuzz
import opforge
import thread_sweep
import training
from opforge import references as refs
from opforge.functional import linear_cross_entropy

LCE = torch.ops.opforge.linear_cross_entropy.default
LCE_NONE = torch.ops.opforge.linear_cross_entropy_none.default

# The loss is a sum over V exp terms and H-deep dot products computed in float32 (float32, and 16-bit
# inputs too: only the operands are rounded, and the reference reads the rounded operands; bfloat16
# operands' logits are rounded to bfloat16 as eager's are, and so are the reference's: LOGITS), returned in
# float32 for 16-bit inputs (LOSS_DTYPE): float32's tolerance. The gradients accumulate in float32 and
# round once to the dtype.
TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float16: dict(rtol=5e-3, atol=5e-3),
}
GRAD_TOL = {
    torch.float64: dict(rtol=1e-9, atol=1e-10),
    torch.float32: dict(rtol=1e-4, atol=2e-5),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
    torch.float16: dict(rtol=5e-3, atol=5e-3),
}


# the loss's dtype for hidden's: promote(hidden, float32)
LOSS_DTYPE = {dt: torch.promote_types(dt, torch.float32) for dt in TOL}


# the dtype the kernel rounds the logits to for operands of each dtype (linear_cross_entropy.h: the bfloat16
# block), or None: float32 logits
LOGITS = {torch.bfloat16: torch.bfloat16}


def reference(h, w, y, b=None, ignore_index=-100, label_smoothing=0.0, reduction="mean", softcap=None,
              logits=None):
    z = F.linear(h, w, b)
    if logits is not None:  # the float32 sum rounded to the logits' dtype, as the kernel's block holds it
        z = z.float().to(logits).to(z.dtype)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction=reduction).reshape(
        y.shape if reduction == "none" else ())


def inputs(t, h, v, dtype, ignore=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(t, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) / h ** 0.5 * 2
    b = torch.randn(v, generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (t,), generator=g)
    if ignore:
        y[1::3] = -100
    return hid.to(dtype), w.to(dtype), b.to(dtype), y


def check_against_reference(dtype, t, h, v, reduction, ignore, label_smoothing, bias, softcap, seed=0):
    hid, w, b, y = inputs(t, h, v, dtype, ignore, seed)
    b = b if bias else None
    leaves = [x.detach().clone().requires_grad_() for x in (hid, w) + ((b,) if bias else ())]
    refs = [x.detach().double().requires_grad_() for x in leaves]
    kw = dict(ignore_index=-100, label_smoothing=label_smoothing, reduction=reduction, softcap=softcap)
    got = linear_cross_entropy(leaves[0], leaves[1], y, leaves[2] if bias else None, **kw)
    want = reference(refs[0], refs[1], y, refs[2] if bias else None, logits=LOGITS.get(dtype), **kw)
    assert got.dtype == LOSS_DTYPE[dtype] and got.shape == want.shape
    torch.testing.assert_close(got.double(), want.detach(), **TOL[got.dtype], equal_nan=True)  # mean of none: NaN
    # a non-uniform gradient for none: the per-token grads must weight each token's own gradient
    g = (torch.rand(t, dtype=torch.float64) + 0.5) if reduction == "none" else torch.tensor(1.75, dtype=torch.float64)
    got.backward(g.to(got.dtype))
    want.backward(g)
    for name, leaf, ref in zip(("hidden", "weight", "bias"), leaves, refs):
        assert leaf.grad.dtype == dtype
        torch.testing.assert_close(leaf.grad.double(), ref.grad, **GRAD_TOL[dtype], equal_nan=True,
                                   msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", [False, True], ids=["all-valid", "ignored"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["no-cap", "cap"])
@pytest.mark.parametrize("hidden", [48, 24], ids=["tokens-le-hidden", "tokens-gt-hidden"])
def test_values_and_gradients(dtype, reduction, ignore, label_smoothing, bias, softcap, hidden):
    # 37 tokens <= 48 hidden: mean / sum keep dlogits (float32, bfloat16) for the backward's GEMMs;
    # > 24: the forward makes the gradients (its blocks span the vocabulary)
    check_against_reference(dtype, 37, hidden, 123, reduction, ignore, label_smoothing, bias, softcap)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_blocks_cross_token_and_vocab_boundaries(reduction):
    # more than 2048 tokens and vocab rows: two token chunks and two vocab blocks, so sweep 2 recomputes
    # the logits and accumulates dhidden over vocab blocks and dweight over token chunks
    check_against_reference(torch.float32, 2100, 16, 2500, reduction, True, 0.1, True, 5.0)


def test_gradients_made_in_the_forward_over_several_blocks():
    # the raw op with compute_grad: sweep 2 in the forward over 2 x 2 blocks, then the scaling backward
    hid, w, b, y = inputs(2100, 16, 2500, torch.float32)
    leaves = [x.requires_grad_() for x in (hid, w, b)]
    loss, lse, dh, dw, db, _ = LCE(*leaves[:2], y, leaves[2], -100, 0.1, 1, 5.0, True)
    assert dh.shape == hid.shape and dw.shape == w.shape and db.shape == b.shape
    loss.backward(torch.tensor(0.5))
    refs = [x.detach().double().requires_grad_() for x in leaves]
    (0.5 * reference(refs[0], refs[1], y, refs[2], label_smoothing=0.1, softcap=5.0)).backward()
    for a, r in zip(leaves, refs):
        torch.testing.assert_close(a.grad.double(), r.grad, **GRAD_TOL[torch.float32])
    torch.testing.assert_close(dw.double() * 0.5, refs[1].grad, **GRAD_TOL[torch.float32])


@pytest.mark.parametrize("t, h, v", [(1, 1, 1), (7, 7, 7), (1, 123, 4097), (0, 5, 9), (4, 0, 6)], ids=str)
def test_odd_and_empty_sizes(t, h, v):
    for reduction in ("mean", "sum", "none"):
        check_against_reference(torch.float32, t, h, v, reduction, False, 0.0, True, None)


def test_leading_dims_and_strided_operands():
    hid = torch.randn(3, 5, 40)[:, :, ::2]  # (3, 5, 20), column stride 2: read in place after the reshape
    w = torch.randn(20, 30).t()  # (30, 20) transposed
    b = torch.randn(60)[::2]
    y = torch.randint(0, 30, (3, 5))
    for reduction in ("mean", "none"):
        got = linear_cross_entropy(hid, w, y, b, reduction=reduction)
        want = reference(hid.double(), w.double(), y, b.double(), reduction=reduction)
        torch.testing.assert_close(got.double(), want, **TOL[torch.float32])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck_float64(reduction):
    hid, w, b, y = inputs(6, 5, 7, torch.float64)
    args = [x.requires_grad_() for x in (hid, w, b)]
    assert torch.autograd.gradcheck(
        lambda h_, w_, b_: linear_cross_entropy(h_, w_, y, b_, label_smoothing=0.2, reduction=reduction, softcap=2.0),
        args)


def test_reduction_none_backward_is_not_a_scaled_uniform_gradient():
    # the bug to avoid: a dweight precomputed for a uniform gradient and scaled afterwards. With one token
    # given gradient 1 and the others 0, the gradients are that token's alone.
    hid, w, _, y = inputs(9, 6, 11, torch.float64, ignore=False)
    w.requires_grad_()
    g = torch.zeros(9, dtype=torch.float64)
    g[4] = 1.0
    linear_cross_entropy(hid, w, y, reduction="none").backward(g)
    wr = w.detach().clone().requires_grad_()
    reference(hid[4:5], wr, y[4:5], reduction="sum").backward()
    torch.testing.assert_close(w.grad, wr.grad, **GRAD_TOL[torch.float64])


def test_no_gradient_means_no_gradient_work():
    hid, w, b, y = inputs(8, 6, 10, torch.float32)
    loss, lse, dh, dw, db, _ = LCE(hid, w, y, b, -100, 0.0, 1, None, False)
    assert dh.numel() == dw.numel() == db.numel() == 0
    torch.testing.assert_close(lse.double(), torch.logsumexp(F.linear(hid, w, b).double(), -1), **TOL[torch.float32])
    with torch.no_grad():  # the functional asks for no gradients when none can flow
        torch.testing.assert_close(linear_cross_entropy(hid.requires_grad_(), w, y, b).double(),
                                   reference(hid.double(), w.double(), y, b.double()), **TOL[torch.float32])
    # a forward that made no gradients still has a backward: it recomputes them from lse
    hg, wg = hid.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = LCE(hg, wg, y, None, -100, 0.0, 2, None, False)[0]
    out.backward()
    hr, wr = hid.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    reference(hr, wr, y, reduction="sum").backward()
    torch.testing.assert_close(hg.grad.double(), hr.grad, **GRAD_TOL[torch.float32])
    torch.testing.assert_close(wg.grad.double(), wr.grad, **GRAD_TOL[torch.float32])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("vocab", [10, 20000], ids=["one-block", "vocab-blocks"])
@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_a_frozen_head_or_hidden_gets_no_gradient_work(reduction, vocab, frozen, monkeypatch):
    # a frozen LM head (LoRA) or hidden: the forward makes no gradients, and the backward recomputes the
    # blocks and makes only the wanted one, the same values as when both are wanted
    hid, w, b, y = inputs(40, 6, vocab, torch.float32)
    full = [t.detach().clone().requires_grad_() for t in (hid, w, b)]
    loss = linear_cross_entropy(*full[:2], y, full[2], reduction=reduction)
    (loss.sum() if reduction == "none" else loss).backward()
    part = [hid.detach().clone().requires_grad_(frozen != "hidden"), w.detach().clone().requires_grad_(frozen != "weight"),
            b.detach().clone().requires_grad_()]
    module = sys.modules[linear_cross_entropy.__module__]
    asked, forward = [], module._linear_cross_entropy
    monkeypatch.setattr(module, "_linear_cross_entropy", lambda *a: asked.append(a[-2]) or forward(*a))
    loss = linear_cross_entropy(*part[:2], y, part[2], reduction=reduction)
    (loss.sum() if reduction == "none" else loss).backward()
    for got, want in zip(part, full):
        if got.requires_grad:
            torch.testing.assert_close(got.grad, want.grad, **GRAD_TOL[torch.float32])
        else:
            assert got.grad is None
    assert asked == ([] if reduction == "none" else [False])  # no gradients asked of the forward


@pytest.mark.parametrize("case", ["bfloat16", "float16", "autocast", "float32"])
@pytest.mark.parametrize("tokens", [40, 1500], ids=["one-k-slice", "k-slices"])
def test_a_large_bfloat16_head_gets_its_gradients_from_the_backward(case, tokens, monkeypatch):
    # bfloat16 operands (explicit, or float32 under bfloat16 autocast) with a head past FORWARD_GRADS_BF16_MAX
    # weight elements: the forward makes no float32 gradients, the backward recomputes the blocks (each
    # dweight block of one token chunk rounded straight into the bfloat16 result); the gradients are those the
    # forward's path gives, to the dtype's rounding. float32 and float16 operands keep the forward's
    # gradients. 1500 tokens: one chunk over several of the GEMM's K slices, whose partial sums go through a
    # float32 dweight block (40: none is allocated). (Several
    # token chunks, whose dweight blocks sum in float32 scratch: TRAINING's big linear_cross_entropy case.)
    module = sys.modules[linear_cross_entropy.__module__]
    dtype = torch.float32 if case in ("autocast", "float32") else getattr(torch, case)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if case == "autocast" else contextlib.nullcontext()
    hid, w, b, y = inputs(tokens, 24, 300, dtype)
    grads = {}
    for limit in (1 << 30, 24 * 300 - 1):  # the forward's gradients, then the backward's
        monkeypatch.setattr(module, "FORWARD_GRADS_BF16_MAX", limit)
        asked, forward = [], module._linear_cross_entropy
        monkeypatch.setattr(module, "_linear_cross_entropy", lambda *a: asked.append(a[-2]) or forward(*a))
        leaves = [x.detach().clone().requires_grad_() for x in (hid, w, b)]
        with amp:
            loss = linear_cross_entropy(*leaves[:2], y, leaves[2])
        loss.backward()
        monkeypatch.setattr(module, "_linear_cross_entropy", forward)
        assert asked == [limit > 24 * 300 or case in ("float32", "float16")], (limit, asked)
        grads[limit] = [x.grad for x in leaves]
    tol = GRAD_TOL[torch.bfloat16 if case == "autocast" else dtype]
    for name, a, r in zip(("hidden", "weight", "bias"), *grads.values()):
        assert a.dtype == r.dtype == dtype
        torch.testing.assert_close(r.double(), a.double(), **tol, msg=lambda m: f"d{name}: {m}")
    rounded = [x.detach().to(torch.bfloat16 if case == "autocast" else dtype).double().requires_grad_()
               for x in (hid, w, b)]
    ref = reference(*rounded[:2], y, rounded[2], logits=LOGITS.get(torch.bfloat16 if case == "autocast" else dtype))
    ref.backward()
    for name, r, want in zip(("hidden", "weight", "bias"), grads[24 * 300 - 1], rounded):
        torch.testing.assert_close(r.double(), want.grad, **tol, msg=lambda m: f"d{name} vs float64: {m}")


def test_a_float32_forward_makes_the_gradients_in_blocks_up_to_the_weights_size(monkeypatch):
    # 600 tokens > 256 hidden, vocabulary 16400: 256 x 16400 logits are past the default budget (4M), not past
    # the weight's size (4.2M): the forward makes the gradients in chunks of 256, 256 and 88 tokens by the whole
    # vocabulary (three GEMMs a chunk, dweight summed over the chunks) where it recomputed before
    module = sys.modules[linear_cross_entropy.__module__]
    assert not module.vocab_in_one_block(600, 16400)
    assert module.vocab_in_one_block(600, 16400, module.grads_block_floats(16400, 256))
    asked, forward = [], module._linear_cross_entropy
    monkeypatch.setattr(module, "_linear_cross_entropy", lambda *a: asked.append(a[-2:]) or forward(*a))
    hid, w, b, y = inputs(600, 256, 16400, torch.float32)
    leaves = [x.detach().clone().requires_grad_() for x in (hid, w, b)]
    refs = [x.detach().double().requires_grad_() for x in leaves]
    got = linear_cross_entropy(*leaves[:2], y, leaves[2], label_smoothing=0.1, softcap=20.0)
    assert asked == [(True, False)], asked
    want = reference(*refs[:2], y, refs[2], label_smoothing=0.1, softcap=20.0)
    torch.testing.assert_close(got.double(), want.detach(), **TOL[torch.float32])
    (got * 0.5).backward()
    (want * 0.5).backward()
    for name, leaf, ref in zip(("hidden", "weight", "bias"), leaves, refs):
        torch.testing.assert_close(leaf.grad.double(), ref.grad, **GRAD_TOL[torch.float32],
                                   msg=lambda m: f"d{name}: {m}")


LCEB = torch.ops.opforge.linear_cross_entropy_backward.default
LCEB_INPLACE = torch.ops.opforge.linear_cross_entropy_backward_.default


def _backward_ops(fn) -> list:
    """The linear_cross_entropy backward ops fn runs"""
    with torch.profiler.profile() as prof:
        fn()
    return sorted({e.name for e in prof.events() if e.name.startswith("opforge::linear_cross_entropy_backward")})


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_backward_returns_the_gradients_the_forward_made(dtype, scale, bias):
    """More tokens than hidden features: the forward makes the gradients (in the loss's dtype: hidden's for
    float32 and float64), and the backward scales them where they are (linear_cross_entropy_backward_;
    nothing is written at a gradient of 1) and returns them: the leaves' .grad are the very tensors the
    forward made, so the backward's peak holds one copy of the gradients, not two. The same bits as the
    out-of-place backward, which runs when the graph is retained or the caller holds a forward's gradient
    (left unchanged)."""
    hid, w, b, y = inputs(300, 16, 700, dtype)

    def run(retain=False, hold=False):
        leaves = [x.detach().clone().requires_grad_() for x in ((hid, w, b) if bias else (hid, w))]
        loss, _, dh, dw, db, _ = LCE(leaves[0], leaves[1], y, leaves[2] if bias else None, -100, 0.1, 1, None,
                                     True)
        made = (dh, dw, db)[:len(leaves)]
        ptrs, held = [t.data_ptr() for t in made], [t.clone() for t in made] if hold else None
        made = made if hold else None
        del dh, dw, db
        ran = _backward_ops(lambda: (loss * scale).backward(retain_graph=retain))
        if hold:
            assert all(torch.equal(a, c) for a, c in zip(made, held)), "a held gradient was written over"
        return ran, [x.grad for x in leaves], ptrs

    ran, grads, ptrs = run()
    assert ran == ["opforge::linear_cross_entropy_backward_"]
    assert [g.data_ptr() for g in grads] == ptrs, "the backward's gradients are not the forward's tensors"
    for retain, hold in ((True, False), (False, True)):
        ran_other, other, _ = run(retain, hold)
        assert ran_other == ["opforge::linear_cross_entropy_backward"]
        assert all(torch.equal(a, c) for a, c in zip(grads, other))
    refs = [x.detach().double().requires_grad_() for x in ((hid, w, b) if bias else (hid, w))]
    (scale * reference(refs[0], refs[1], y, refs[2] if bias else None, label_smoothing=0.1)).backward()
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g.double(), r.grad, **GRAD_TOL[dtype])


@pytest.mark.parametrize("case", ["bfloat16", "frozen", "keep"])
def test_backward_out_of_place_where_the_forwards_gradients_cannot_be_the_results(case):
    """Forward's gradients of another dtype than the operands' (float32 for bfloat16), none made (a frozen
    head recomputes) or the kept dlogits (T <= H): the out-of-place backward."""
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    hid, w, b, y = inputs(40 if case == "keep" else 300, 64 if case == "keep" else 16, 700, dtype)
    hid.requires_grad_(), b.requires_grad_()
    w.requires_grad_(case != "frozen")
    assert _backward_ops(lambda: linear_cross_entropy(hid, w, y, b).backward()) == [
        "opforge::linear_cross_entropy_backward"]
    assert hid.grad.dtype == dtype and (w.grad is None) == (case == "frozen")


def test_inplace_backward_op():
    """linear_cross_entropy_backward_ scales the forward's gradients where they are: the out-of-place
    backward's values (and opcheck's checks of a mutating op); gradients it cannot scale in place are an
    error naming them."""
    hid, w, b, y = inputs(30, 8, 50, torch.float32)
    _, lse, dh, dw, db, _ = LCE(hid, w, y, b, -100, 0.1, 1, 2.0, True)
    args = lambda g, dh, dw, db: (g, hid, w, y, b, lse, dh, dw, db, -100, 0.1, 1, 2.0)  # noqa: E731
    want = LCEB(*args(torch.tensor(0.25), dh, dw, db))
    got = [t.clone() for t in (dh, dw, db)]
    assert LCEB_INPLACE(*args(torch.tensor(0.25), *got)) is None
    assert all(torch.equal(a, c) for a, c in zip(got, want))
    opcheck(LCEB_INPLACE, args(torch.tensor(0.25), *[t.clone() for t in (dh, dw, db)]))
    with pytest.raises(RuntimeError, match=r"\[opforge::linear_cross_entropy_backward_\] arguments 'dhidden', "
                                           r"'dweight' and 'dbias' must be the gradients a forward with compute_grad "
                                           r"made for float32 hidden .*got empty tensors"):
        LCEB_INPLACE(*args(torch.tensor(1.0), torch.empty(0), torch.empty(0), torch.empty(0)))
    hb, wb = hid.bfloat16(), w.bfloat16()
    _, lse_b, dh, dw, db, _ = LCE(hb, wb, y, b.bfloat16(), -100, 0.1, 1, 2.0, True)
    with pytest.raises(RuntimeError, match=r"made for bfloat16 hidden .*got float32"):
        LCEB_INPLACE(torch.tensor(1.0), hb, wb, y, b.bfloat16(), lse_b, dh, dw, db, -100, 0.1, 1, 2.0)


@pytest.mark.parametrize("case", ["float32", "bfloat16", "autocast"])
@pytest.mark.parametrize("frozen", ["none", "weight", "hidden"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tokens_up_to_hidden_keep_dlogits_for_the_backward(case, frozen, reduction, monkeypatch):
    # T <= H, float32 or bfloat16 operands (explicit, or float32 under bfloat16 autocast): the forward keeps
    # dlogits (T x V, no larger than the weight) and makes no gradients; the backward runs its GEMMs (the wanted
    # ones only: a frozen head or hidden gets none, and no gradient) on it, each product times the incoming
    # gradient: 1 (no scaling) and 0.37. Against float64 on the same rounded operands.
    module = sys.modules[linear_cross_entropy.__module__]
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    runs_in = torch.bfloat16 if case == "autocast" else dtype
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if case == "autocast" else contextlib.nullcontext()
    hid, w, b, y = inputs(40, 64, 3000, dtype)
    asked, forward = [], module._linear_cross_entropy
    monkeypatch.setattr(module, "_linear_cross_entropy", lambda *a: asked.append(a[-2:]) or forward(*a))
    for scale in (1.0, 0.37):
        leaves = [hid.detach().clone().requires_grad_(frozen != "hidden"),
                  w.detach().clone().requires_grad_(frozen != "weight"), b.detach().clone().requires_grad_()]
        with amp:
            loss = linear_cross_entropy(*leaves[:2], y, leaves[2], label_smoothing=0.1, reduction=reduction,
                                        softcap=30.0)
        (loss if scale == 1.0 else loss * scale).backward()
        assert asked[-1] == (False, True), asked  # dlogits kept, no gradients made in the forward
        rounded = [x.detach().to(runs_in).double().requires_grad_() for x in (hid, w, b)]
        want = reference(*rounded[:2], y, rounded[2], label_smoothing=0.1, reduction=reduction, softcap=30.0,
                         logits=LOGITS.get(runs_in))
        torch.testing.assert_close(loss.double(), want.detach(), **TOL[torch.float32])
        (want * scale).backward()
        for name, leaf, ref in zip(("hidden", "weight", "bias"), leaves, rounded):
            if not leaf.requires_grad:
                assert leaf.grad is None
                continue
            assert leaf.grad.dtype == dtype
            torch.testing.assert_close(leaf.grad.double(), ref.grad, **GRAD_TOL[runs_in],
                                       msg=lambda m: f"d{name} (gradient {scale}): {m}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_batch_matches_torch(reduction):
    hid, w, b, y = inputs(5, 4, 6, torch.float32)
    y[:] = -100
    hl, wl, bl = (x.detach().clone().requires_grad_() for x in (hid, w, b))
    hr, wr, br = (x.detach().double().requires_grad_() for x in (hid, w, b))
    got = linear_cross_entropy(hl, wl, y, bl, reduction=reduction)
    want = reference(hr, wr, y, br, reduction=reduction)
    torch.testing.assert_close(got.double(), want.detach(), equal_nan=True)  # mean: 0 / 0 = NaN, as torch's
    got.sum().backward()
    want.sum().backward()
    for a, r in ((hl, hr), (wl, wr), (bl, br)):
        torch.testing.assert_close(a.grad.double(), r.grad, equal_nan=True)


def test_opcheck():
    hid, w, b, y = inputs(6, 5, 7, torch.float32)
    hid.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    for reduction in (1, 2):
        for compute_grad, keep in ((False, False), (True, False), (False, True)):
            opcheck(LCE, (hid, w, y, b, -100, 0.1, reduction, 2.0, compute_grad, keep))
    opcheck(LCE, (hid, w, y, None, -100, 0.0, 1, None, True))
    opcheck(LCE, (hid, w, y, None, -100, 0.0, 1, None, False, True))
    opcheck(LCE_NONE, (hid, w, y, b, -100, 0.1, 2.0))
    opcheck(LCE_NONE, (hid, w, y, None, -100, 0.0, None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_opcheck_loss_dtypes(dtype):
    # the loss, the forward's gradients and the incoming gradient are promote(hidden, float32): the fake kernel
    # (meta and shape rules) and the backward's checks agree with the kernel
    hid, w, b, y = (x.requires_grad_() if x.is_floating_point() else x for x in inputs(6, 5, 7, dtype))
    for compute_grad in (False, True):
        out = LCE(hid, w, y, b, -100, 0.1, 1, 2.0, compute_grad)
        assert [o.dtype for o in out] == [LOSS_DTYPE[dtype], torch.float32] + [LOSS_DTYPE[dtype]] * 3 + [dtype]
        assert out[5].shape == (0,)  # no dlogits kept
        opcheck(LCE, (hid, w, y, b, -100, 0.1, 1, 2.0, compute_grad))
    if dtype == torch.bfloat16:  # dlogits kept: of hidden's dtype, (tokens, vocab)
        out = LCE(hid, w, y, b, -100, 0.1, 1, 2.0, False, True)
        assert out[5].dtype == dtype and out[5].shape == (6, 7) and out[2].shape == (0,)
        opcheck(LCE, (hid, w, y, b, -100, 0.1, 1, 2.0, False, True))
    assert LCE_NONE(hid, w, y, b, -100, 0.1, 2.0)[0].dtype == LOSS_DTYPE[dtype]
    opcheck(LCE_NONE, (hid, w, y, b, -100, 0.1, 2.0))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("hidden", [8, 16], ids=["tokens-gt-hidden", "tokens-le-hidden"])  # 16: dlogits kept
def test_compile_fullgraph(dynamic, reduction, hidden):
    torch._dynamo.reset()

    def step(hid, w, y, b):
        return linear_cross_entropy(hid, w, y, b, label_smoothing=0.1, reduction=reduction, softcap=4.0).sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    for t in (9, 13):
        hid, w, b, y = inputs(t, hidden, 11, torch.float32, seed=t)
        leaves = [x.requires_grad_() for x in (hid, w, b)]
        compiled(leaves[0], leaves[1], y, leaves[2]).backward()
        refs = [x.detach().double().requires_grad_() for x in leaves]
        want = reference(refs[0], refs[1], y, refs[2], label_smoothing=0.1, reduction=reduction, softcap=4.0).sum()
        want.backward()
        for a, r in zip(leaves, refs):
            torch.testing.assert_close(a.grad.double(), r.grad, **GRAD_TOL[torch.float32])


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_autocast_runs_the_gemms_in_the_autocast_dtype(amp, reduction):
    # policy lower, as torch's autocast runs F.cross_entropy(F.linear(...)): float32 hidden, weight and bias are
    # cast to amp for the GEMMs, the log-sum-exp and the loss are float32, and the gradients of the float32 leaves
    # come back in float32 through the cast. The loss is that of the amp-rounded operands (and, for bfloat16, the
    # bfloat16 logits eager's F.linear gives too) to float32 rounding,
    # hundreds of times closer to it than to the loss of the float32 operands (what the old float32 policy gave).
    hid, w, b, y = inputs(16, 12, 20, torch.float32)
    leaves = [x.detach().clone().requires_grad_() for x in (hid, w, b)]
    with torch.autocast("cpu", dtype=amp):
        got = linear_cross_entropy(*leaves[:2], y, leaves[2], reduction=reduction)
        want = F.cross_entropy(F.linear(hid, w, b), y, reduction=reduction)
    assert got.dtype == want.dtype == torch.float32
    rounded = [x.detach().to(amp).double().requires_grad_() for x in (hid, w, b)]
    want16 = reference(*rounded[:2], y, rounded[2], reduction=reduction, logits=LOGITS.get(amp))
    want32 = reference(hid.double(), w.double(), y, b.double(), reduction=reduction)
    err16, err32 = (got.double() - want16).abs().max(), (got.double() - want32).abs().max()
    assert err16 <= 1e-5 * (1 + want16.abs().max()) and err16 * 100 < err32, (float(err16), float(err32))
    torch.testing.assert_close(got, want, **TOL[amp])  # torch's: its logits rounded to amp besides
    g = torch.rand(got.shape, dtype=torch.float32) + 0.5
    got.backward(g)
    want16.backward(g.double())
    for name, leaf, ref in zip(("hidden", "weight", "bias"), leaves, rounded):
        assert leaf.grad.dtype == torch.float32
        torch.testing.assert_close(leaf.grad.double(), ref.grad, **GRAD_TOL[amp], msg=lambda m: f"d{name}: {m}")


def test_float16_gradients_made_in_the_forward_do_not_underflow_before_the_scale():
    # one block: the forward makes the gradients of a unit loss gradient, GradScaler's scale comes in the
    # backward. Made in float16 they would underflow (dweight ~2e-6 here, float16's subnormals step by 6e-8: a
    # 1.2% error) where torch's scaled float16 gradients do not: they are float32, and rounded once after the scale.
    hid, w, _, y = inputs(512, 16, 64, torch.float16, ignore=False)
    hid = (hid * 1e-4).requires_grad_()
    w.requires_grad_()
    loss = linear_cross_entropy(hid, w, y)
    assert loss.dtype == torch.float32
    loss.backward(torch.tensor(2.0**16))
    refs = [x.detach().double().requires_grad_() for x in (hid, w)]
    reference(*refs, y).backward(torch.tensor(2.0**16, dtype=torch.float64))
    assert refs[1].grad.abs().max() < 2.0**-14 * 2.0**16  # subnormal in float16 before the scale
    for leaf, ref in zip((hid, w), refs):
        assert leaf.grad.dtype == torch.float16
        torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=4e-3, atol=1e-3 * float(ref.grad.abs().max()))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("hidden", [8, 16], ids=["tokens-gt-hidden", "tokens-le-hidden"])  # 16: dlogits kept
def test_compile_fullgraph_under_autocast(dynamic, reduction, hidden):
    # the fake kernel (the glue on meta tensors for static sizes, the shape rules for symbolic ones) gives the
    # loss and the forward's gradients the dtypes the kernel gives them: float32 from bfloat16 operands
    torch._dynamo.reset()

    def step(hid, w, y, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return linear_cross_entropy(hid, w, y, b, label_smoothing=0.1, reduction=reduction).sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    for t in (9, 13):
        hid, w, b, y = inputs(t, hidden, 11, torch.float32, seed=t)
        leaves = [x.detach().clone().requires_grad_() for x in (hid, w, b)]
        eager = [x.detach().clone().requires_grad_() for x in (hid, w, b)]
        got, want = compiled(*leaves[:2], y, leaves[2]), step(*eager[:2], y, eager[2])
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        got.backward(), want.backward()
        for a, r in zip(leaves, eager):
            assert a.grad.dtype == torch.float32
            torch.testing.assert_close(a.grad, r.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_same_bits_at_1_and_2_threads(dtype, reduction):
    hid, w, b, y = inputs(2100, 16, 2500, dtype)  # several blocks each way
    g = torch.rand(2100) if reduction == "none" else torch.tensor(1.0)  # float32: the loss's dtype
    saved, runs = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            leaves = [x.detach().clone().requires_grad_() for x in (hid, w, b)]
            loss = linear_cross_entropy(leaves[0], leaves[1], y, leaves[2], reduction=reduction)
            loss.backward(g)
            runs.append([loss.detach()] + [x.grad for x in leaves])
    finally:
        torch.set_num_threads(saved)
    for a, b_ in zip(*runs):
        assert torch.equal(a, b_)


def test_every_isa_agrees():
    hid, w, b, y = inputs(37, 30, 123, torch.float32)
    outs = {}
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            outs[isa] = LCE(hid, w, y, b, -100, 0.1, 1, 3.0, True)
    finally:
        opforge.set_isa("auto")
    for isa, res in outs.items():
        for got, want in zip(res, outs["ref"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{isa} vs ref")


def test_nn_module_holds_no_weight():
    head = torch.nn.Linear(12, 30)
    loss_fn = opforge.nn.LinearCrossEntropyLoss(label_smoothing=0.1, softcap=5.0)
    assert list(loss_fn.parameters()) == []
    hid, y = torch.randn(2, 7, 12), torch.randint(0, 30, (2, 7))
    got = loss_fn(hid, head.weight, y, head.bias)
    want = reference(hid.double(), head.weight.double(), y, head.bias.double(), label_smoothing=0.1, softcap=5.0)
    torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
    got.backward()
    assert head.weight.grad is not None and head.bias.grad is not None
    assert "softcap=5.0" in repr(loss_fn)


F32 = dict(dtype=torch.float32)


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: linear_cross_entropy(torch.randn(3, 5), torch.randn(4, 5), torch.tensor([0, 4, 1])),
         r"\[opforge::linear_cross_entropy\] argument 'target' must hold class indices in \[0, 4\) or ignore_index "
         r"\(-100\), got 4 at position 1"),
        (lambda: linear_cross_entropy(torch.randn(3, 5), torch.randn(4, 5), torch.tensor([0, -1, 1]),
                                      reduction="none"),
         r"\[opforge::linear_cross_entropy_none\] argument 'target' .* got -1 at position 1"),
        (lambda: linear_cross_entropy(torch.randn(3, 5), torch.randn(4, 6), torch.zeros(3, dtype=torch.int64)),
         r"\[opforge::linear_cross_entropy\] argument 'weight' must have size\(1\) == hidden.size\(1\) = 5, got 6 "
         r"\(weight: \[4, 6\], hidden: \[3, 5\]\)"),
        (lambda: linear_cross_entropy(torch.randn(3, 5), torch.randn(4, 5), torch.zeros(3, dtype=torch.int64),
                                      torch.randn(3)),
         r"argument 'bias' must have size\(0\) == weight.size\(0\) = 4, got 3 \(bias: \[3\], weight: \[4, 5\]\)"),
        (lambda: linear_cross_entropy(torch.randn(3, 5), torch.randn(4, 5), torch.zeros(3)),
         r"argument 'target' must be int64 \(class indices\), got float32"),
        (lambda: linear_cross_entropy(torch.randn(3, 5), torch.randn(4, 5, dtype=torch.float64),
                                      torch.zeros(3, dtype=torch.int64)),
         r"argument 'weight' must have the dtype of 'hidden' \(float32\), got float64"),
        (lambda: linear_cross_entropy(torch.ones(3, 5, dtype=torch.int64), torch.ones(4, 5, dtype=torch.int64),
                                      torch.zeros(3, dtype=torch.int64)),
         r"argument 'hidden' must be a floating-point tensor"),
        (lambda: linear_cross_entropy(torch.randn(3, 5), torch.randn(4, 5), torch.zeros(3, dtype=torch.int64),
                                      label_smoothing=1.5),
         r"argument 'label_smoothing' must be in \[0, 1\], got 1.5"),
        (lambda: linear_cross_entropy(torch.randn(3, 5), torch.randn(4, 5), torch.zeros(3, dtype=torch.int64),
                                      softcap=0.0),
         r"argument 'softcap' must be a finite number > 0 \(or None\), got 0"),
        (lambda: linear_cross_entropy(torch.randn(3, 5), torch.randn(4, 5), torch.zeros(3, dtype=torch.int64),
                                      reduction="avg"),
         r"argument 'reduction' must be one of 'none', 'mean', 'sum', got 'avg'"),
        (lambda: LCE(torch.randn(3, 5), torch.randn(4, 5), torch.zeros(3, dtype=torch.int64), None, -100, 0.0, 0,
                     None, False),
         r"argument 'reduction' must be 1 \(mean\) or 2 \(sum\)"),
        (lambda: LCE(torch.randn(3, 5, dtype=torch.float16), torch.randn(4, 5, dtype=torch.float16),
                     torch.zeros(3, dtype=torch.int64), None, -100, 0.0, 1, None, False, True),
         r"argument 'keep_dlogits' needs float32 or bfloat16 hidden \(dlogits is of its dtype\), got float16"),
        (lambda: LCE(torch.randn(3, 5), torch.randn(4, 5), torch.zeros(3, dtype=torch.int64), None, -100, 0.0, 1,
                     None, True, True),
         r"arguments 'compute_grad' and 'keep_dlogits' exclude each other"),
        (lambda: torch.ops.opforge.linear_cross_entropy_backward(
            torch.tensor(1.0), torch.randn(3, 5), torch.randn(4, 5), torch.zeros(3, dtype=torch.int64), None,
            torch.zeros(3), torch.empty(0), torch.empty(0), torch.empty(0), -100, 0.0, 1, None, 7, torch.zeros(4, 3)),
         r"\[opforge::linear_cross_entropy_backward\] argument 'dlogits' .*\[4, 3\]"),
        (lambda: torch.ops.opforge.linear_cross_entropy_backward(
            torch.tensor(1.0), torch.randn(3, 5), torch.randn(4, 5), torch.zeros(3, dtype=torch.int64), None,
            torch.zeros(3), torch.empty(0), torch.empty(0), torch.empty(0), -100, 0.0, 1, None, 7, torch.zeros(12)),
         r"argument 'dlogits' must be the \(tokens, vocab\) dlogits the forward kept, or empty, got 1 dims"),
        (lambda: linear_cross_entropy(torch.randn(3, 5), torch.randn(4, 5), torch.zeros(4, dtype=torch.int64)),
         r"argument 'target' must have the leading dims of 'hidden' \[3\], got \[4\]"),
        (lambda: LCE(torch.randn(3, 5), torch.randn(4, 5), torch.zeros(2, dtype=torch.int64), None, -100, 0.0, 1,
                     None, False),
         r"argument 'target' must have size\(0\) == hidden.size\(0\) = 3, got 2 \(target: \[2\], hidden: \[3, 5\]\)"),
        (lambda: LCE(torch.randn(3, 5, 1), torch.randn(4, 5), torch.zeros(3, dtype=torch.int64), None, -100, 0.0, 1,
                     None, False),
         r"argument 'hidden' must have 2 dims \(tokens, hidden\), got 3: \[3, 5, 1\]"),
    ],
)
def test_bad_input(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


def test_errors_come_before_any_work_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(RuntimeError, match=r"argument 'weight' must have size\(1\) == hidden.size\(1\) = 5, got 6"):
        LCE(torch.empty(3, 5), torch.empty(4, 6), torch.zeros(3, dtype=torch.int64), None, -100, 0.0, 1, None, True)


def test_nan_logits_give_nan_as_torch_on_every_isa():
    hid, w, _, y = inputs(6, 5, 40, torch.float32, ignore=False)
    hid[2, 1] = float("nan")
    want = reference(hid.double(), w.double(), y, reduction="none")
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            got = linear_cross_entropy(hid, w, y, reduction="none")
            assert torch.equal(got.isnan(), want.isnan()), isa
            torch.testing.assert_close(got.double(), want, **TOL[torch.float32], equal_nan=True)
    finally:
        opforge.set_isa("auto")


def test_an_ignore_index_inside_the_vocab():
    # ignore_index is any int: a class index ignored is left out of the loss, the mean's count and the grads
    check_against_reference(torch.float32, 20, 8, 9, "mean", False, 0.1, True, None)
    hid, w, b, y = inputs(20, 8, 9, torch.float64, ignore=False)
    w.requires_grad_()
    got = linear_cross_entropy(hid, w, y, b, ignore_index=3, label_smoothing=0.1)
    wr = w.detach().clone().requires_grad_()
    want = reference(hid, wr, y, b, ignore_index=3, label_smoothing=0.1)
    torch.testing.assert_close(got, want, **TOL[torch.float64])
    got.backward(), want.backward()
    torch.testing.assert_close(w.grad, wr.grad, **GRAD_TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_a_minus_inf_logit_gives_torchs_loss_on_every_isa(dtype, reduction, label_smoothing):
    # a vocabulary entry masked by a -inf bias: without label smoothing the loss is finite (torch: 11.2060 for
    # the mean here), not 0 x -inf = NaN from the smoothing term; with it, the smoothing term is +inf, as
    # torch's. The gradients stay finite either way.
    g = torch.Generator().manual_seed(0)
    hid, w = torch.randn(6, 16, generator=g).to(dtype), torch.randn(40, 16, generator=g).to(dtype)
    y, b = torch.tensor([0, 1, 2, 3, 4, 0]), torch.zeros(40, dtype=dtype)
    b[7] = float("-inf")
    refs = [x.double().requires_grad_() for x in (hid, w, b)]
    want = reference(*refs[:2], y, refs[2], label_smoothing=label_smoothing, reduction=reduction)
    want.sum().backward()
    assert want.isinf().all() if label_smoothing else want.isfinite().all()
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            leaves = [x.detach().clone().requires_grad_() for x in (hid, w, b)]
            got = linear_cross_entropy(*leaves[:2], y, leaves[2], label_smoothing=label_smoothing, reduction=reduction)
            torch.testing.assert_close(got.double(), want.detach(), **TOL[dtype], msg=lambda m: f"{isa} loss: {m}")
            got.sum().backward()
            for name, leaf, ref in zip(("hidden", "weight", "bias"), leaves, refs):
                torch.testing.assert_close(leaf.grad.double(), ref.grad, **GRAD_TOL[dtype],
                                           msg=lambda m: f"{isa} d{name}: {m}")
    finally:
        opforge.set_isa("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["no-cap", "cap"])
def test_one_class_gives_a_loss_of_exactly_zero_on_every_isa(dtype, label_smoothing, softcap):
    # V = 1: every log-probability is log 1 = 0, so torch's loss is exactly (-)0 with or without smoothing;
    # lse - (1 - eps) z_y - eps z was a cancellation that left -1.4e-16 (float64) or a few ulps of z, and with
    # a softcap the AVX-512 lse was made of tanh16's z, the target's of tanhf's: +-1.2e-7
    hid, w, _, y = inputs(7, 5, 1, dtype, ignore=False)
    hid = hid * 3  # logits beyond the softcap's linear range
    want = reference(hid.double(), w.double(), y, label_smoothing=label_smoothing, reduction="none", softcap=softcap)
    assert (want == 0).all()
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            got = linear_cross_entropy(hid, w, y, label_smoothing=label_smoothing, reduction="none", softcap=softcap)
            assert (got == 0).all(), f"{isa}: {got.tolist()}"
    finally:
        opforge.set_isa("auto")


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["no-cap", "cap"])
def test_a_nan_hidden_row_gives_nan_gradients_as_torch_on_every_isa(reduction, softcap):
    # a NaN in hidden row 1 makes all of that row's logits NaN: torch's dhidden row 1 and all of dweight are
    # NaN (every weight row meets the NaN row's du); the other dhidden rows and every finite value as torch's
    g = torch.Generator().manual_seed(0)
    hid, w = torch.randn(6, 16, generator=g), torch.randn(40, 16, generator=g)
    y, b = torch.tensor([0, 1, 2, 3, 4, 0]), torch.randn(40, generator=g)
    hid[1, 3] = float("nan")
    refs = [x.double().requires_grad_() for x in (hid, w, b)]
    reference(*refs[:2], y, refs[2], reduction=reduction, softcap=softcap).sum().backward()
    assert refs[0].grad[1].isnan().all() and refs[1].grad.isnan().all() and refs[0].grad[0].isfinite().all()
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            leaves = [x.detach().clone().requires_grad_() for x in (hid, w, b)]
            linear_cross_entropy(*leaves[:2], y, leaves[2], reduction=reduction, softcap=softcap).sum().backward()
            for name, leaf, ref in zip(("hidden", "weight", "bias"), leaves, refs):
                assert torch.equal(leaf.grad.isnan(), ref.grad.isnan()), \
                    f"{isa} d{name}: {int(leaf.grad.isnan().sum())} NaN, torch {int(ref.grad.isnan().sum())}"
                torch.testing.assert_close(leaf.grad.double(), ref.grad, **GRAD_TOL[torch.float32], equal_nan=True,
                                           msg=lambda m: f"{isa} d{name}: {m}")
    finally:
        opforge.set_isa("auto")


def test_log_names_the_row_code_that_ran():
    # float64 runs the float64 reference whatever the ISA: the log named the ISA's row code (and GEMM) for it
    code = ("import torch, opforge\n"
            "from opforge.functional import linear_cross_entropy\n"
            "h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))\n"
            "for isa in opforge.supported_isas():\n"
            "    opforge.set_isa(isa)\n"
            "    for dt in (torch.float32, torch.float64):\n"
            "        linear_cross_entropy(h.to(dt), w.to(dt), y)\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, OPFORGE_LOG_LEVEL="info"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "::linear_cross_entropy " in line]
    want = []
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            name = next(n for n, _, now in opforge.kernel_variants()["linear_cross_entropy"] if now)
            want += [f"kernels=linear_cross_entropy:{name},gemm:", "isa=ref kernels=linear_cross_entropy:ref_f64 "]
    finally:
        opforge.set_isa("auto")
    assert len(lines) == len(want), r.stderr
    wrong = [f"want {w!r} in {line}" for w, line in zip(want, lines) if w not in line]
    assert not wrong, "\n".join(wrong)


# ---- what the generic tests run of linear_cross_entropy (tests/python/discover.py) -------------------------

# fuzz.py: random tokens and vocabularies near the logits blocks, hidden sizes, reductions, ignored targets,
# smoothing, softcap, layouts, dtypes, ISAs and threads, against float64 torch

LCE_MARKS = (1, 7, 16, 64, 2047, 2048, 2049, 4097)  # 2048 x 2048 logits blocks


def _fuzz_draw(rng, c):
    c["t"] = fuzz.dim(rng, 4200, LCE_MARKS, zero=0.03)
    c["h"] = rng.choice((1, 7, 16, 64, rng.randint(1, 300)))
    c["v"] = fuzz.dim(rng, 4200, LCE_MARKS, zero=0.0)
    c["reduction"] = rng.choice(("mean", "sum", "none"))
    c["bias"] = rng.random() < 0.5
    c["ignore"] = rng.choice((0.0, 0.0, 0.3, 1.0))  # share of ignored targets
    c["label_smoothing"] = rng.choice((0.0, 0.0, 0.1, 1.0))
    c["softcap"] = rng.choice((None, None, 30.0, 2.0))
    c["grad"] = rng.random() < 0.7
    c["h_layout"] = fuzz.layout(rng, [c["t"], c["h"]], expand=False)
    c["w_layout"] = fuzz.layout(rng, [c["v"], c["h"]], expand=False)
    flops = 2.0 * c["t"] * c["h"] * c["v"]
    return fuzz.seconds(c, flops * (4 if c["grad"] else 1), flops * (3 if c["grad"] else 1), 30 * c["t"] * c["v"])


def _fuzz_describe(c):
    return (f"T={c['t']} H={c['h']} V={c['v']} hidden{fuzz.layout_str(c['h_layout'])} "
            f"weight{fuzz.layout_str(c['w_layout'])} reduction={c['reduction']} bias={c['bias']} "
            f"ignore={c['ignore']} label_smoothing={c['label_smoothing']} softcap={c['softcap']} grad={c['grad']}")


def _fuzz_check(c, gen, dtype, dt, call):
    """Bounds, as for linear and cross_entropy: the logits u = hidden weight^T + bias are off by a sum's
    error eu, z (capped) by ez; the float32 lse by the weights' sum_v p_v ez_v and the exp's and sums'
    roundings; each du = s (p - eps / V - (1 - eps) [v = y]) (1 - (z / c)^2) by p's relative error, the
    few float32 operations, and its rounding where the variant rounds it (FUZZ's rounded); the gradients are
    sums of du times 16-bit operands, rounded once (or twice: its "grads")."""
    t, h, v = c["t"], c["h"], c["v"]
    specs = [([t, h], dtype, c["h_layout"], "randn", 1.0),
             ([v, h], dtype, c["w_layout"], "randn", 2 / max(h, 1) ** 0.5)]
    if c["bias"]:
        specs.append(([v], dtype, None, "randn", 1.0))
    inputs = fuzz.inputs(gen, specs)
    for base, _ in inputs:
        base.requires_grad_(c["grad"])
    hid, w, b = [view(base) for base, view in inputs] + [None] * (3 - len(inputs))
    y = torch.randint(0, max(v, 1), (t,), generator=gen)
    y[torch.rand(t, generator=gen) < c["ignore"]] = -100
    kw = dict(ignore_index=-100, label_smoothing=c["label_smoothing"], reduction=c["reduction"], softcap=c["softcap"])
    g = fuzz.random_tensor(gen, [t] if c["reduction"] == "none" else [], LOSS_DTYPE[dtype])
    leaves = [x for x in (hid, w, b) if x is not None]

    def forward_backward():
        loss = opforge.functional.linear_cross_entropy(hid, w, y, b, **kw)
        return loss, (torch.autograd.grad(loss, leaves, g) if c["grad"] else ())

    if c["grad"]:
        loss, grads = call(forward_backward)
    else:
        with torch.no_grad():
            loss, grads = call(forward_backward)
    refs = [x.detach().double().requires_grad_() for x in leaves]
    z = F.linear(refs[0], refs[1], refs[2] if b is not None else None)
    cap, eps, red = c["softcap"], c["label_smoothing"], c["reduction"]
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    want = F.cross_entropy(z, y, **{k: kw[k] for k in ("ignore_index", "label_smoothing", "reduction")})

    u = fuzz.U_ACC[dt]
    h64, w64 = refs[0].detach(), refs[1].detach()
    b64 = refs[2].detach() if b is not None else torch.zeros(v, dtype=torch.float64)
    logits = h64 @ w64.T + b64
    eu = fuzz.sum_err(u, h + 1, h64.abs() @ w64.abs().T + b64.abs(), logits)
    eu = eu + fuzz.rounding_err(c, "logits", logits.abs() + eu)  # the float32 sum, rounded where it is
    z = z.detach()
    dcap = 1 - (z / cap) ** 2 if cap is not None else torch.ones_like(z)
    ez = eu * dcap + (fuzz.C_FN * u * z.abs() if cap is not None else 0.0)  # tanhf, and the scaling around it
    keep = y != -100  # (V >= 1: _draw_lce)
    lse = torch.logsumexp(z, -1, keepdim=True)
    p = (z - lse).exp()
    dist = (z - z.amax(-1, keepdim=True)).abs()  # the exp's argument, rounded relative to it
    # the float32 lse (an online max and sum over the vocab blocks, log, the add), as lse_update computes it
    e_lse = (p * (ez + u * dist)).sum(-1, keepdim=True) + u * (fuzz.C_FN + fuzz.c_sum(v) + 0.5 * v) \
        + u * (fuzz.C_FN + 1) * lse.abs()
    yc = y.clamp_min(0)[:, None]
    # loss_t = lse - (1 - eps) z_y - eps / V sum_v z_v, in double from float32 lse, z_y and sum z
    e_loss = e_lse[:, 0] + (1 - eps) * ez.gather(1, yc)[:, 0]
    if eps:
        e_loss = e_loss + eps / v * (ez.sum(-1) + fuzz.sum_err(u, v, z.abs().sum(-1), z.sum(-1)))
    e_loss = torch.where(keep, e_loss, torch.zeros_like(e_loss))
    count = int(keep.sum())
    lb = e_loss if red == "none" else e_loss.sum() / (count if red == "mean" and count else 1)
    ldt = LOSS_DTYPE[dtype]  # the loss is float32 for 16-bit operands: rounded once to it
    checks = [fuzz.Check("loss", loss, want.detach(), lb + fuzz.out_tol(want.detach(), str(ldt).removeprefix("torch.")),
                         ldt)]
    if not c["grad"]:
        return checks
    gwant = torch.autograd.grad(want, refs, g.double())
    # s_t: the gradient of token t's loss (0 where ignored); du as the kernels make it (grad_rows)
    base = 1.0 / count if red == "mean" and count else 1.0
    s_t = torch.where(keep, base * g.double().expand(t), torch.zeros(t, dtype=torch.float64))[:, None]
    onehot = torch.zeros_like(z).scatter_(1, yc, 1.0) * keep[:, None]
    graw = s_t * (p - eps / v - (1 - eps) * onehot)
    du = graw * dcap
    e_p = p * (ez + e_lse + u * (fuzz.C_FN + (z - lse).abs()))
    e_graw = s_t.abs() * (e_p + 2 * u * (p + eps / v + (1 - eps) * onehot))
    e_du = e_graw * dcap.abs()
    if cap is not None:  # 1 - (z / c)^2 from the float32 z: z's error, and the few roundings of its own
        e_du = e_du + graw.abs() * (2 * z.abs() * ez / cap**2 + 4 * u * (1 + 2 * (z / cap) ** 2))
    e_du16 = e_du + fuzz.rounding_err(c, "du", du)  # the operand of the dhidden and dweight products, and dbias's
    dh, dw, db = du @ w64, du.T @ h64, du.sum(0)
    bounds = {
        "dhidden": e_du16 @ w64.abs() + fuzz.sum_err(u, v, du.abs() @ w64.abs(), dh),
        "dweight": e_du16.T @ h64.abs() + fuzz.sum_err(u, t, du.abs().T @ h64.abs(), dw),
        "dbias": e_du16.sum(0) + fuzz.sum_err(u, t, du.abs().sum(0), db),
    }
    # reduction mean or sum over blocks that span the vocabulary (vocab_in_one_block): the forward makes the
    # gradients of a unit g in the loss's
    # dtype (float32), the backward scales them by g and rounds them once to the dtype (out_tol's)
    for name, got, ref in zip(("dhidden", "dweight", "dbias"), grads, gwant):
        checks.append(fuzz.Check(name, got, ref, bounds[name] + fuzz.out_tol(ref, dt), dtype))
    return checks


FUZZ = {
    "linear_cross_entropy": fuzz.Op(
        _fuzz_draw, _fuzz_check, _fuzz_describe, weight=0.1, order=10, family="gemm",
        covers=("linear_cross_entropy", "linear_cross_entropy_none"), rounded={
            # linear_cross_entropy.c run_f32: logits, lse and du in float32, gradients summed in float32 and
            # rounded once (with reduction mean or sum over blocks that span the vocabulary the forward makes them in
            # float32, and the backward scales them by the incoming gradient and rounds them)
            ("*", "*"): (),
            # ... but bfloat16 operands' logits block is bfloat16 (the GEMM's float32 sums rounded once, as
            # eager's logits), and du is rounded over it for both gradient products and dbias, whatever the GEMM
            ("*", "bfloat16"): ("logits", "du"),
        }),
}


# test_export.py: the ops' parts of the exported model (targets clamped: one out of range is
# cross_entropy's to refuse)


def _export(reduction):
    def make(g, hidden, vocab, max_len):
        def run(x, target, head):
            safe = target.reshape(-1).clamp(0, vocab - 1)
            return (linear_cross_entropy(x.reshape(-1, hidden), head, safe, reduction=reduction),)

        return {"head": torch.randn(vocab, hidden, generator=g) / hidden**0.5}, run

    return make


EXPORT = {"linear_cross_entropy": _export("mean"), "linear_cross_entropy_none": _export("none")}


# test_training.py: autocast, checkpointing and determinism

TRAINING = {
    "linear_cross_entropy": training.Case(
        ("linear_cross_entropy",),
        # big: 2100 tokens x vocabulary 16400, blocks that cannot span it (vocab_in_one_block: 256 x 16400 is past
        # the budget): 2 token chunks x 9 vocab blocks, which the backward recomputes
        lambda dt, big: [training.randn(2100 if big else 37, 16, dtype=dt),
                         0.3 * training.randn(16400 if big else 50, 16, dtype=dt),
                         training.target(2100 if big else 37, 16400 if big else 50),
                         0.1 * training.randn(16400 if big else 50, dtype=dt)],
        (0, 1, 3),
        linear_cross_entropy,
        lambda h, w, t, b: F.cross_entropy(F.linear(h, w, b), t),
        autocast="lower"),
    "linear_cross_entropy_one_block": training.Case(
        ("linear_cross_entropy",),
        # blocks that span the vocabulary (big: chunks of 3813 and 187 tokens by 1100): the forward makes the
        # gradients a chunk at a time, the backward scales them
        lambda dt, big: [training.randn(4000 if big else 37, 24, dtype=dt),
                         0.3 * training.randn(1100 if big else 50, 24, dtype=dt),
                         training.target(4000 if big else 37, 1100 if big else 50)],
        (0, 1),
        linear_cross_entropy,
        lambda h, w, t: F.cross_entropy(F.linear(h, w), t),
        autocast="lower"),
    "linear_cross_entropy_none": training.Case(
        ("linear_cross_entropy_none",),
        lambda dt, big: [training.randn(700 if big else 37, 24, dtype=dt),
                         0.3 * training.randn(1100 if big else 50, 24, dtype=dt),
                         training.target(700 if big else 37, 1100 if big else 50)],
        (0, 1),
        lambda h, w, t: linear_cross_entropy(h, w, t, reduction="none"),
        lambda h, w, t: F.cross_entropy(F.linear(h, w), t, reduction="none"),
        autocast="lower"),
}


# test_thread_sweep.py: empty and tiny shapes at 1-64 threads; GEMMs with T, H and V each 0 and 1


REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _sweep_cases():
    cases = []
    # (T lead dims, H, V); V = 0 only with every target ignored
    shapes = [((0,), 4, 5), ((3,), 0, 5), ((3,), 4, 0), ((1,), 4, 5), ((3,), 1, 5), ((3,), 4, 1), ((1,), 1, 1),
              ((0,), 0, 0), ((7,), 9, 11), ((2, 0), 3, 4), ((2, 3), 5, 7), ((64,), 32, 300), ((40,), 64, 300)]
    variants = [("mean", False, 0.0, None, True), ("sum", True, 0.1, 2.0, True), ("none", True, 0.0, None, True),
                ("mean", True, 0.2, 4.0, False)]  # last: the op asked for no gradients in the forward
    for lead, h, v in shapes:
        for red, bias, ls, cap, cg in variants:
            ls = ls if v else 0.0  # no class: torch's smoothing term is 0 * (eps / 0) = NaN, opforge's 0
            def make(dt, lead=lead, h=h, v=v, bias=bias):
                return (thread_sweep.grid((*lead, h), 1).to(dt), thread_sweep.grid((v, h), 2).to(dt),
                        thread_sweep.targets(lead, v, 3, True), thread_sweep.grid((v,), 4).to(dt) if bias else None)

            def fn(x, w, t, b, red=red, ls=ls, cap=cap, cg=cg):
                if cg:
                    return (opforge.linear_cross_entropy(x, w, t, b, label_smoothing=ls, reduction=red, softcap=cap),)
                # the op itself, with compute_grad off: the backward recomputes the blocks from lse
                return (opforge.ops.linear_cross_entropy(x.reshape(t.numel(), x.shape[-1]), w, t.reshape(-1), b, -100, ls,
                                                         REDUCTIONS[red], cap, False)[0],)

            def ref(x, w, t, b, red=red, ls=ls, cap=cap, dtype=None):
                loss = refs._lce_loss(x.reshape(t.numel(), x.shape[-1]), w, t.reshape(-1), b, -100, ls,
                                      REDUCTIONS[red], cap, logits=LOGITS.get(dtype))
                return (loss.reshape(t.shape) if red == "none" else loss,)

            cases.append(thread_sweep.Case(f"linear_cross_entropy hidden={(*lead, h)} V={v} {red} bias={bias} "
                                           f"smoothing={ls} softcap={cap} compute_grad={cg}", make, fn, ref,
                                           grads=(0, 1, 3) if bias else (0, 1), out_dtype=LOSS_DTYPE.get,
                                           ref_takes_dtype=True))
    return cases


SWEEP = dict.fromkeys(("linear_cross_entropy", "linear_cross_entropy_none"), _sweep_cases)
