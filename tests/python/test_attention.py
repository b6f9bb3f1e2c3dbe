"""attention against torch.nn.functional.scaled_dot_product_attention: values per
dtype, causal with unequal lengths, grouped-query heads, masks, fully masked
rows, strides, gradients, gradcheck, float64 to the last bits, empty shapes,
opcheck, a backward bitwise the same on any thread count, few query blocks (the
forward's keys split into chunks) against float64 and bitwise the same on 1 and 2
threads, a few queries (N <= 4, the flash-decoding driver) with every mask kind, gradients and
opcheck, no leak on failing calls, torch.compile, autocast, nn.MultiheadAttention, bad input."""

import ctypes
import os

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import opforge

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nan_propagates_as_torch(dtype):
    # against torch's math (softmax of the scores): its fused CPU kernel gives NaN rows on AVX2
    # CPUs but zeros on AVX-512 ones
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


def test_log_and_profiler_name():
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
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(3, 4, 5, 8), torch.randn(3, 4, 5, 8), None, False, None), r"\[opforge::attention\] arguments 'k' and 'v' must have the batch size of 'q' \(2\), got 3 and 3"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), None, False, None), r"argument 'k' must have a number of heads dividing the 4 heads of 'q'.*got 3"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 0, 5, 8), torch.randn(2, 0, 5, 8), None, False, None), r"argument 'k' must have a number of heads dividing the 4 heads of 'q'.*got 0"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 6), torch.randn(2, 4, 5, 8), None, False, None), r"argument 'k' must have the head_dim of 'q' \(8\), got 6"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), None, False, None), r"argument 'v' must have the key length of 'k' \(5\), got 6"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8).double(), torch.randn(2, 4, 5, 8), None, False, None), r"argument 'k' must have the dtype of 'q' \(float32\), got float64"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.zeros(5, 5, dtype=torch.int64), False, None), r"argument 'attn_mask' must be bool \(true = attend\) or float32 .* got int64"),
        (lambda: ATTN(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.zeros(5, 4), False, None), r"argument 'attn_mask' must be broadcastable to \(B, H, N, S\) = \[2, 4, 5, 5\], got shape \[5, 4\]"),
        (lambda: ATTN(torch.randn(4, 5, 8), torch.randn(4, 5, 8), torch.randn(4, 5, 8), None, False, None), r"argument 'q' must be 4-d"),
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
