"""attention against torch.nn.functional.scaled_dot_product_attention: values per
dtype, causal with unequal lengths, grouped-query heads, masks, fully masked
rows, strides, gradients, gradcheck, float64 to the last bits, empty shapes,
opcheck, a backward bitwise the same on any thread count, few query blocks (the
forward's keys split into chunks) against float64 and bitwise the same on 1 and 2
threads, a few queries (N <= 4, the flash-decoding driver) with every mask kind, gradients and
opcheck, no leak on failing calls, torch.compile, autocast, nn.MultiheadAttention, bad input."""

import ctypes
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fuzz
import opforge
import thread_sweep
import training

ATTN = torch.ops.opforge.attention.default


def SDPA(q, k, v, **kw):
    """F.scaled_dot_product_attention, except with no key/value heads: torch before 2.13 computes
    H % Hkv in its backend check and dies of SIGFPE on Hkv = 0 with enable_gqa (torch 2.11, any
    thread count). No key heads means no query heads (the op checks H % Hkv): the empty products
    give the same empty output and gradients."""
    if kw.get("enable_gqa") and k.size(-3) == 0 and q.size(-3) == 0:
        return q @ k.transpose(-1, -2) @ v
    return F.scaled_dot_product_attention(q, k, v, **kw)

# float32: online softmax with a ~1-2 ulp vector exp, sums of up to S products.
# 16-bit types compute in float32 from the rounded inputs and round once.
TOL = {
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}
GTOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.float64: dict(rtol=1e-9, atol=1e-9),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
    torch.float16: dict(rtol=4e-3, atol=4e-3),
}


def qkv(b=2, h=4, hkv=None, n=33, s=47, d=16, dv=None, dtype=torch.float32, grad=False):
    hkv, dv = hkv or h, dv or d
    ts = torch.randn(b, h, n, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, dv)
    return tuple(t.to(dtype).requires_grad_(grad) for t in ts)


def reference(q, k, v, mask=None, causal=False, scale=None):
    """SDPA in float64 on the same (rounded) inputs, K/V heads repeated for GQA."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    if mask is not None and mask.dim() == 1:  # torch's SDPA wants >= 2 dims; opforge broadcasts any
        mask = mask.expand(q.shape[-2], -1)
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        if mask is None:
            mask = keep
        elif mask.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = mask.masked_fill(~keep, float("-inf"))
    return SDPA(q.double(), k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, s", [(1, 1), (7, 7), (33, 47), (70, 20), (129, 129)], ids=str)
def test_values(n, s, causal, dtype):
    q, k, v = qkv(n=n, s=s, dtype=dtype)
    out = opforge.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert out.shape == (2, 4, n, 16) and out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, causal=causal), **TOL[dtype])


@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_sdpa_float32(causal):
    q, k, v = qkv(n=100, s=100, d=64)
    torch.testing.assert_close(opforge.scaled_dot_product_attention(q, k, v, is_causal=causal),
                               SDPA(q, k, v, is_causal=causal), **TOL[torch.float32])


@pytest.mark.parametrize("d, dv", [(40, 40), (80, 80), (128, 128), (256, 256), (32, 48)], ids=str)
def test_head_dims(d, dv):
    q, k, v = qkv(b=1, h=2, n=45, s=66, d=d, dv=dv)
    out = opforge.scaled_dot_product_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(out.double(), reference(q, k, v, scale=0.3), **TOL[torch.float32])


@pytest.mark.parametrize("hkv", [1, 2])
def test_grouped_query_heads(hkv):
    q, k, v = qkv(h=6, hkv=hkv, n=40, s=52)
    out = opforge.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, SDPA(q, k, v, is_causal=True, enable_gqa=True), **TOL[torch.float32])


MASKS = {
    "bool-2d": lambda b, h, n, s: torch.rand(n, s) > 0.3,
    "bool-4d-broadcast-heads": lambda b, h, n, s: torch.rand(b, 1, n, s) > 0.3,
    "bool-key-padding": lambda b, h, n, s: torch.rand(b, 1, 1, s) > 0.2,
    "float-4d": lambda b, h, n, s: torch.randn(b, h, n, s),
    "float-1d": lambda b, h, n, s: torch.randn(s),
    "float-with-inf": lambda b, h, n, s: torch.randn(n, s).masked_fill(torch.rand(n, s) > 0.7, float("-inf")),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(MASKS))
def test_masks(kind, dtype):
    q, k, v = qkv(n=30, s=41, dtype=dtype)
    mask = MASKS[kind](2, 4, 30, 41)
    mask = mask if mask.dtype == torch.bool else mask.to(dtype)
    out = opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask), **TOL[dtype])
    if dtype == torch.float32 and mask.dim() >= 2:
        torch.testing.assert_close(out, SDPA(q, k, v, attn_mask=mask), **TOL[dtype])


def test_mask_and_causal_combine():
    q, k, v = qkv(n=20, s=20)
    mask = torch.rand(20, 20) > 0.3
    mask.fill_diagonal_(True)
    out = opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, causal=True), **TOL[torch.float32])


def test_fully_masked_rows_give_zeros_and_zero_gradients_as_torch():
    q, k, v = qkv(n=6, s=9, grad=True)
    mask = torch.ones(6, 9, dtype=torch.bool)
    mask[2] = False
    out = opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = SDPA(q, k, v, attn_mask=mask)
    assert torch.all(out[:, :, 2] == 0)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    assert torch.all(got[0][:, :, 2] == 0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **GTOL[torch.float32])


@pytest.fixture
def own_kernels():
    """opforge's kernels for the test (a plain call is F.scaled_dot_product_attention's under OPFORGE_GEMM=torch)"""
    saved = opforge.get_gemm()
    opforge.set_gemm("own")
    yield
    opforge.set_gemm(saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nan_propagates_as_torch(dtype, own_kernels):
    # against torch's math (softmax of the scores): its fused CPU kernel gives NaN rows on AVX2
    # CPUs but zeros on AVX-512 ones (so opforge's kernels here: the provider's mode torch would hand
    # this plain call to F.scaled_dot_product_attention)
    q, k, v = qkv(n=6, s=9, dtype=dtype, grad=True)
    with torch.no_grad():
        q[0, 1, 2, 3] = float("nan")
    out = opforge.scaled_dot_product_attention(q, k, v)
    ref = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v
    assert torch.equal(out.isnan(), ref.isnan()) and out[0, 1, 2].isnan().all()
    g = torch.randn_like(out)
    got, want = torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan())


def test_transposed_and_strided_inputs_are_read_in_place():
    b, n, h, d = 2, 37, 4, 16
    qkv_proj = torch.randn(b, n, 3, h, d)  # a fused QKV projection's output
    q, k, v = (qkv_proj[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    with torch.profiler.profile() as prof:
        out = opforge.scaled_dot_product_attention(q, k, v)
    names = {e.name for e in prof.events()}
    assert not names & {"aten::copy_", "aten::clone", "aten::contiguous"}, names
    torch.testing.assert_close(out, SDPA(q.contiguous(), k.contiguous(), v.contiguous()), **TOL[torch.float32])
    # the output is (B, N, H, D) in memory: merging the heads back is a view
    merged = out.transpose(1, 2).reshape(b, n, h * d)
    assert merged.data_ptr() == out.data_ptr()
    sliced = torch.randn(2, 4, 50, 32)[:, :, ::2, ::2]  # element stride 2
    torch.testing.assert_close(opforge.scaled_dot_product_attention(sliced, sliced, sliced),
                               SDPA(sliced, sliced, sliced), **TOL[torch.float32])


def test_three_dim_inputs():
    q, k, v = (t[:, 0] for t in qkv(n=12, s=15))
    mask = torch.rand(2, 12, 15) > 0.2
    torch.testing.assert_close(opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               SDPA(q, k, v, attn_mask=mask), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["plain", "causal", "gqa-causal", "mask", "long-causal"])
def test_gradients(case, dtype):
    kw = dict(n=150, s=150, d=32) if case == "long-causal" else dict(n=23, s=31)
    if case == "gqa-causal":
        kw["hkv"] = 2
    q, k, v = qkv(dtype=dtype, grad=True, **kw)
    causal = "causal" in case
    mask = (torch.rand(23, 31) > 0.3) if case == "mask" else None
    out = opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(reference(*leaves, mask, causal=causal), leaves, g.double())
    for name, a, b in zip("qkv", got, want):
        assert a.dtype == dtype and a.shape == b.shape
        torch.testing.assert_close(a.double(), b, **GTOL[dtype], msg=f"d{name}")


@pytest.mark.parametrize("case", ["plain", "causal-gqa", "mask"])
def test_gradcheck_float64(case):
    q, k, v = qkv(b=1, h=2, hkv=1 if case == "causal-gqa" else 2, n=5, s=7, d=4, dtype=torch.float64, grad=True)
    mask = torch.randn(5, 7, dtype=torch.float64) if case == "mask" else None

    def fn(q, k, v):
        return opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=case.startswith("causal"))

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("d", [3, 5, 7, 80])
def test_float64_matches_sdpa_to_the_last_bits(d, scale, causal):
    # 1/sqrt(d) and 0.3 are not float32 numbers: a scale rounded to float32 costs ~1e-8
    q, k, v = qkv(b=2, h=2, n=19, s=23, d=d, dtype=torch.float64, grad=True)
    out = opforge.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    want = SDPA(q, k, v, is_causal=causal, scale=scale)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"d{name}")


# (B, H, Hkv, N, S): no batch, no head, no query, no key; a batch of one and of two
EMPTY = [(0, 2, 2, 5, 7), (2, 0, 0, 5, 7), (2, 0, 2, 5, 7), (1, 2, 1, 0, 7), (2, 3, 3, 0, 7), (2, 2, 2, 5, 0),
         (2, 4, 2, 0, 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", EMPTY, ids=str)
def test_empty_shapes_as_torch(shape, dtype):
    b, h, hkv, n, s = shape
    q, k, v = (torch.randn(b, x, m, 8).to(dtype).requires_grad_() for x, m in ((h, n), (hkv, s), (hkv, s)))
    mask = torch.rand(n, s) > 0.5
    for kw in (dict(), dict(is_causal=True), dict(attn_mask=mask)):
        out = opforge.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        want = SDPA(q, k, v, enable_gqa=True, **kw)  # S = 0: zeros, and zero gradients
        assert out.shape == want.shape and out.dtype == dtype
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        g = torch.randn_like(out)
        for name, a, w in zip("qkv", torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
            assert a.shape == w.shape, f"d{name}"
            torch.testing.assert_close(a, w, rtol=0, atol=0, msg=f"d{name}")
    opcheck(ATTN, (q, k, v, mask, True, 0.3))


def _backward(q, k, v, g, causal):
    return torch.autograd.grad(opforge.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), g)


@pytest.mark.parametrize(
    "b, h, hkv, n, causal, dtype",
    [(1, 1, 1, 1000, False, torch.float32), (1, 1, 1, 700, True, torch.float32), (3, 4, 1, 300, True, torch.float32),
     (1, 2, 2, 500, False, torch.bfloat16)],
    ids=["one-head", "one-head-causal", "3-groups-causal", "bf16"],
)
def test_backward_bitwise_the_same_run_to_run_and_on_any_thread_count(b, h, hkv, n, causal, dtype):
    # fewer head groups than twice the threads: tasks are key blocks whose dQ parts
    # meet in one tensor; the order they are added in must not depend on timing
    q, k, v = qkv(b=b, h=h, hkv=hkv, n=n, s=n, d=64, dtype=dtype, grad=True)
    g = torch.randn(b, h, n, 64).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = _backward(q, k, v, g, causal)
        for run in range(20):
            for name, a, w in zip("qkv", _backward(q, k, v, g, causal), first):
                assert torch.equal(a, w), f"d{name} of run {run + 2} differs from run 1 on 2 threads"
        torch.set_num_threads(1)
        for name, a, w in zip("qkv", _backward(q, k, v, g, causal), first):
            assert torch.equal(a, w), f"d{name} differs between 1 and 2 threads"
    finally:
        torch.set_num_threads(threads)


def test_runs_under_deterministic_algorithms():
    q, k, v = qkv(b=1, h=1, n=300, s=300, grad=True)
    torch.use_deterministic_algorithms(True)
    try:
        g = torch.randn(1, 1, 300, 16)
        first = _backward(q, k, v, g, True)
        assert all(torch.equal(a, w) for a, w in zip(_backward(q, k, v, g, True), first))
    finally:
        torch.use_deterministic_algorithms(False)


# One query block of up to 64 queries of one head, fewer tasks than the forward's minimum:
# its keys are cut into chunks of whole 64-key blocks, merged in chunk order. Causal
# (a lone block sees at most 64 keys) and several heads are not split: the same checks.
SPLIT = [(1, 1000), (7, 300), (64, 129), (33, 65), (64, 64), (7, 1), (65, 200), (200, 1000)]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, s", SPLIT, ids=str)
def test_few_query_blocks_values(n, s, causal, dtype):
    q, k, v = qkv(b=1, h=1, n=n, s=s, d=40, dtype=dtype)
    out = opforge.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert out.shape == (1, 1, n, 40) and out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, causal=causal), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_query_blocks_grouped_heads_and_odd_dims(dtype):
    q, k, v = qkv(b=1, h=2, hkv=1, n=7, s=700, d=33, dv=17, dtype=dtype)
    out = opforge.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out.double(), reference(q, k, v), **TOL[dtype])
    q, k, v = (t[:, :1] for t in (q, k, v))  # one head: split
    out = opforge.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out.double(), reference(q, k, v), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["bool-2d", "float-with-inf", "bool-key-padding"])
def test_few_query_blocks_masks(kind, dtype):
    q, k, v = qkv(b=1, h=1, n=50, s=300, d=24, dtype=dtype)
    mask = MASKS[kind](1, 1, 50, 300)
    mask = mask if mask.dtype == torch.bool else mask.to(dtype)
    out = opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask), **TOL[dtype])


def test_few_query_blocks_row_masked_in_some_chunks_only():
    # row 0 sees only the last key (the last chunk), row 1 none: zeros, as torch gives
    q, k, v = qkv(b=1, h=1, n=3, s=700, d=16, grad=True)
    mask = torch.rand(3, 700) > 0.5
    mask[0] = False
    mask[0, -1] = True
    mask[1] = False
    out = opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.all(out[:, :, 1] == 0)
    torch.testing.assert_close(out, SDPA(q, k, v, attn_mask=mask), **TOL[torch.float32])
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, -1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_few_query_blocks_gradients(causal, dtype):
    q, k, v = qkv(b=1, h=1, n=64, s=400, d=32, dtype=dtype, grad=True)
    out = opforge.scaled_dot_product_attention(q, k, v, is_causal=causal)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(reference(*leaves, causal=causal), leaves, g.double())
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a.double(), b, **GTOL[dtype], msg=f"d{name}")


def test_few_query_blocks_gradcheck_float64():
    q, k, v = qkv(b=1, h=1, n=3, s=130, d=4, dtype=torch.float64, grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: opforge.scaled_dot_product_attention(q, k, v), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, s, causal", [(64, 1000, False), (1, 300, False), (40, 700, True)], ids=str)
def test_few_query_blocks_bitwise_the_same_on_any_thread_count(n, s, causal, dtype):
    q, k, v = qkv(b=1, h=1, n=n, s=s, d=64, dtype=dtype, grad=True)
    g = torch.randn(1, 1, n, 64).to(dtype)

    def run():
        out, lse = ATTN(q, k, v, None, causal, None)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), g))

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = run()
        for r in range(5):
            assert all(torch.equal(a, w) for a, w in zip(run(), first)), f"run {r + 2} differs from run 1 on 2 threads"
        torch.set_num_threads(1)
        for name, a, w in zip(["out", "lse", "dq", "dk", "dv"], run(), first):
            assert torch.equal(a, w), f"{name} differs between 1 and 2 threads"
    finally:
        torch.set_num_threads(threads)


# A few queries (N <= 4: decoding a token or a few against the keys so far, cross-attention of a few
# rows) run the flash-decoding driver: a task is a chunk of one key/value head's keys for all the query
# rows that read it. The same meaning as the blocks: all S keys, top-left causal, any mask, lse for the
# backward, and the same bits on any thread count.
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("kind", [None, *MASKS])
@pytest.mark.parametrize("n, s, causal", [(1, 1, False), (1, 2100, False), (2, 700, True), (3, 5, True),
                                          (4, 300, False)], ids=str)
def test_few_queries_values_and_gradients(n, s, causal, kind, dtype):
    q, k, v = qkv(b=2, h=4, hkv=2, n=n, s=s, d=40, dv=24, dtype=dtype, grad=True)
    mask = None if kind is None else MASKS[kind](2, 4, n, s)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    out, lse = ATTN(q, k, v, mask, causal, None)
    want = reference(q, k, v, mask, causal)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
    g = torch.randn_like(out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    wgrads = torch.autograd.grad(reference(*leaves, mask, causal), leaves, g.double())
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), g), wgrads):
        torch.testing.assert_close(a.double(), b, **GTOL[dtype], msg=f"d{name}")


def test_few_queries_rows_masked_by_the_lowest_float_get_uniform_weights_as_torch():
    # torch's masks use finfo.min: a row masked by it alone averages V in torch, and must here too
    # (the decode driver adds such a mask in natural units, where it cannot overflow)
    q, k, v = qkv(b=1, h=2, n=2, s=600, d=16)
    mask = torch.zeros(1, 1, 2, 600)
    mask[..., 0, :] = torch.finfo(torch.float32).min
    mask[..., 1, 100:] = torch.finfo(torch.float32).min
    out, lse = ATTN(q, k, v, mask, False, None)
    torch.testing.assert_close(out, SDPA(q, k, v, attn_mask=mask), **TOL[torch.float32])
    torch.testing.assert_close(out[0, :, 0], v[0, :, :].mean(1).expand(2, -1), **TOL[torch.float32])
    assert torch.all(lse[0, :, 0] == torch.finfo(torch.float32).min)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_queries_bitwise_the_same_on_any_thread_count_and_opcheck(dtype):
    q, k, v = qkv(b=1, h=8, hkv=2, n=2, s=3000, d=64, dtype=dtype, grad=True)
    mask = torch.rand(1, 1, 2, 3000) > 0.1

    def run():
        return ATTN(q, k, v, mask, False, None)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = run()
        for r in range(5):
            assert all(torch.equal(a, w) for a, w in zip(run(), first)), f"run {r + 2} differs from run 1"
        torch.set_num_threads(1)
        assert all(torch.equal(a, w) for a, w in zip(run(), first)), "1 thread differs from 2"
    finally:
        torch.set_num_threads(threads)
    opcheck(ATTN, (q, k, v, mask, True, 0.3))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_bytes():
    """Bytes the C heap has handed out and not got back (glibc's mallinfo2): unlike the
    resident set, a leak shows even where earlier tests left free memory to reuse.
    Elsewhere the resident set."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm")
def test_failing_calls_with_a_scale_do_not_leak():
    # the optional scale arrives boxed; a check that throws must not strand the box
    q, k, v = qkv(b=1, h=2, n=5, s=5, d=8)
    out, lse = ATTN(q, k, v, None, False, 0.3)
    calls = {
        "attention": lambda: ATTN(q, k.double(), v, None, False, 0.3),
        "attention_backward": lambda: torch.ops.opforge.attention_backward(out, q, k.double(), v, None, out, lse, False, 0.3),
    }
    for name, call in calls.items():
        def fail_many(n):
            for _ in range(n):
                try:
                    call()
                except RuntimeError:
                    pass

        fail_many(2000)  # warm up allocator caches
        before = _heap_bytes()
        fail_many(20_000)
        grown = _heap_bytes() - before
        # the leak was 32-460 B per call: >= 640 KiB here
        assert grown < 200 * 2**10, f"{name}: memory in use grew by {grown / 2**10:.0f} KiB over 20,000 failing calls"


@pytest.mark.parametrize(
    "args",
    [
        lambda: (*qkv(n=9, s=11, grad=True), None, False, None),
        lambda: (*qkv(h=4, hkv=2, n=9, s=11, grad=True), None, True, 0.5),
        lambda: (*qkv(n=9, s=11, dtype=torch.bfloat16, grad=True), torch.rand(9, 11) > 0.3, False, None),
        lambda: (*qkv(n=9, s=11, grad=True), torch.randn(2, 1, 9, 11), False, None),
    ],
    ids=["plain", "gqa-causal-scale", "bf16-bool-mask", "float-mask"],
)
def test_opcheck(args):
    opcheck(ATTN, args())


def test_every_isa_agrees():
    q, k, v = qkv(n=70, s=90, d=40)
    outs = {}
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            outs[isa] = opforge.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        opforge.set_isa("auto")
    for isa, out in outs.items():
        torch.testing.assert_close(out, outs["ref"], **TOL[torch.float32], msg=f"{isa} vs ref")


def test_compile_fullgraph_forward_and_backward():
    q, k, v = qkv(n=16, s=16, grad=True)

    def block(q, k, v):
        return opforge.scaled_dot_product_attention(q, k, v, is_causal=True).sum(-1)

    torch.compile(block, fullgraph=True)(q, k, v).sum().backward()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    SDPA(*leaves, is_causal=True).sum(-1).sum().backward()
    for a, b in zip((q, k, v), leaves):
        torch.testing.assert_close(a.grad, b.grad, **GTOL[torch.float32])


def test_compile_dynamic_shapes():
    fn = torch.compile(lambda q, k, v: opforge.scaled_dot_product_attention(q, k, v), fullgraph=True, dynamic=True)
    for n in (8, 13):
        q, k, v = qkv(n=n, s=n + 3)
        torch.testing.assert_close(fn(q, k, v), SDPA(q, k, v), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_runs_in_the_autocast_dtype(dtype):
    q, k, v = qkv(n=20, s=24, grad=True)
    mask = torch.randn(20, 24)
    with torch.autocast("cpu", dtype=dtype):
        out = opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.dtype == dtype
    lowered = [t.detach().to(dtype) for t in (q, k, v, mask)]
    torch.testing.assert_close(out.double(), reference(*lowered[:3], lowered[3]), **TOL[dtype])
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32


def _mha_pair(**kw):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(64, 4, batch_first=True, **kw)
    mod = opforge.nn.MultiheadAttention(64, 4, **kw)
    mod.load_state_dict(ref.state_dict())
    return ref, mod


@pytest.mark.parametrize("case", ["self", "self-causal", "self-masks", "cross", "cross-kdim", "unbatched", "float-masks"])
def test_multihead_attention_is_a_drop_in(case):
    kw = dict(kdim=24, vdim=40) if case == "cross-kdim" else {}
    ref, mod = _mha_pair(**kw)
    assert set(ref.state_dict()) == set(mod.state_dict())
    x = torch.randn(3, 10, 64, requires_grad=True)
    key = value = x
    call = dict()
    if case.startswith("cross"):
        key = torch.randn(3, 14, kw.get("kdim", 64))
        value = torch.randn(3, 14, kw.get("vdim", 64))
    if case == "unbatched":
        x = torch.randn(10, 64, requires_grad=True)
        key = value = x
    s = key.shape[-2]
    if case == "self-causal":
        call = dict(attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(10), is_causal=True)
    if case == "self-masks":
        kpm = torch.zeros(3, 10, dtype=torch.bool)
        kpm[1, 6:] = True
        call = dict(key_padding_mask=kpm, attn_mask=torch.rand(10, 10) > 0.8)
    if case == "float-masks":
        call = dict(key_padding_mask=torch.randn(3, s), attn_mask=torch.randn(3 * 4, 10, s))
    want, _ = ref(x, key, value, need_weights=False, **call)
    got, weights = mod(x, key, value, **call)
    assert weights is None
    torch.testing.assert_close(got, want, **GTOL[torch.float32])
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, [x, *mod.parameters()], g)
    want_grads = torch.autograd.grad(want, [x, *ref.parameters()], g)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)


def test_multihead_attention_unsupported_arguments():
    with pytest.raises(RuntimeError, match=r"batch_first' must be True"):
        opforge.nn.MultiheadAttention(16, 2, batch_first=False)
    with pytest.raises(RuntimeError, match=r"add_bias_kv"):
        opforge.nn.MultiheadAttention(16, 2, add_bias_kv=True)
    mod = opforge.nn.MultiheadAttention(16, 2)
    x = torch.randn(2, 3, 16)
    with pytest.raises(RuntimeError, match=r"need_weights=True is not supported"):
        mod(x, x, x, need_weights=True)
    with pytest.raises(RuntimeError, match=r"dropout \(0.1\) is not supported in training"):
        opforge.nn.MultiheadAttention(16, 2, dropout=0.1)(x, x, x)


def test_log_and_profiler_name(own_kernels):
    q, k, v = qkv(n=8, s=8)
    with torch.profiler.profile(record_shapes=True) as prof:
        opforge.scaled_dot_product_attention(q, k, v)
    assert any(e.name == "opforge::attention" for e in prof.events())


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: opforge.scaled_dot_product_attention(*qkv(), dropout_p=0.1), r"argument 'dropout_p' must be 0.0"),
        (lambda: opforge.scaled_dot_product_attention(*qkv(n=5, s=6), attn_mask=torch.zeros(5, 6, requires_grad=True)), r"argument 'attn_mask' requires grad"),
        (lambda: opforge.scaled_dot_product_attention(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)), r"must all be 4-d .* or all 3-d .*got 2-d"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(3, 4, 5, 8), torch.randn(3, 4, 5, 8), None, False, None), r"\[opforge::attention\] argument 'k' must have size\(0\) == q.size\(0\) = 2, got 3 \(k: \[3, 4, 5, 8\], q: \[2, 4, 5, 8\]\)"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), None, False, None), r"argument 'k' must have a number of heads dividing the 4 heads of 'q'.*got 3"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 0, 5, 8), torch.randn(2, 0, 5, 8), None, False, None), r"argument 'k' must have a number of heads dividing the 4 heads of 'q'.*got 0"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 6), torch.randn(2, 4, 5, 8), None, False, None), r"argument 'k' must have size\(3\) == q.size\(3\) = 8, got 6 \(k: \[2, 4, 5, 6\], q: \[2, 4, 5, 8\]\)"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), None, False, None), r"argument 'v' must have size\(2\) == k.size\(2\) = 5, got 6 \(v: \[2, 4, 6, 8\], k: \[2, 4, 5, 8\]\)"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8).double(), torch.randn(2, 4, 5, 8), None, False, None), r"argument 'k' must have the dtype of 'q' \(float32\), got float64"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.zeros(5, 5, dtype=torch.int64), False, None), r"argument 'attn_mask' must be bool \(true = attend\) or float32 .* got int64"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.zeros(5, 4), False, None), r"argument 'attn_mask' must be broadcastable to \(B, H, N, S\) = \[2, 4, 5, 5\], got shape \[5, 4\]"),
        (lambda: ATTN(torch.randn(4, 5, 8), torch.randn(4, 5, 8), torch.randn(4, 5, 8), None, False, None), r"argument 'q' must have 4 dims \(batch, heads, length, head_dim\), got 3: \[4, 5, 8\]"),
        (lambda: ATTN(torch.ones(2, 4, 5, 8, dtype=torch.int32), torch.ones(2, 4, 5, 8, dtype=torch.int32), torch.ones(2, 4, 5, 8, dtype=torch.int32), None, False, None), r"argument 'q' must be a floating-point tensor"),
        (lambda: ATTN(*qkv(), None, False, float("nan")), r"argument 'scale' must be a finite float32 number"),
        (lambda: ATTN(*qkv(), None, False, 1e40), r"argument 'scale' must be a finite float32 number, got 1e\+40"),
        (lambda: ATTN(*qkv(dtype=torch.float64), None, False, float("inf")), r"argument 'scale' must be a finite float64 number, got inf"),
    ],
)
def test_bad_input(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


def test_meta_and_fake_calls_check_what_the_kernel_checks():
    # fake kernels returned plausible shapes for head counts the kernel refuses, and a cpu tensor for a meta mask
    A = torch.ops.opforge.attention.default
    q, k, v = torch.empty(1, 2, 3, 4, device="meta"), torch.empty(1, 3, 5, 4, device="meta"), torch.empty(1, 3, 5, 6, device="meta")
    with pytest.raises(RuntimeError, match=r"\[opforge::attention\] argument 'k' must have a number of heads dividing"):
        A(q, k, v, None, False, None)
    with pytest.raises(RuntimeError, match=r"argument 'attn_mask' must be on the device of 'q' \(cpu\), got meta"):
        A(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 6),
          torch.ones(3, 5, dtype=torch.bool, device="meta"), False, None)
    out, lse = A(q, k[:, :2], v[:, :2], None, True, None)
    real, _ = A(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 6), None, True, None)
    assert (out.shape, out.stride(), lse.shape) == (real.shape, real.stride(), (1, 2, 3))


# ---- what the generic tests run of this op (tests/python/discover.py) ------------------------------------

# fuzz.py: random shapes near where the plans change, masks, grouped-query heads, layouts, dtypes, ISAs and
# threads, against float64 torch

ATTN_MARKS = (1, 8, 16, 32, 63, 64, 65, 128, 192, 256, 512, 1024)  # 64-row query and key blocks
HEAD_DIMS = (1, 7, 8, 16, 31, 32, 33, 40, 64, 80, 96, 128, 129, 256)
FWD_DECODE_MAX_N = 4  # attention.c: the forward of this few queries runs attention_decode's driver


def _fuzz_draw(rng, c):
    c["dims"] = rng.choice((4, 4, 4, 3))
    c["b"] = rng.choice((1, 1, 2, 3))
    if c["dims"] == 4:
        c["hkv"] = rng.choice((1, 1, 2, 3))
        c["h"] = c["hkv"] * rng.choice((1, 1, 2, 4))
    else:
        c["h"] = c["hkv"] = 1
    c["n"] = fuzz.dim(rng, 1536, ATTN_MARKS, zero=0.01)
    c["s"] = c["n"] if rng.random() < 0.4 else fuzz.dim(rng, 1536, ATTN_MARKS, zero=0.01)
    c["d"] = rng.choice(HEAD_DIMS) if rng.random() < 0.7 else rng.randint(1, 160)
    c["dv"] = c["d"] if rng.random() < 0.7 else rng.choice(HEAD_DIMS)
    c["causal"] = rng.random() < 0.4
    c["mask"] = rng.choice((None, None, "bool", "float", "float-inf"))
    if c["mask"]:
        # a shape broadcastable to (B, H, N, S): right-aligned, 1 where broadcast, 1 to 4 dims
        full = [c["b"], c["h"], c["n"], c["s"]] if c["dims"] == 4 else [c["b"], c["n"], c["s"]]
        nd = rng.randint(1, len(full))
        c["mask_shape"] = [1 if rng.random() < 0.3 else s for s in full[len(full) - nd:]]
        c["mask_keep"] = rng.choice((0.9, 0.5, 0.05))  # share of True, or of finite scores
        c["mask_layout"] = fuzz.layout(rng, c["mask_shape"], p_plain=0.7)
    c["scale"] = None if rng.random() < 0.6 else rng.choice((0.3, 1.0, round(rng.uniform(0.01, 2.0), 4), -0.5))
    c["grad"] = rng.random() < 0.5
    qkv = [("q", c["h"], c["n"], c["d"]), ("k", c["hkv"], c["s"], c["d"]), ("v", c["hkv"], c["s"], c["dv"])]
    for name, h, length, d in qkv:
        shape = [c["b"], h, length, d] if c["dims"] == 4 else [c["b"], length, d]
        c[name + "_layout"] = fuzz.layout(rng, shape)
    area = c["b"] * c["h"] * c["n"] * c["s"]
    flops = 2.0 * area * (c["d"] + c["dv"]) * (3.5 if c["grad"] else 1)
    return fuzz.seconds(c, flops, 3 * flops, area * (45 if c["grad"] else 15))


def _fuzz_describe(c):
    mask = f" mask={c['mask']}{tuple(c['mask_shape'])}{fuzz.layout_str(c['mask_layout'])} keep={c['mask_keep']}" \
        if c["mask"] else ""
    lay = "".join(f" {t}{fuzz.layout_str(c[t + '_layout'])}" for t in "qkv" if c[t + "_layout"])
    return (f"{c['dims']}-d B={c['b']} H={c['h']} Hkv={c['hkv']} N={c['n']} S={c['s']} D={c['d']} "
            f"Dv={c['dv']} causal={c['causal']} scale={c['scale']}{mask}{lay} grad={c['grad']}")


def attention_reference(q, k, v, mask, causal, scale, g, dt, r_pv=0.0, r_p=0.0, r_ds=0.0, r_out=0.0):
    """SDPA in float64 with error bounds: (out, out_bound, grads {q,k,v: (want, bound)} or None).

    Scores s = q k^T scale + mask are off by es <= u c(D) |q||k|^T |scale| (+ a rounding of the masked
    sum); softmax turns that into a relative error of each weight p_ij of es_ij + sum_j p_ij es_ij, plus
    the exp and the row sum's roundings. The backward (dv = p^T g, dp = g v^T, ds = p (dp - rowsum(g o)),
    dq = ds k scale, dk = ds^T q scale) carries those errors through each product. The kernel's own
    roundings (the rounded table of FUZZ), relative: r_pv of P before the forward's P V, r_p of P before the backward's
    P^T dO, r_ds of dS before dS K and dS^T Q, r_out of the saved out that delta reads."""
    u = fuzz.U_ACC[dt]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    n, s_len, d, dv = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    qk = q @ k.transpose(-2, -1)
    s = qk * scale
    es = fuzz.sum_err(u, d, q.abs() @ k.abs().transpose(-2, -1), qk) * abs(scale)
    keep = torch.ones((), dtype=torch.bool)
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            s = s + mask
            es = es + u * s.abs().nan_to_num(0.0, 0.0, 0.0)
    if causal:
        keep = keep & torch.ones(n, s_len, dtype=torch.bool).tril()
    s = s.masked_fill(~keep, -math.inf)
    mx = s.amax(-1, keepdim=True) if s_len else torch.zeros(*s.shape[:-1], 1, dtype=s.dtype)
    mx = torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx)
    e = (s - mx).exp()
    total = e.sum(-1, keepdim=True)
    p = e / torch.where(total == 0, torch.ones_like(total), total)
    es = torch.where(p > 0, es, torch.zeros_like(es))
    rel = es + (p * es).sum(-1, keepdim=True) + u * (fuzz.C_FN + fuzz.c_sum(s_len) + 0.5 * s_len)  # exp, the row sum
    dp_abs = p * rel  # |error| of each weight
    out = p @ v
    pv_abs = p @ v.abs()
    out_err = dp_abs @ v.abs() + fuzz.sum_err(u, s_len, pv_abs, out) + r_pv * pv_abs
    out_bound = out_err + fuzz.out_tol(out, dt)
    if g is None:
        return out, out_bound, None
    gv = g @ v.transpose(-2, -1)
    egv = fuzz.sum_err(u, dv, g.abs() @ v.abs().transpose(-2, -1), gv)
    dd = (g * out).sum(-1, keepdim=True)
    out_saved = out_err + r_out * out.abs() + (fuzz.A16[dt] if r_out else 0.0)
    edd = (g.abs() * out_saved).sum(-1, keepdim=True) + fuzz.sum_err(u, dv, (g.abs() * out.abs()).sum(-1, keepdim=True), dd)
    ds = p * (gv - dd)
    eds = dp_abs * (gv - dd).abs() + p * (egv + edd) + 4 * u * ds.abs()
    a_scale = abs(scale)

    def group(t):  # grouped-query heads: the gradient of a K/V head sums its query heads'
        return t.reshape(t.shape[0], t.shape[1] // rep, rep, *t.shape[2:]).sum(2) if rep > 1 else t

    dq = ds @ k
    dsk_abs = ds.abs() @ k.abs()
    dq_b = (eds @ k.abs() + fuzz.sum_err(u, s_len, dsk_abs, dq) + r_ds * dsk_abs) * a_scale
    dq = dq * scale
    dk = ds.transpose(-2, -1) @ q
    dsq_abs = ds.abs().transpose(-2, -1) @ q.abs()
    dk_b = group((eds.transpose(-2, -1) @ q.abs() + fuzz.sum_err(u, n, dsq_abs, dk) + r_ds * dsq_abs) * a_scale)
    dk = group(dk * scale)
    dvv = p.transpose(-2, -1) @ g
    pg_abs = p.transpose(-2, -1) @ g.abs()
    dv_b = group(dp_abs.transpose(-2, -1) @ g.abs() + fuzz.sum_err(u, n, pg_abs, dvv) + r_p * pg_abs)
    dvv = group(dvv)
    return out, out_bound, {"q": (dq, dq_b), "k": (dk, dk_b), "v": (dvv, dv_b)}


def _fuzz_check(c, gen, dtype, dt, call):
    four = c["dims"] == 4
    shapes = {"q": (c["h"], c["n"], c["d"]), "k": (c["hkv"], c["s"], c["d"]), "v": (c["hkv"], c["s"], c["dv"])}
    inputs = {}
    for name, (h, length, d) in shapes.items():
        shape = [c["b"], h, length, d] if four else [c["b"], length, d]
        base, view = fuzz.make(gen, shape, dtype, c[name + "_layout"])
        base.requires_grad_(c["grad"])
        inputs[name] = view(base)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    mask = None
    if c["mask"]:
        mbase, mview = fuzz.make(gen, c["mask_shape"], torch.float64, c["mask_layout"])
        if c["mask"] == "bool":
            mbase = torch.rand(mbase.shape, generator=gen, dtype=torch.float64) < c["mask_keep"]
        elif c["mask"] == "float-inf":
            drop = torch.rand(mbase.shape, generator=gen, dtype=torch.float64) >= c["mask_keep"]
            mbase = mbase.masked_fill(drop, -math.inf)
        mbase = mbase if mbase.dtype == torch.bool else mbase.to(dtype)
        mask = mview(mbase)
    out_shape = list(q.shape[:-1]) + [c["dv"]]
    g = fuzz.random_tensor(gen, out_shape, dtype)

    def forward_backward():
        out = opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=c["causal"],
                                                   scale=c["scale"], enable_gqa=c["h"] != c["hkv"])
        grads = torch.autograd.grad(out, (q, k, v), g) if c["grad"] else None
        return out, grads

    if c["grad"]:
        out, grads = call(forward_backward)
    else:
        with torch.no_grad():
            out, grads = call(forward_backward)

    def four_d(t):
        return t if four else t.unsqueeze(1)

    # float64 keeps the scale in double; the float32 kernels round it once (its default 1 / sqrt(D) too)
    scale = c["scale"] if c["scale"] is not None else 1.0 / math.sqrt(c["d"]) if c["d"] else 1.0
    if c["dtype"] != "float64":
        scale = float(torch.tensor(scale, dtype=torch.float32))
    m64 = None
    if mask is not None:  # a 3-d mask goes with 3-d inputs (B, N, S); fewer dims broadcast as they are
        m64 = mask if mask.dtype == torch.bool else mask.double()
        m64 = m64.unsqueeze(1) if not four and mask.dim() == 3 else m64
    fwd = "attention_decode" if 1 <= c["n"] <= FWD_DECODE_MAX_N else "attention"
    want, bound, gwant = attention_reference(four_d(q.detach().double()), four_d(k.detach().double()),
                                             four_d(v.detach().double()), m64, c["causal"], scale,
                                             four_d(g.double()) if c["grad"] else None, dt,
                                             r_pv=fuzz.rounding(c, "P", fwd), r_p=fuzz.rounding(c, "P"),
                                             r_ds=fuzz.rounding(c, "dS"), r_out=fuzz.rounding(c, "out"))

    def back(t):
        return t if four else t.squeeze(1)

    checks = [fuzz.Check("out", out, back(want), back(bound), dtype)]
    if c["grad"]:
        for name, got in zip("qkv", grads):
            ref, err = gwant[name]
            checks.append(fuzz.Check(f"d{name}", got, back(ref), back(err) + fuzz.out_tol(back(ref), dt), dtype))
    return checks


FUZZ = {
    "attention": fuzz.Op(_fuzz_draw, _fuzz_check, _fuzz_describe, weight=0.2, order=3, seeded=True, rounded={
        # attention.c: delta = rowsum(dO o out) reads the saved 16-bit out (rows_in); S, P, dP, dS float32
        # (mm: attention_ref.c, attention_avx2.c, attention_avx512.c)
        ("*", "*"): ("out",),
        # mm_bf16 = mm_avx512bf16 (attention_avx512.c) packs both operands of each product as bfloat16 pairs
        # (pack_a, pack_b: to nearest even): Q, K, V, dO exact; P before P V (forward) and P^T dO, dS before
        # dS K and dS^T Q; float32 softmax (l sums the unrounded P), sums and dQ, dK, dV
        ("avx512_bf16", "bfloat16"): ("out", "P", "dS"),
        # attention_amx.c: the same products on AMX tiles, operands rounded to bfloat16 pairs the same way (its
        # softmax, probabilities and score gradients are the AVX-512 kernels'); case 55 of seed 629 on an AMX CPU
        # was 4.7x its bound without P's rounding, as on avx512_bf16 (test_fuzz.py)
        ("amx", "bfloat16"): ("out", "P", "dS"),
    }),
}


# test_export.py: the op's part of the exported model


def _export(g, hidden, vocab, max_len, heads=2):
    def run(x, target, qkv):
        b, n, _ = x.shape
        q, k, v = (x @ qkv.T).view(b, n, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4)
        return (opforge.scaled_dot_product_attention(q, k, v, is_causal=True),)

    return {"qkv": torch.randn(3 * hidden, hidden, generator=g) / hidden**0.5}, run


EXPORT = {"attention": _export}


# test_training.py: autocast, checkpointing and determinism

TRAINING = {
    "scaled_dot_product_attention": training.Case(
        ("attention",),
        lambda dt, big: [training.randn(2, 4, 300 if big else 13, 32, dtype=dt) for _ in range(1)]
        + [training.randn(2, 2, 300 if big else 13, 32, dtype=dt) for _ in range(2)],
        (0, 1, 2),
        lambda q, k, v: opforge.scaled_dot_product_attention(q, k, v, is_causal=True),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        autocast="lower"),
}


# test_thread_sweep.py: empty and tiny shapes at 1-64 threads (the references written out: torch's CPU flash
# kernel itself divides by zero on empty heads, queries or keys)


def attention64(q, k, v, keep, causal, scale):
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


# (B, H, Hkv, N, S, D, Dv); N <= 4 runs the flash-decoding driver, a lone query block over >= 2 key blocks splits,
# fewer query blocks than threads are cut to 32 or 16 queries
SWEEP_SHAPES = [(0, 2, 2, 5, 7, 8, 8), (2, 0, 0, 5, 7, 8, 8), (2, 0, 2, 5, 7, 8, 8), (2, 0, 0, 1, 7, 8, 8),
             (2, 0, 2, 1, 7, 8, 8), (2, 2, 2, 0, 7, 8, 8), (2, 4, 2, 5, 0, 8, 8), (2, 2, 1, 1, 0, 8, 8),
             (2, 4, 2, 0, 0, 8, 8), (1, 2, 2, 5, 7, 0, 8), (1, 2, 2, 2, 7, 0, 3), (1, 2, 2, 5, 7, 8, 0),
             (1, 1, 1, 1, 1, 1, 1), (1, 3, 1, 2, 3, 5, 3), (2, 4, 2, 5, 17, 7, 5), (1, 1, 1, 3, 70, 8, 8),
             (1, 1, 1, 7, 130, 8, 8), (1, 1, 1, 64, 64, 16, 16), (1, 6, 3, 4, 9, 4, 4), (3, 1, 1, 17, 5, 3, 2), (2, 4, 2, 130, 130, 16, 16)]


def _sweep_cases():
    cases = []
    for b, h, hkv, n, s, d, dv in SWEEP_SHAPES:
        for kind in ("plain", "causal", "mask"):
            scale = 0.3 if d == 0 or kind == "mask" else None

            def make(dt, b=b, h=h, hkv=hkv, n=n, s=s, d=d, dv=dv, kind=kind):
                mask = None
                if kind == "mask":  # every row keeps key 0: no row fully masked (its gradient is torch's NaN)
                    mask = torch.rand(n, s, generator=torch.Generator().manual_seed(4)) > 0.5
                    mask[:, :1] = True
                return (thread_sweep.randn((b, h, n, d), 1).to(dt), thread_sweep.randn((b, hkv, s, d), 2).to(dt),
                        thread_sweep.randn((b, hkv, s, dv), 3).to(dt), mask)

            def fn(q, k, v, mask, kind=kind, scale=scale):
                return (opforge.scaled_dot_product_attention(q, k, v, mask, is_causal=kind == "causal", scale=scale,
                                                             enable_gqa=True),)

            def ref(q, k, v, mask, kind=kind, scale=scale):
                return (attention64(q, k, v, mask, kind == "causal", scale),)

            cases.append(thread_sweep.Case(f"attention B={b} H={h} Hkv={hkv} N={n} S={s} D={d} Dv={dv} {kind}", make,
                                           fn, ref, grads=(0, 1, 2)))
    return cases


SWEEP = {"attention": _sweep_cases}


@pytest.mark.parametrize("qb, kb", [(3, 1), (1, 3)])
def test_batch_of_one_broadcasts_as_torchs(qb, kb):
    """A batch of 1 beside a batch of B, as F.scaled_dot_product_attention broadcasts it (a stride-0 view the
    kernels read in place): values and gradients against torch in float64, with a mask and causal."""
    g = torch.Generator().manual_seed(qb * 10 + kb)
    q = torch.randn(qb, 4, 7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(kb, 2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.rand(7, 9, generator=g) > 0.2
    for kw in (dict(is_causal=True), dict(attn_mask=mask)):
        got = opforge.scaled_dot_product_attention(q, k, v, **kw)
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        torch.testing.assert_close(got, want)
        for a, b in zip(torch.autograd.grad(got.square().sum(), (q, k, v)),
                        torch.autograd.grad(want.square().sum(), (q, k, v))):
            torch.testing.assert_close(a, b)


def test_float_mask_of_another_dtype_is_rounded_to_the_querys():
    """A float32 additive mask beside bfloat16 q, k, v (torch's takes it): rounded to bfloat16, then as a
    bfloat16 mask."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g).bfloat16() for _ in range(3))
    mask = torch.randn(5, 5, generator=g)
    torch.testing.assert_close(opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask.bfloat16()), atol=0, rtol=0)
    torch.testing.assert_close(opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask).float(),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask).float(), atol=2e-2, rtol=2e-2)
