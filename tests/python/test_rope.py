"""rope against float64 PyTorch written with Hugging Face's formulas
(rotate_half, GPT-J's rotate_every_two): values per dtype, grouped-query heads,
partial rotary dims, position ids, strided (B, N, H, D) projections,
gradients, gradcheck, opcheck, torch.compile, autocast, threads, ISAs, errors,
and nn.RotaryEmbedding / apply_rotary_pos_emb against transformers' Llama.

Tolerances (against the float64 formula on the rounded inputs): those of
opforge.testing per dtype (float32 1e-6: two products and a sum; bfloat16 /
float16: one rounding of a float32 result), gradients GRAD_TOLERANCE_FACTOR
times looser."""

import subprocess
import sys

import pytest
import torch
from torch.library import opcheck

import fuzz
import opforge
import thread_sweep
import training
from opforge import functional as F
from opforge import references as refs
from opforge.testing import DTYPES, GRAD_TOLERANCE_FACTOR, assert_close, tolerance

OP = torch.ops.opforge.rope.default
BWD = torch.ops.opforge.rope_backward.default


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def hf_rope(q, k, cos, sin, interleaved=False):
    """Hugging Face's apply_rotary_pos_emb (cos / sin (B, N, R) or (N, R)), with partial rotary as in
    NeoX / Phi: the first R dims rotated, the rest passed through."""
    cos, sin = (cos[None] if cos.dim() == 2 else cos).unsqueeze(1), (sin[None] if sin.dim() == 2 else sin).unsqueeze(1)
    r = cos.shape[-1]
    rot = rotate_every_two if interleaved else rotate_half

    def apply(x):
        x_rot, x_pass = x[..., :r], x[..., r:]
        return torch.cat((x_rot * cos + rot(x_rot) * sin, x_pass), dim=-1)

    return apply(q), apply(k)


def cos_sin(n, r, dtype=torch.float64, interleaved=False, batch=None, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    pos = torch.arange(n, dtype=torch.float64)
    if batch is not None:  # per-sequence offsets, as with left padding
        pos = pos[None] + torch.arange(batch, dtype=torch.float64)[:, None] * 3
    freqs = pos[..., None] * inv
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def qk(b, hq, hk, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, n, d, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(b, hk, n, d, generator=g, dtype=torch.float64).to(dtype))


def check(got, want, dtype, what, grad=False):
    t = tolerance(dtype)
    if grad:
        t = {k: v * GRAD_TOLERANCE_FACTOR for k, v in t.items()}
    assert_close(got, want, dtype, what, **t)


CASES = [  # (B, Hq, Hk, N, D, R)
    (1, 1, 1, 1, 2, 2), (2, 4, 2, 7, 6, 4), (1, 8, 1, 33, 64, 64), (2, 4, 4, 7, 128, 96), (3, 6, 2, 33, 64, 32),
    (1, 2, 1, 7, 128, 128), (2, 2, 2, 5, 6, 0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_values_against_the_hf_formula(dtype, interleaved, case):
    b, hq, hk, n, d, r = case
    q, k = qk(b, hq, hk, n, d, dtype)
    cos, sin = cos_sin(n, r, dtype, interleaved, batch=b)
    oq, ok = F.rope(q, k, cos, sin, interleaved=interleaved)
    assert oq.shape == q.shape and ok.shape == k.shape and oq.dtype == dtype
    wq, wk = hf_rope(q.double(), k.double(), cos.double(), sin.double(), interleaved)
    check(oq, wq, dtype, "q")
    check(ok, wk, dtype, "k")
    if r < d:  # partial rotary: the rest passes through bit for bit
        assert torch.equal(oq[..., r:], q[..., r:]) and torch.equal(ok[..., r:], k[..., r:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cos_sin_layouts(dtype):
    q, k = qk(2, 4, 2, 9, 16, dtype)
    cos, sin = cos_sin(9, 16, dtype)
    want = F.rope(q, k, cos[None].expand(2, 9, 16), sin[None].expand(2, 9, 16))
    for c, s in [(cos, sin), (cos[None], sin[None]), (cos[None, None], sin[None, None]),
                 (cos[None].expand(2, 9, 16).unsqueeze(1), sin[None].expand(2, 9, 16).unsqueeze(1)),
                 (cos.t().contiguous().t(), sin.t().contiguous().t())]:
        got = F.rope(q, k, c, s)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_position_ids_gather_rows_of_a_table(dtype, interleaved):
    q, k = qk(2, 4, 2, 7, 32, dtype)
    cos, sin = cos_sin(50, 24, dtype, interleaved)
    pos = torch.randint(0, 50, (2, 7))
    oq, ok = F.rope(q, k, cos, sin, pos, interleaved)
    wq, wk = hf_rope(q.double(), k.double(), cos[pos].double(), sin[pos].double(), interleaved)
    check(oq, wq, dtype, "q")
    check(ok, wk, dtype, "k")
    one = F.rope(q, k, cos, sin, pos[:1], interleaved)  # (1, N) broadcasts over the batch
    wq1, _ = hf_rope(q.double(), k.double(), cos[pos[:1]].double(), sin[pos[:1]].double(), interleaved)
    check(one[0], wq1, dtype, "q, (1, N) positions")


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_projection_read_in_place_and_layout_kept(dtype):
    b, n, hq, hk, d = 2, 11, 4, 2, 64
    qkv = torch.randn(b, n, (hq + 2 * hk) * d, dtype=torch.float64).to(dtype)
    q = qkv[..., : hq * d].view(b, n, hq, d).transpose(1, 2)  # not dense: a slice of the fused projection
    k = qkv[..., hq * d : (hq + hk) * d].view(b, n, hk, d).transpose(1, 2)
    cos, sin = cos_sin(n, d, dtype)
    oq, ok = F.rope(q, k, cos, sin)
    wq, wk = hf_rope(q.double(), k.double(), cos.double(), sin.double())
    check(oq, wq, dtype, "q")
    check(ok, wk, dtype, "k")
    dense_q = torch.randn(b, n, hq, d, dtype=dtype).transpose(1, 2)  # dense: its (B, N, H, D) layout is kept
    oq2, _ = F.rope(dense_q, k, cos, sin)
    assert oq2.stride() == dense_q.stride()
    check(oq2, hf_rope(dense_q.double(), k.double(), cos.double(), sin.double())[0], dtype, "dense q")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_gradients_match_autograd_of_the_formula(dtype, interleaved):
    q, k = (t.requires_grad_() for t in qk(2, 4, 2, 7, 64, dtype, seed=1))
    cos, sin = cos_sin(7, 48, dtype, interleaved)
    gq, gk = torch.randn(q.shape, dtype=dtype), torch.randn(k.shape, dtype=dtype)
    oq, ok = F.rope(q, k, cos, sin, interleaved=interleaved)
    torch.autograd.backward((oq, ok), (gq, gk))
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    torch.autograd.backward(hf_rope(q64, k64, cos.double(), sin.double(), interleaved), (gq.double(), gk.double()))
    check(q.grad, q64.grad, dtype, "dq", grad=True)
    check(k.grad, k64.grad, dtype, "dk", grad=True)


def test_backward_is_the_inverse_rotation():
    q, k = qk(1, 2, 1, 5, 16, torch.float64)
    cos, sin = cos_sin(5, 16)
    oq, ok = F.rope(q, k, cos, sin)
    back = BWD(oq, ok, cos, sin, None, False)
    torch.testing.assert_close(back[0], q)
    torch.testing.assert_close(back[1], k)


def test_gradient_of_q_alone():
    q, k = (t.requires_grad_() for t in qk(1, 2, 1, 5, 8, torch.float64))
    cos, sin = cos_sin(5, 8)
    F.rope(q, k, cos, sin)[0].sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))
    q2 = q.detach().clone().requires_grad_()
    hf_rope(q2, k.detach(), cos, sin)[0].sum().backward()
    torch.testing.assert_close(q.grad, q2.grad)


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_float64(interleaved):
    q, k = (t.requires_grad_() for t in qk(2, 2, 1, 5, 10, torch.float64, seed=2))
    cos, sin = cos_sin(5, 6, interleaved=interleaved)
    assert torch.autograd.gradcheck(lambda a, b: F.rope(a, b, cos, sin, interleaved=interleaved), (q, k))
    pos = torch.tensor([[4, 0, 2, 2, 1]])
    tc, ts = cos_sin(6, 10, interleaved=interleaved)
    qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: F.rope(a, b, tc, ts, pos, interleaved), (qt, k))


def _opcheck_samples():
    q, k = qk(2, 4, 2, 7, 16, torch.float32)
    cos, sin = cos_sin(7, 12, torch.float32)
    tc, ts = cos_sin(9, 16, torch.float32, interleaved=True)
    pos = torch.randint(0, 9, (2, 7))
    qt = torch.randn(2, 7, 4, 16).transpose(1, 2)
    return {"plain": (q, k, cos, sin, None, False), "table": (q, k, tc, ts, pos, True),
            "transposed": (qt, k, cos[None], sin[None], None, False),
            "empty": (q[:, :, :0], k[:, :, :0], cos[:0], sin[:0], None, False)}


@pytest.mark.parametrize("name", list(_opcheck_samples()))
def test_opcheck(name):
    q, k, cos, sin, pos, inter = _opcheck_samples()[name]
    opcheck(OP, (q, k, cos, sin, pos, inter))
    opcheck(OP, (q.clone().requires_grad_(), k.clone().requires_grad_(), cos, sin, pos, inter))
    opcheck(BWD, (torch.randn(q.shape), torch.randn(k.shape), cos, sin, pos, inter))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(dynamic):
    def f(q, k, cos, sin):
        oq, ok = F.rope(q, k, cos, sin)
        return (oq.sin().sum(-1) + ok.cos().sum(-1).repeat_interleave(2, 1)).sum()

    def eager(q, k, cos, sin):
        oq, ok = hf_rope(q, k, cos, sin)
        return (oq.sin().sum(-1) + ok.cos().sum(-1).repeat_interleave(2, 1)).sum()

    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    for n in (16, 33):
        q, k = (t.requires_grad_() for t in qk(2, 4, 2, n, 32, torch.float32))
        cos, sin = cos_sin(n, 32, torch.float32)
        q2, k2 = (t.detach().clone().requires_grad_() for t in (q, k))
        y, y2 = compiled(q, k, cos, sin), eager(q2, k2, cos, sin)
        y.backward()
        y2.backward()
        torch.testing.assert_close(y, y2, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(q.grad, q2.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k.grad, k2.grad, atol=1e-5, rtol=1e-5)


def test_compile_with_position_ids_dynamic():
    f = torch.compile(lambda q, k, c, s, p: F.rope(q, k, c, s, p, True), fullgraph=True, dynamic=True)
    for n in (5, 9):
        q, k = qk(1, 2, 1, n, 8, torch.float32)
        c, s = cos_sin(12, 8, torch.float32, interleaved=True)
        pos = torch.randint(0, 12, (1, n))
        got, want = f(q, k, c, s, pos), hf_rope(q, k, c[pos], s[pos], True)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_follows_the_widest_input_as_eager(dtype):
    # policy promote: 16-bit q, k (projection outputs under autocast) with float32 cos / sin, as Hugging Face's
    # Llama makes them under autocast, give float32, as eager q * cos + rotate_half(q) * sin does
    q, k = (t.to(dtype).requires_grad_() for t in qk(2, 4, 2, 7, 32, torch.float32))
    cos, sin = cos_sin(7, 32, torch.float32)
    with torch.autocast("cpu", dtype=dtype):
        oq, ok = F.rope(q, k, cos, sin)
        cq, ck = torch.compile(lambda *a: F.rope(*a), fullgraph=True)(q, k, cos, sin)
        lq, _ = F.rope(q, k, cos.to(dtype), sin.to(dtype))
    assert oq.dtype == ok.dtype == cq.dtype == hf_rope(q, k, cos, sin)[0].dtype == torch.float32
    assert lq.dtype == dtype
    ref = [t.detach().double() for t in (q, k, cos, sin)]
    check(oq, hf_rope(*ref)[0], torch.float32, "autocast q")
    torch.testing.assert_close(oq, cq)
    (oq.sum() + ok.sum()).backward()
    assert q.grad.dtype == dtype and k.grad.dtype == dtype


def test_same_bits_on_one_and_two_threads():
    code = (
        "import torch, opforge; from opforge import functional as F\n"
        "g = torch.Generator().manual_seed(0)\n"
        "q = torch.randn(2, 8, 257, 64, generator=g, requires_grad=True); k = torch.randn(2, 2, 257, 64, generator=g)\n"
        "c, s = torch.randn(257, 48, generator=g), torch.randn(257, 48, generator=g)\n"
        "oq, ok = F.rope(q, k, c, s); oq.backward(torch.randn(oq.shape, generator=g))\n"
        "torch.save((oq.detach(), ok, q.grad), '{path}')\n"
    )
    outs = []
    for n in (1, 2):
        path = f"/tmp/opforge_rope_threads_{n}.pt"
        r = subprocess.run([sys.executable, "-c", f"import torch; torch.set_num_threads({n})\n" + code.format(path=path)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        outs.append(torch.load(path))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_isa_matches_the_reference_bitwise(dtype):
    q, k = qk(2, 4, 2, 9, 72, dtype)
    cos, sin = cos_sin(9, 58, dtype)
    results = {}
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            results[isa] = (*OP(q, k, cos, sin, None, False), *OP(q, k, cos, sin, None, True),
                            *BWD(q, k, cos, sin, None, False), *BWD(q, k, cos, sin, None, True))
    finally:
        opforge.set_isa("auto")
    for isa, outs in results.items():
        for got, want in zip(outs, results["ref"]):
            # no FMA anywhere: every variant rounds as the reference does
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{isa} vs ref")


# ---- nn.RotaryEmbedding and apply_rotary_pos_emb against transformers ---------------------------------


def test_rotary_embedding_matches_llama():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, rope_theta=10000.0)
    hf = LlamaRotaryEmbedding(config)
    ours = opforge.nn.RotaryEmbedding(64, max_position_embeddings=512, base=10000.0)
    assert "inv_freq" not in ours.state_dict()  # non-persistent, as in Hugging Face
    torch.testing.assert_close(ours.inv_freq, hf.inv_freq)
    x = torch.randn(2, 9, 256)
    pos = torch.arange(3, 12)[None].expand(2, 9)
    cos, sin = ours(x, pos)
    hcos, hsin = hf(x, pos)
    torch.testing.assert_close(cos, hcos, rtol=0, atol=0)
    torch.testing.assert_close(sin, hsin, rtol=0, atol=0)
    q, k = qk(2, 4, 2, 9, 64, torch.float32)
    got = opforge.nn.apply_rotary_pos_emb(q, k, cos, sin)
    want = apply_rotary_pos_emb(q, k, hcos, hsin)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(ours.apply(q, k, cos, sin)[0], want[0])


# ---- bad input -----------------------------------------------------------------------------------------


def _args(**over):
    q, k = qk(2, 4, 2, 7, 16, torch.float32)
    cos, sin = cos_sin(7, 16, torch.float32)
    a = dict(q=q, k=k, cos=cos, sin=sin, position_ids=None, interleaved=False)
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over, pattern",
    [
        (dict(cos=cos_sin(7, 18, torch.float32)[0], sin=cos_sin(7, 18, torch.float32)[1]),
         r"\[opforge::rope\] argument 'cos' must have a rotary dim \(last size\) of at most the head_dim of 'q' "
         r"\(16\), got 18"),
        (dict(cos=torch.rand(7, 5), sin=torch.rand(7, 5)),
         r"\[opforge::rope\] argument 'cos' must have an even rotary dim \(last size\), got 5"),
        (dict(cos=torch.rand(8, 16), sin=torch.rand(8, 16)),
         r"\[opforge::rope\] argument 'cos' must have shape \(N, R\), \(B or 1, N, R\) or \(B or 1, 1, N, R\) with "
         r"B = 2 and N = 7 \(the sizes of 'q'\), got shape \[8, 16\]"),
        (dict(k=torch.rand(2, 2, 6, 16)),
         r"\[opforge::rope\] argument 'k' must have size\(2\) == q.size\(2\) = 7, got 6 \(k: \[2, 2, 6, 16\], "
         r"q: \[2, 4, 7, 16\]\)"),
        (dict(k=torch.rand(2, 2, 7, 8)), r"\[opforge::rope\] argument 'k' must have size\(3\) == q.size\(3\) = 16, got 8"),
        (dict(k=torch.rand(3, 2, 7, 16)), r"\[opforge::rope\] argument 'k' must have size\(0\) == q.size\(0\) = 2, got 3"),
        (dict(q=torch.rand(4, 7, 16)), r"\[opforge::rope\] argument 'q' must have 4 dims \(batch, heads, length, head_dim\), got 3: \[4, 7, 16\]"),
        (dict(q=torch.ones(2, 4, 7, 16, dtype=torch.int64)),
         r"\[opforge::rope\] argument 'q' must be a floating-point tensor .*got int64"),
        (dict(cos=torch.rand(7, 16, dtype=torch.float64)),
         r"\[opforge::rope\] argument 'cos' must have the dtype of 'q' \(float32\), got float64"),
        (dict(sin=torch.rand(7, 12)), r"\[opforge::rope\] argument 'sin' must have the shape of 'cos' \[7, 16\], got \[7, 12\]"),
        (dict(position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 7]])),
         r"\[opforge::rope\] argument 'position_ids' must lie in \[0, 7\) \(the rows of 'cos'\), got 7 at \[0, 6\]"),
        (dict(position_ids=torch.tensor([[0, 1, 2, -1, 4, 5, 6]] * 2)),
         r"\[opforge::rope\] argument 'position_ids' must lie in \[0, 7\) .*got -1 at \[0, 3\]"),
        (dict(position_ids=torch.zeros(2, 7, dtype=torch.int32)),
         r"\[opforge::rope\] argument 'position_ids' must be an int64 tensor, got int32"),
        (dict(position_ids=torch.zeros(2, 6, dtype=torch.int64)),
         r"\[opforge::rope\] argument 'position_ids' must have shape \(B or 1, N\) with B = 2 and N = 7, got \[2, 6\]"),
        (dict(position_ids=torch.zeros(2, 7, dtype=torch.int64), cos=torch.rand(1, 7, 16), sin=torch.rand(1, 7, 16)),
         r"\[opforge::rope\] argument 'cos' must have 2 dims \(positions, rotary_dim\) when position_ids is given, "
         r"got 3: \[1, 7, 16\]"),
        (dict(cos=torch.rand(7, 16, requires_grad=True)),
         r"\[opforge::rope\] arguments 'cos' and 'sin' must not require grad"),
    ],
)
def test_errors_name_op_argument_expected_and_got(over, pattern):
    a = _args(**over)
    with pytest.raises(RuntimeError, match=pattern):
        F.rope(**a)


def test_out_of_range_position_writes_nothing_and_compile_refuses_it():
    a = _args(position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 9]]))
    with pytest.raises(RuntimeError, match=r"argument 'position_ids' must lie in \[0, 7\)"):
        torch.compile(lambda **kw: F.rope(**kw), fullgraph=True)(**a)
    with pytest.raises(RuntimeError, match=r"\[opforge::rope_backward\] argument 'grad_k' must have size\(3\) == grad_q.size\(3\) = 16"):
        BWD(torch.rand(2, 4, 7, 16), torch.rand(2, 2, 7, 8), a["cos"], a["sin"], None, False)


# ---- what the generic tests run of this op (tests/python/discover.py) ------------------------------------

# fuzz.py: random heads, lengths and rotary dims, cos / sin layouts and position ids, layouts, dtypes, ISAs and
# threads, against float64 torch

ROPE_LENGTHS = (1, 8, 16, 32, 63, 64, 65, 128, 192, 256, 512, 1024)  # around the 64-row blocks of attention
HEAD_DIMS = (1, 7, 8, 16, 31, 32, 33, 40, 64, 80, 96, 128, 129, 256)


def _fuzz_draw(rng, c):
    c["b"] = rng.choice((1, 1, 2, 3))
    c["hq"] = rng.choice((1, 2, 4, 5, 8))
    c["hk"] = rng.choice((1, c["hq"], max(1, c["hq"] // 2)))
    c["n"] = fuzz.dim(rng, 1024, ROPE_LENGTHS, zero=0.02)
    c["d"] = rng.choice(HEAD_DIMS) if rng.random() < 0.7 else rng.randint(1, 160)
    c["r"] = c["d"] - c["d"] % 2 if rng.random() < 0.6 else 2 * rng.randint(0, c["d"] // 2)
    c["interleaved"] = rng.random() < 0.3
    c["cos"] = rng.choice(("2d", "3d", "3d-batch", "4d", "table"))
    c["q_layout"] = fuzz.layout(rng, [c["b"], c["hq"], c["n"], c["d"]])
    c["k_layout"] = fuzz.layout(rng, [c["b"], c["hk"], c["n"], c["d"]])
    c["grad"] = rng.random() < 0.5
    return fuzz.seconds(c, 0, 0, c["b"] * (c["hq"] + c["hk"]) * c["n"] * c["d"] * 40)


def _fuzz_describe(c):
    return (f"B={c['b']} Hq={c['hq']} Hk={c['hk']} N={c['n']} D={c['d']} R={c['r']} "
            f"interleaved={c['interleaved']} cos={c['cos']} q{fuzz.layout_str(c['q_layout'])} "
            f"k{fuzz.layout_str(c['k_layout'])} grad={c['grad']}")


def _fuzz_check(c, gen, dtype, dt, call):
    b, n, d, r = c["b"], c["n"], c["d"], c["r"]
    qbase, qview = fuzz.make(gen, [b, c["hq"], n, d], dtype, c["q_layout"])
    kbase, kview = fuzz.make(gen, [b, c["hk"], n, d], dtype, c["k_layout"])
    for t in (qbase, kbase):
        t.requires_grad_(c["grad"])
    q, k = qview(qbase), kview(kbase)
    rows = n + 5 if c["cos"] == "table" else n
    theta = torch.rand(b if c["cos"] == "3d-batch" else 1, rows, r, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = theta.cos().to(dtype), theta.sin().to(dtype)
    pos = None
    if c["cos"] == "table":
        cos, sin = cos[0], sin[0]
        pos = torch.randint(0, rows, (_rng_batch(gen, b), n), generator=gen)
    elif c["cos"] == "2d":
        cos, sin = cos[0], sin[0]
    elif c["cos"] == "4d":
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    gq, gk = fuzz.random_tensor(gen, q.shape, dtype), fuzz.random_tensor(gen, k.shape, dtype)

    def forward_backward():
        oq, ok = opforge.functional.rope(q, k, cos, sin, pos, c["interleaved"])
        return (oq, ok), (torch.autograd.grad((oq, ok), (q, k), (gq, gk)) if c["grad"] else None)

    if c["grad"]:
        (oq, ok), grads = call(forward_backward)
    else:
        with torch.no_grad():
            (oq, ok), grads = call(forward_backward)
    c64, s64 = cos.double(), sin.double()
    q64, k64 = q.detach().double(), k.detach().double()
    u = fuzz.U_ACC[dt]
    # two products and a sum in the compute precision: within 2u of |x cos| + |rot(x) sin| <= 2 max|x|
    # (|cos|, |sin| <= 1 here)
    wq, wk = refs.rope(q64, k64, c64, s64, pos, c["interleaved"])
    scale_q = q64.abs().amax(-1, keepdim=True) * 2
    scale_k = k64.abs().amax(-1, keepdim=True) * 2
    checks = [fuzz.Check("q_out", oq, wq, 2 * u * scale_q + fuzz.out_tol(wq, dt), dtype),
              fuzz.Check("k_out", ok, wk, 2 * u * scale_k + fuzz.out_tol(wk, dt), dtype)]
    if c["grad"]:
        dq, dk = refs.rope_backward(gq.double(), gk.double(), c64, s64, pos, c["interleaved"])
        sq, sk = gq.double().abs().amax(-1, keepdim=True) * 2, gk.double().abs().amax(-1, keepdim=True) * 2
        checks += [fuzz.Check("dq", grads[0], dq, 2 * u * sq + fuzz.out_tol(dq, dt), dtype),
                   fuzz.Check("dk", grads[1], dk, 2 * u * sk + fuzz.out_tol(dk, dt), dtype)]
    return checks


def _rng_batch(gen: torch.Generator, b: int) -> int:
    """Position ids of one row (broadcast over the batch) or of every sequence."""
    return 1 if int(torch.randint(0, 2, (1,), generator=gen)) else b


FUZZ = {
    # rope.h: float32 from the 16-bit inputs to the rounded results
    "rope": fuzz.Op(_fuzz_draw, _fuzz_check, _fuzz_describe, weight=0.15, order=6, rounded={("*", "*"): ()}),
}


# test_export.py: the op's part of the exported model


def _export(g, hidden, vocab, max_len, heads=2):
    d = hidden // heads
    pos = torch.arange(max_len, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
    tensors = {"cos": torch.cat([pos.cos(), pos.cos()], -1), "sin": torch.cat([pos.sin(), pos.sin()], -1),
               "qk": torch.randn(2 * hidden, hidden, generator=g) / hidden**0.5}

    def run(x, target, cos, sin, qk):
        b, n, _ = x.shape
        q, k = (x @ qk.T).view(b, n, 2, heads, d).permute(2, 0, 3, 1, 4)
        return F.rope(q, k, cos[:n], sin[:n])

    return tensors, run


EXPORT = {"rope": _export}


# test_training.py: autocast, checkpointing and determinism


def _hf_rope(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


TRAINING = {
    "rope": training.Case(
        ("rope",),
        lambda dt, big: [training.randn(4 if big else 2, 4, 300 if big else 11, 16, dtype=dt),
                         training.randn(4 if big else 2, 2, 300 if big else 11, 16, dtype=dt),
                         *(f(torch.randn(300 if big else 11, 8).repeat(1, 2)).to(dt) for f in (torch.cos, torch.sin))],
        (0, 1),
        F.rope,
        _hf_rope,
        autocast="promote"),
}


# test_thread_sweep.py: empty and tiny shapes at 1-64 threads


# (B, Hq, Hk, N, D, R, cos layout): "nr" (N, R), "bnr" (B, N, R), "b1nr" (B, 1, N, R), "pos" a table of 5
# rows picked by position_ids (B, N), "pos1" a table of one row and position_ids (1, N)
SWEEP_SHAPES = [(0, 2, 1, 3, 4, 4, "nr"), (1, 0, 0, 3, 4, 4, "nr"), (1, 2, 0, 3, 4, 4, "bnr"), (1, 0, 2, 3, 4, 4, "pos"),
        (1, 2, 1, 0, 4, 4, "pos"), (1, 2, 1, 0, 4, 4, "b1nr"), (1, 2, 1, 3, 0, 0, "nr"), (1, 2, 1, 3, 5, 0, "nr"),
        (1, 1, 1, 1, 2, 2, "nr"), (1, 1, 1, 1, 2, 2, "pos1"), (2, 3, 1, 5, 7, 4, "bnr"), (2, 4, 2, 7, 10, 6, "pos"),
        (3, 2, 2, 17, 6, 6, "b1nr"), (2, 1, 3, 3, 9, 8, "pos1"), (2, 4, 2, 100, 32, 32, "pos")]


def _sweep_cases():
    cases = []
    for b, hq, hk, n, d, r, lay in SWEEP_SHAPES:
        for inter in (False, True):
            def make(dt, b=b, hq=hq, hk=hk, n=n, d=d, r=r, lay=lay, inter=inter):
                q, k = thread_sweep.randn((b, hq, n, d), 1).to(dt), thread_sweep.randn((b, hk, n, d), 2).to(dt)
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

            cases.append(thread_sweep.Case(f"rope B={b} Hq={hq} Hk={hk} N={n} D={d} R={r} {lay} interleaved={inter}",
                                           make, opforge.rope, refs.rope, grads=(0, 1)))
    return cases


SWEEP = {"rope": _sweep_cases}
