"""attention_decode against F.scaled_dot_product_attention in float64 on each row's slice of the cache:
values per dtype for N = 1..16 new tokens, grouped-query heads, bottom-right causal, seq_lens of 0 to
S_max (int32 and int64), caches as strided views of a larger buffer, bitwise the same on 1 and 2
threads, every ISA, a greedy decoding loop against full attention, opcheck, torch.compile (static and
dynamic), autocast, no derivative, empty shapes, meta calls and each error message."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fuzz
import opforge
import thread_sweep
import training
from test_attention import HEAD_DIMS, attention64, attention_reference

DEC = torch.ops.opforge.attention_decode.default
SDPA = F.scaled_dot_product_attention
# float32: a ~1-2 ulp vector exp, sums of up to S products, chunks combined in float32.
# 16-bit types compute in float32 from the rounded inputs and round once.
TOL = {
    torch.float32: dict(rtol=2e-5, atol=2e-5),
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def cache(b=2, h=8, hkv=2, n=1, s=300, d=64, dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = dv or d
    q = torch.randn(b, h, n, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, s, dv, generator=g).to(dtype)
    return q, k, v


def reference(q, k, v, lens, causal=False, scale=None):
    """float64 SDPA of each row against its first lens[b] keys; bottom-right causal for N > 1."""
    n, outs = q.shape[2], []
    for b in range(q.shape[0]):
        length = int(lens[b])
        if length == 0:
            outs.append(torch.zeros(1, q.shape[1], n, v.shape[-1], dtype=torch.float64))
            continue
        mask = None
        if causal:  # query i sees keys j <= length - n + i; a query before the first key sees none
            mask = torch.arange(length).view(1, -1) <= (length - n + torch.arange(n)).view(-1, 1)
        o = SDPA(q[b:b + 1].double(), k[b:b + 1, :, :length].double(), v[b:b + 1, :, :length].double(),
                 attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o.nan_to_num(0.0))  # SDPA gives NaN for a row with no key, opforge zeros
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 4, 16])
def test_values(n, causal, dtype):
    q, k, v = cache(b=3, h=8, hkv=2, n=n, s=300, d=40, dtype=dtype)
    lens = torch.tensor([300, 7, 129])
    out = opforge.attention_decode(q, k, v, lens, causal=causal)
    assert out.shape == (3, 8, n, 40) and out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, lens, causal), **TOL[dtype])


@pytest.mark.parametrize("h, hkv", [(4, 4), (6, 2), (32, 8), (8, 1)], ids=str)
@pytest.mark.parametrize("d, dv", [(1, 1), (7, 7), (128, 128), (123, 40)], ids=str)
def test_heads_and_head_dims(h, hkv, d, dv):
    q, k, v = cache(b=1, h=h, hkv=hkv, s=77, d=d, dv=dv)
    lens = torch.tensor([77], dtype=torch.int32)
    out = opforge.attention_decode(q, k, v, lens, scale=0.3)
    torch.testing.assert_close(out.double(), reference(q, k, v, lens, scale=0.3), **TOL[torch.float32])


def test_long_cache_is_split_and_matches_sdpa():
    # 4097 keys of one row over 2 KV heads: dozens of chunks, combined
    q, k, v = cache(b=1, h=8, hkv=2, s=4097, d=64)
    lens = torch.tensor([4097])
    out = opforge.attention_decode(q, k, v, lens)
    torch.testing.assert_close(out, SDPA(q, k, v, enable_gqa=True), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_views_are_read_in_place(dtype):
    # the cache of a (B, S_buf, Hkv, D) buffer sliced to S_max, and q of a (B, N, H, D) projection
    b, h, hkv, n, s, d = 2, 6, 3, 2, 200, 32
    g = torch.Generator().manual_seed(3)
    kbuf = torch.randn(b, s + 56, hkv, d, generator=g).to(dtype)
    vbuf = torch.randn(b, s + 56, hkv, d, generator=g).to(dtype)
    k, v = kbuf.transpose(1, 2)[:, :, :s], vbuf.transpose(1, 2)[:, :, :s]
    q = torch.randn(b, n, h, d, generator=g).to(dtype).transpose(1, 2)
    lens = torch.tensor([200, 31])
    out = opforge.attention_decode(q, k, v, lens, causal=True)
    torch.testing.assert_close(out.double(), reference(q, k, v, lens, causal=True), **TOL[dtype])
    dense = opforge.attention_decode(q.contiguous(), k.contiguous(), v.contiguous(), lens, causal=True)
    assert torch.equal(out, dense)
    # keys past seq_lens are never read: garbage there changes nothing
    kbuf[0, 200:] = float("nan")
    kbuf[1, 31:] = float("inf")
    assert torch.equal(opforge.attention_decode(q, k, v, lens, causal=True), out)


def test_seq_lens_int32_int64_and_strided():
    q, k, v = cache(b=3, s=50)
    lens64 = torch.tensor([50, 0, 17])
    want = opforge.attention_decode(q, k, v, lens64)
    assert torch.equal(opforge.attention_decode(q, k, v, lens64.int()), want)
    strided = torch.tensor([[50, 9], [0, 9], [17, 9]], dtype=torch.int32)[:, 0]
    assert torch.equal(opforge.attention_decode(q, k, v, strided), want)
    assert torch.all(want[1] == 0)  # no key: zeros


def test_causal_with_one_query_changes_nothing_and_early_queries_see_nothing():
    q, k, v = cache(b=2, n=1, s=40)
    lens = torch.tensor([40, 3])
    assert torch.equal(opforge.attention_decode(q, k, v, lens, causal=True), opforge.attention_decode(q, k, v, lens))
    q4, _, _ = cache(b=2, n=4, s=40, seed=1)
    out = opforge.attention_decode(q4, k, v, lens, causal=True)  # row 1: 3 keys, 4 queries: query 0 sees none
    assert torch.all(out[1, :, 0] == 0)
    torch.testing.assert_close(out.double(), reference(q4, k, v, lens, causal=True), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bitwise_the_same_on_one_and_two_threads(dtype):
    q, k, v = cache(b=2, h=8, hkv=2, n=3, s=3000, d=64, dtype=dtype)
    lens = torch.tensor([3000, 1234])
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 1, 2):
            torch.set_num_threads(t)
            outs.append(opforge.attention_decode(q, k, v, lens, causal=True))
    finally:
        torch.set_num_threads(threads)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_every_isa_agrees():
    q, k, v = cache(b=2, h=6, hkv=3, n=2, s=500, d=40)
    lens = torch.tensor([500, 77])
    outs = {}
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            outs[isa] = opforge.attention_decode(q, k, v, lens, causal=True)
    finally:
        opforge.set_isa("auto")
    for isa, out in outs.items():
        torch.testing.assert_close(out, outs["ref"], **TOL[torch.float32], msg=f"{isa} vs ref")


def test_greedy_decoding_loop_matches_full_attention():
    # a prompt of 5 tokens, then 6 decoding steps appending one token each into a preallocated cache;
    # rows of different lengths (row 1 starts 2 tokens later): each step equals causal attention over
    # everything so far
    torch.manual_seed(0)
    b, h, hkv, d, s_max = 2, 4, 2, 16, 32
    k_buf, v_buf = torch.zeros(b, hkv, s_max, d), torch.zeros(b, hkv, s_max, d)
    ks, vs, qs = (torch.randn(b, heads, 11, d) for heads in (hkv, hkv, h))
    lens = torch.tensor([5, 3], dtype=torch.int32)
    for r in range(b):
        k_buf[r, :, :lens[r]], v_buf[r, :, :lens[r]] = ks[r, :, :lens[r]], vs[r, :, :lens[r]]
    with torch.inference_mode():
        for _ in range(6):
            rows, at = torch.arange(b), lens.long()
            k_buf[rows, :, at] = ks[rows, :, at]
            v_buf[rows, :, at] = vs[rows, :, at]
            lens += 1
            q = qs[rows, :, lens.long() - 1].unsqueeze(2)  # (B, H, 1, D): the newest token's query
            out = opforge.attention_decode(q, k_buf, v_buf, lens)
            for r in range(b):
                n = int(lens[r])
                full = SDPA(qs[r:r + 1, :, :n], ks[r:r + 1, :, :n], vs[r:r + 1, :, :n], is_causal=True,
                            enable_gqa=True)
                torch.testing.assert_close(out[r:r + 1, :, 0], full[:, :, -1], **TOL[torch.float32])


def test_output_layout_makes_the_head_merge_a_view():
    q, k, v = cache(b=2, h=4, hkv=2, n=3, s=20, d=8)
    out = opforge.attention_decode(q, k, v, torch.tensor([20, 5]))
    merged = out.transpose(1, 2).reshape(2, 3, 32)
    assert merged.data_ptr() == out.data_ptr() and out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("shape", [(0, 4, 2, 1, 9), (2, 4, 2, 1, 0), (2, 0, 0, 1, 9)], ids=str)
def test_empty_shapes(shape):
    b, h, hkv, n, s = shape
    q, k, v = torch.randn(b, h, n, 8), torch.randn(b, hkv, s, 8), torch.randn(b, hkv, s, 8)
    out = opforge.attention_decode(q, k, v, torch.zeros(b, dtype=torch.int64))
    assert out.shape == (b, h, n, 8) and torch.all(out == 0)


def test_no_derivative():
    q, k, v = cache(b=1, s=10)
    with pytest.raises(RuntimeError, match=r"\[opforge::attention_decode\] has no derivative, but an input requires "
                                           r"grad: call it under torch.no_grad\(\)"):
        opforge.attention_decode(q.requires_grad_(), k, v, torch.tensor([10]))
    with torch.no_grad():
        assert opforge.attention_decode(q, k, v, torch.tensor([10])).shape == (1, 8, 1, 64)


@pytest.mark.parametrize(
    "args",
    [
        lambda: (*cache(b=2, h=4, hkv=2, n=1, s=30, d=8), torch.tensor([30, 4]), None, False),
        lambda: (*cache(b=2, h=4, hkv=1, n=3, s=30, d=8, dtype=torch.bfloat16), torch.tensor([30, 0], dtype=torch.int32), 0.5, True),
    ],
    ids=["plain", "bf16-gqa-causal-scale"],
)
def test_opcheck(args):
    opcheck(DEC, args())


def test_compile_fullgraph_static_and_dynamic():
    def step(q, k, v, lens):
        return opforge.attention_decode(q, k, v, lens, causal=True).transpose(1, 2).flatten(2) * 2

    static = torch.compile(step, fullgraph=True)
    dynamic = torch.compile(step, fullgraph=True, dynamic=True)
    for s, n in ((40, 1), (57, 3)):
        q, k, v = cache(b=2, h=4, hkv=2, n=n, s=s, d=16)
        lens = torch.tensor([s, s // 2])
        want = step(q, k, v, lens)
        torch.testing.assert_close(static(q, k, v, lens), want, **TOL[torch.float32])
        torch.testing.assert_close(dynamic(q, k, v, lens), want, **TOL[torch.float32])


def test_compile_refuses_what_eager_refuses():
    q, k, v = cache(b=1, h=6, hkv=4, s=10)
    with pytest.raises(Exception, match=r"argument 'k_cache' must have a number of heads dividing the 6 heads"):
        torch.compile(lambda *a: opforge.attention_decode(*a), fullgraph=True)(q, k, v, torch.tensor([10]))


def test_autocast_runs_in_the_autocast_dtype():
    q, k, v = cache(b=2, h=4, hkv=2, n=2, s=60, d=16)
    lens = torch.tensor([60, 13])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = opforge.attention_decode(q, k, v, lens)
    assert out.dtype == torch.bfloat16
    low = [t.to(torch.bfloat16) for t in (q, k, v)]
    torch.testing.assert_close(out.double(), reference(*low, lens), **TOL[torch.bfloat16])


def test_meta_calls_check_and_shape_as_the_kernel():
    q, k, v = (torch.empty(2, 4, 3, 8, device="meta"), torch.empty(2, 2, 9, 8, device="meta"),
               torch.empty(2, 2, 9, 6, device="meta"))
    out = DEC(q, k, v, torch.empty(2, dtype=torch.int64, device="meta"))
    real = DEC(*cache(b=2, h=4, hkv=2, n=3, s=9, d=8, dv=6), torch.tensor([9, 1]))
    assert (out.shape, out.stride(), out.dtype) == (real.shape, real.stride(), real.dtype)
    with pytest.raises(RuntimeError, match=r"argument 'seq_lens' must have size\(0\) == q.size\(0\) = 2, got 3"):
        DEC(q, k, v, torch.empty(3, dtype=torch.int64, device="meta"))


def _bad(q=None, k=None, v=None, lens=None, scale=None, causal=False, **kw):
    q0, k0, v0 = cache(b=2, h=4, hkv=2, s=10, d=8)
    return lambda: DEC(q0 if q is None else q, k0 if k is None else k, v0 if v is None else v,
                       torch.tensor([10, 3]) if lens is None else lens, scale, causal)


@pytest.mark.parametrize(
    "call, pattern",
    [
        (_bad(lens=torch.tensor([11, 3])), r"\[opforge::attention_decode\] argument 'seq_lens' must be in \[0, 10\] \(the max length of 'k_cache'\), got 11 at 0"),
        (_bad(lens=torch.tensor([10, -1])), r"argument 'seq_lens' must be in \[0, 10\] .*got -1 at 1"),
        (_bad(lens=torch.tensor([10.0, 3.0])), r"argument 'seq_lens' must be int32 or int64, got float32"),
        (_bad(lens=torch.tensor([10, 3, 3])), r"argument 'seq_lens' must have size\(0\) == q.size\(0\) = 2, got 3 \(seq_lens: \[3\], q: \[2, 4, 1, 8\]\)"),
        (_bad(lens=torch.tensor([[10, 3]])), r"argument 'seq_lens' must have 1 dim \(batch,\), got 2: \[1, 2\]"),
        (_bad(k=torch.randn(2, 3, 10, 8), v=torch.randn(2, 3, 10, 8)), r"argument 'k_cache' must have a number of heads dividing the 4 heads of 'q' \(grouped-query attention\), got 3"),
        (_bad(k=torch.randn(2, 2, 10, 6)), r"argument 'k_cache' must have size\(3\) == q.size\(3\) = 8, got 6"),
        (_bad(v=torch.randn(2, 2, 12, 8)), r"argument 'v_cache' must have size\(2\) == k_cache.size\(2\) = 10, got 12"),
        (_bad(v=torch.randn(2, 1, 10, 8)), r"argument 'v_cache' must have size\(1\) == k_cache.size\(1\) = 2, got 1 \(v_cache: \[2, 1, 10, 8\], k_cache: \[2, 2, 10, 8\]\)"),
        (_bad(k=torch.randn(3, 2, 10, 8), v=torch.randn(3, 2, 10, 8)), r"\[opforge::attention_decode\] argument 'k_cache' must have size\(0\) == q.size\(0\) = 2, got 3"),
        (_bad(k=torch.randn(2, 2, 10, 8).double()), r"argument 'k_cache' must have the dtype of 'q' \(float32\), got float64"),
        (_bad(q=torch.randn(2, 4, 8)), r"argument 'q' must have 4 dims \(batch, heads, new tokens, head_dim\), got 3: \[2, 4, 8\]"),
        (_bad(q=torch.ones(2, 4, 1, 8, dtype=torch.int32)), r"argument 'q' must be a floating-point tensor"),
        (_bad(scale=float("nan")), r"argument 'scale' must be a finite float32 number"),
    ],
)
def test_bad_input(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()


def test_profiler_name():
    q, k, v = cache(b=1, s=10)
    with torch.profiler.profile() as prof:
        opforge.attention_decode(q, k, v, torch.tensor([10]))
    assert any(e.name == "opforge::attention_decode" for e in prof.events())


# ---- what the generic tests run of this op (tests/python/discover.py) ------------------------------------

# fuzz.py: random caches and lengths near the blocks and chunks, layouts, dtypes, ISAs and threads, against
# float64 torch

DECODE_MARKS = (1, 7, 63, 64, 65, 255, 256, 257, 512, 1024, 4097)  # 64-key blocks, 256-key chunks


def _fuzz_draw(rng, c):
    c["b"] = rng.choice((1, 1, 2, 3, 5)) if rng.random() > 0.02 else 0
    c["hkv"] = rng.choice((1, 1, 2, 3, 8))
    c["h"] = c["hkv"] * rng.choice((1, 2, 4, 8))
    c["n"] = rng.choice((1, 1, 1, 2, 4, 16, rng.randint(1, 16)))
    c["s"] = fuzz.dim(rng, 8192, DECODE_MARKS, zero=0.02)
    # each row's length: 0, full, or anywhere (near a chunk or block edge now and then)
    c["lens"] = [rng.choice((0, c["s"], rng.randint(0, c["s"]), min(c["s"], max(0, fuzz.near(rng, rng.choice(DECODE_MARKS))))))
                 for _ in range(c["b"])]
    c["lens_dtype"] = rng.choice(("int32", "int64"))
    c["d"] = rng.choice(HEAD_DIMS) if rng.random() < 0.7 else rng.randint(1, 160)
    c["dv"] = c["d"] if rng.random() < 0.7 else rng.choice(HEAD_DIMS)
    c["causal"] = rng.random() < 0.4
    c["scale"] = None if rng.random() < 0.6 else rng.choice((0.3, 1.0, round(rng.uniform(0.01, 2.0), 4), -0.5))
    c["q_layout"] = fuzz.layout(rng, [c["b"], c["h"], c["n"], c["d"]])
    c["k_layout"] = fuzz.layout(rng, [c["b"], c["hkv"], c["s"], c["d"]])
    c["v_layout"] = fuzz.layout(rng, [c["b"], c["hkv"], c["s"], c["dv"]])
    area = c["b"] * c["h"] * c["n"] * c["s"]
    flops = 2.0 * area * (c["d"] + c["dv"])
    return fuzz.seconds(c, flops, 3 * flops, area * 15 + c["b"] * c["hkv"] * c["s"] * (c["d"] + c["dv"]) * 3)


def _fuzz_describe(c):
    lay = "".join(f" {t}{fuzz.layout_str(c[t + '_layout'])}" for t in "qkv" if c[t + "_layout"])
    return (f"B={c['b']} H={c['h']} Hkv={c['hkv']} N={c['n']} S_max={c['s']} D={c['d']} Dv={c['dv']} "
            f"seq_lens={c['lens']} ({c['lens_dtype']}) causal={c['causal']} scale={c['scale']}{lay}")


def _fuzz_check(c, gen, dtype, dt, call):
    shapes = {"q": (c["h"], c["n"], c["d"]), "k": (c["hkv"], c["s"], c["d"]), "v": (c["hkv"], c["s"], c["dv"])}
    t = {}
    for name, (h, length, d) in shapes.items():
        base, view = fuzz.make(gen, [c["b"], h, length, d], dtype, c[name + "_layout"])
        t[name] = view(base)
    lens = torch.tensor(c["lens"], dtype=getattr(torch, c["lens_dtype"])).reshape(c["b"])
    with torch.no_grad():
        out = call(lambda: opforge.attention_decode(t["q"], t["k"], t["v"], lens, c["scale"], c["causal"]))
    # keys j < lim: seq_lens[b], less N - 1 - i for query i under the bottom-right causal mask
    lim = lens.to(torch.int64).view(-1, 1, 1, 1)
    if c["causal"]:
        lim = lim - c["n"] + 1 + torch.arange(c["n"]).view(1, 1, -1, 1)
    keep = torch.arange(c["s"]).view(1, 1, 1, -1) < lim
    scale = c["scale"] if c["scale"] is not None else 1.0 / math.sqrt(c["d"]) if c["d"] else 1.0
    if c["dtype"] != "float64":
        scale = float(torch.tensor(scale, dtype=torch.float32))
    want, bound, _ = attention_reference(t["q"].double(), t["k"].double(), t["v"].double(), keep, False, scale,
                                         None, dt)
    return [fuzz.Check("out", out, want, bound, dtype)]


FUZZ = {
    # attention_decode.c, and attention's forward of N <= FWD_DECODE_MAX_N queries: P V in float32
    "attention_decode": fuzz.Op(_fuzz_draw, _fuzz_check, _fuzz_describe, weight=0.1, order=11,
                                rounded={("*", "*"): ()}),
}


# test_export.py: the op's part of the exported model


def _export(g, hidden, vocab, max_len, heads=2):
    def run(x, target, qkv):
        b, n, _ = x.shape
        q, k, v = (x @ qkv.T).view(b, n, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4)
        # the last query again, as a decoding step sees it: k and v as a cache of n keys per row
        return (opforge.attention_decode(q[:, :, -1:], k, v, (target >= 0).sum(1)),)

    return {"qkv": torch.randn(3 * hidden, hidden, generator=g) / hidden**0.5}, run


EXPORT = {"attention_decode": _export}


# test_training.py: autocast, checkpointing and determinism

TRAINING = {
    "attention_decode": training.Case(  # forward only (inference): a full cache, so the twin is plain SDPA
        ("attention_decode",),
        lambda dt, big: [training.randn(2, 4, 3, 32, dtype=dt)]
        + [training.randn(2, 2, 2000 if big else 13, 32, dtype=dt) for _ in range(2)]
        + [torch.full((2,), 2000 if big else 13, dtype=torch.int64)],
        (),
        lambda q, k, v, n: opforge.attention_decode(q, k, v, n),
        lambda q, k, v, n: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        autocast="lower"),
}


# test_thread_sweep.py: empty and tiny shapes at 1-64 threads


# (B, H, Hkv, N, S_max, D, Dv, seq_lens)
SWEEP_SHAPES = [(0, 4, 2, 1, 9, 8, 8, []), (2, 0, 0, 1, 9, 8, 8, [9, 3]), (2, 0, 2, 1, 9, 8, 8, [9, 3]),
          (2, 4, 2, 1, 0, 8, 8, [0, 0]), (2, 4, 2, 0, 9, 8, 8, [9, 3]), (1, 2, 2, 1, 5, 0, 4, [5]),
          (1, 2, 2, 1, 5, 4, 0, [5]), (1, 1, 1, 1, 1, 1, 1, [1]), (3, 4, 2, 1, 11, 8, 6, [11, 0, 5]),
          (2, 6, 2, 3, 70, 5, 7, [70, 3]), (2, 3, 3, 16, 17, 8, 8, [17, 16]), (1, 2, 1, 2, 130, 8, 8, [130]),
          (2, 4, 1, 5, 7, 3, 3, [2, 7]), (2, 8, 2, 2, 700, 16, 16, [700, 650])]


def _sweep_cases():
    cases = []
    for i, (b, h, hkv, n, s, d, dv, lens) in enumerate(SWEEP_SHAPES):
        for causal in (False, True):
            scale = 0.3 if d == 0 else None

            def make(dt, b=b, h=h, hkv=hkv, n=n, s=s, d=d, dv=dv, lens=lens, i=i):
                seq = torch.tensor(lens, dtype=torch.int64 if i % 2 else torch.int32)
                # the cache as a slice of a longer (B, S_buf, Hkv, D) buffer, read in place
                k = thread_sweep.randn((b, s + 3, hkv, d), 2).transpose(1, 2)[:, :, :s]
                return (thread_sweep.randn((b, h, n, d), 1).to(dt), k.to(dt), thread_sweep.randn((b, hkv, s, dv), 3).to(dt),
                        seq)

            def fn(q, k, v, seq, causal=causal, scale=scale):
                return (opforge.attention_decode(q, k, v, seq, scale, causal),)

            def ref(q, k, v, seq, causal=causal, scale=scale):
                n, s = q.shape[2], k.shape[2]
                limit = seq.to(torch.int64).view(-1, 1, 1, 1)
                if causal:
                    limit = limit - n + 1 + torch.arange(n).view(1, 1, n, 1)
                return (attention64(q, k, v, torch.arange(s) < limit, False, scale),)

            cases.append(thread_sweep.Case(f"attention_decode B={b} H={h} Hkv={hkv} N={n} S_max={s} D={d} Dv={dv} "
                                           f"lens={lens} causal={causal}", make, fn, ref))
    return cases


SWEEP = {"attention_decode": _sweep_cases}
