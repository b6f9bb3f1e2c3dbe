#!/usr/bin/env python3
"""Randomized differential test: opforge's ops against float64 PyTorch.

Each case is drawn from (seed, index) alone: an op (dispersion_correction;
rms_norm, add_rms_norm or layer_norm with or without weight, bias, offset and a gradient;
matmul, 2-d or batched 3-d; linear with each activation, bias or not,
recompute or not, inference, the raw op with its pre-activation, a backward
with or without a retained graph; scaled_dot_product_attention with causal,
bool or float masks broadcast from any shape, grouped-query heads, a scale,
dropout_p=0, a backward), its shapes, the layouts of its inputs (permuted,
sliced, stepped, expanded: read in place by the kernels), a dtype (float32,
bfloat16, float16, float64), an ISA of ``opforge.supported_isas()`` and a
thread count (1 or 2).

Shapes run from 0 to ~1500 a dim: log-uniform, or near the sizes where
opforge's plans change (GEMM register, cache and thread blocks, the 16-bit
slice depth, the 8 MiB row chunks of linear, attention's 64-row blocks, the
elementwise grain), with the total work of a case capped so a case takes a
fraction of a second.

Every output and gradient is checked element by element against a float64
reference on the same (rounded) inputs, within a bound that follows the
rounding: a sum of K products accumulated in precision u is within
u * c(K) * (|A| @ |B|) of the exact one, errors of a pre-activation or of the
scores carry through the activation's or softmax's derivative, and a 16-bit
result adds one rounding (an ulp of its type). What a kernel variant rounds to
16 bits on the way (attention's P and dS on avx512_bf16, a saved output the
backward reads, ...) is stated per (op, variant, dtype) in ROUNDED, and each
such rounding's error is carried into the bound as the sums' are. Garbage, a
dropped K slice, a wrong row chunk or NaN exceed it by orders of magnitude.

Cases run in child processes, so an abort or a segfault fails the case that
was running instead of ending the run; a case that crashes is re-run alone to
check that it reproduces. Children run with glibc's heap checks
(libc_malloc_debug, MALLOC_CHECK_=3: every free checks the block's bounds;
MALLOC_PERTURB_: fresh and freed memory is filled with a pattern) unless
--no-malloc-check or an ASan runtime is preloaded.

    python tests/python/fuzz.py --seconds 600          # a fresh seed until time is up
    python tests/python/fuzz.py --seed 7 --cases 500   # cases 0..499 of seed 7
    python tests/python/fuzz.py --seed 7 --case 42     # one case, in this process, in detail
    python tests/python/fuzz.py --seconds 300 --ops attention --dtypes bfloat16 --isas avx512_bf16
    # case 55 of seed 629 as drawn on a CPU with AMX, run under avx512_bf16 (its attention variant there)
    python tests/python/fuzz.py --seed 629 --case 55 --isas ref,avx2,avx512,avx512_bf16,amx --isa avx512_bf16

Without PYTHONPATH the script tests the opforge of this checkout (python/).
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import math
import os
import queue
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if __name__ == "__main__" and not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import opforge  # noqa: E402

# ---- where plans change (csrc/kernels/gemm*.c, csrc/torch/linear.c, attention.c, dispersion_correction.h) ----

# GEMM: register blocks MR x NR (ref 4x4, AVX2 6x16, AVX-512 12x32, AMX 32x32), row blocks MC (64, 120,
# 128; split into a multiple of the threads, and packed per worker from two blocks a thread), K slices
# KC (256, 384, 1024; 2048 bfloat16 pairs), column panels NC (1024, 3072)
GEMM_MARKS = (4, 6, 12, 16, 32, 48, 64, 96, 120, 128, 240, 256, 360, 384, 480, 512, 768, 1024, 1152, 1536, 2048, 3072)
# linear and 16-bit GEMMs over several K slices work in row chunks of ~8 MiB of float32: 2**21 / N rows, >= 64
CHUNK_FLOATS = 1 << 21
K_SLICES = (256, 384, 1024, 2048)
ATTN_MARKS = (1, 8, 16, 32, 63, 64, 65, 128, 192, 256, 512, 1024)  # 64-row query and key blocks
HEAD_DIMS = (1, 7, 8, 16, 31, 32, 33, 40, 64, 80, 96, 128, 129, 256)
DECODE_MARKS = (1, 7, 63, 64, 65, 255, 256, 257, 512, 1024, 4097)  # attention_decode: 64-key blocks, 256-key chunks
LCE_MARKS = (1, 7, 16, 64, 2047, 2048, 2049, 4097)  # linear_cross_entropy: 2048 x 2048 logits blocks
DC_MARKS = (7, 8, 15, 16, 17, 31, 32, 33, 64, 4097, 32767, 32768, 32769, 65536, 100000)  # vectors, the 32768 grain

ACTS = {
    "none": lambda t: t,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
DTYPE_WEIGHTS = {"float32": 0.45, "bfloat16": 0.2, "float16": 0.2, "float64": 0.15}

# Relative precision of the arithmetic (float32 for every type but float64); of one rounding to the
# result type, twice the largest relative rounding error for margin (bfloat16 keeps 8 significant bits,
# float16 11); and the spacing of the smallest results.
U_ACC = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-24, "float16": 2.0**-24}
U_OUT = {"float64": 2.0**-52, "float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
ATOL = {"float64": 1e-300, "float32": 1e-38, "bfloat16": 1e-38, "float16": 2.0**-24}
# vectorised exp, erf, tanh and sigmoid: a few ulps
C_FN = 64.0
# bounds on |act'| and |act''| (gelu' <= 1.13, silu' <= 1.1; gelu'' <= 0.8, silu'' <= 0.5)
ACT_L1, ACT_L2 = 1.25, 1.0


def c_sum(k: int) -> float:
    """Random rounding errors of a k-term float sum, in units of u times the sum of |terms|: they grow
    like sqrt(k) (blocked and vectorised sums, terms of both signs)."""
    return 4.0 * math.sqrt(k) + 8.0


def sum_err(u: float, k: int, abs_sum, exact):
    """A bound on the rounding error of a k-term sum in precision u, whose terms' absolute values sum to
    abs_sum and whose exact value is exact: random errors (c_sum), plus the drift of partial sums that
    grow steadily toward the result (terms of one sign, e.g. operands broadcast along the sum), whose
    roundings add up to about k / 2 times |exact|."""
    return u * (c_sum(k) * abs_sum + 0.5 * k * exact.abs())


# ---- what each kernel variant rounds --------------------------------------------------------------
#
# A 16-bit path reads its 16-bit inputs exactly (converted to float32, or multiplied as bfloat16 pairs,
# whose products float32 holds exactly), computes and sums in float32 (U_ACC) and rounds each result it
# returns once (U_OUT, _out_tol). ROUNDED states what else each kernel variant rounds to the 16-bit type:
# an intermediate before a product, a value saved for the backward. One rounding to nearest moves a
# value v by at most U16 |v|, or A16 where v is subnormal (float16's below 2**-14; the bfloat16 pair
# products flush bfloat16 subnormals, vdpbf16ps), and each checker carries that error through the rest of
# the computation into its bound, as it does the sums' own errors: a rounded P adds
# U16 sum_j |P_ij| |V_jd| to out[i, d], beside the product's u c(S) sum_j |P_ij| |V_jd|.
#
# Key: (op, variant, dtype) -> the names a checker asks `rounding` about. The variant is the one of the
# op's kernel family (FAMILY; opforge.kernel_variants()) that ran under the case's ISA, "*" any; the
# dtype a 16-bit type, "*" either; the most specific key wins. The ISA alone does not say it: amx runs
# attention's avx512_bf16 variant, avx512_bf16 the avx512 row kernels of softmax, norm, ... .
U16 = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
A16 = {"bfloat16": 2.0**-126, "float16": 2.0**-25}
FAMILY = {"matmul": "gemm", "linear": "gemm", "linear_cross_entropy": "gemm"}  # else the op's own name
GEMM_PAIRS = ("avx512bf16_12x32", "amx_32x32")  # gemm.h: ukernel_pairs
ROUNDED = {
    # gemm_f32x (gemm.c): float32 sums, over K slices too; the pair variants multiply two bfloat16
    # operands as they are
    ("matmul", "*", "*"): (),
    # linear (linear.c): the pre-activation as the forward keeps it (saved, or recomputed and rounded
    # as stored: gather_grad_f32); g' = grad act'(preact) rounded on the in-place backward (every
    # variant: bwd_in_place stores it over the donated preact) and, on the chunked one, by the pair
    # variants, which round a float32 operand beside a bfloat16 one (gemm.h gemm_f32x: dx = g' W,
    # dweight = g'^T x); dbias sums g' as the path holds it
    ("linear", "*", "*"): ("preact", "g'"),
    # attention (attention.c): delta = rowsum(dO o out) reads the saved 16-bit out (rows_in); S, P, dP,
    # dS float32 (mm: attention_ref.c, attention_avx2.c, attention_avx512.c)
    ("attention", "*", "*"): ("out",),
    # mm_bf16 = mm_avx512bf16 (attention_avx512.c) packs both operands of each product as bfloat16 pairs
    # (pack_a, pack_b: to nearest even): Q, K, V, dO exact; P before P V (forward) and P^T dO, dS before
    # dS K and dS^T Q; float32 softmax (l sums the unrounded P), sums and dQ, dK, dV
    ("attention", "avx512_bf16", "bfloat16"): ("out", "P", "dS"),
    # attention_decode.c, and attention's forward of N <= FWD_DECODE_MAX_N queries: P V in float32
    ("attention_decode", "*", "*"): (),
    # linear_cross_entropy.c run_f32: logits, lse and du in float32, gradients summed in float32 and
    # rounded once; with reduction mean or sum over one block (functional.LCE_BLOCK_FLOATS) the forward
    # makes them (rounded) and the backward scales them by the incoming gradient and rounds again
    # (lce_scale)
    ("linear_cross_entropy", "*", "*"): ("grads",),
    # ... and the pair variants round du beside the bfloat16 weight and hidden (dhidden = du W,
    # dweight = du^T hidden; dbias sums the float32 du)
    **{("linear_cross_entropy", v, "bfloat16"): ("grads", "du") for v in GEMM_PAIRS},
    # softmax.c: the backward reads the saved 16-bit y (softmax.h)
    ("softmax", "*", "*"): ("y",),
    # norm.h: add_rms_norm's s = x + residual rounded to x's dtype, y computed from it; rstd, mean saved
    # in float32, dweight and dbias summed in float32 and rounded once
    ("norm", "*", "*"): ("s",),
    # cross_entropy.c (lse saved in float64), glu.h (act recomputed from gate), rope.h, dispersion_correction.h:
    # float32 from the 16-bit inputs to the rounded results
    ("cross_entropy", "*", "*"): (),
    ("glu", "*", "*"): (),
    ("rope", "*", "*"): (),
    ("dispersion_correction", "*", "*"): (),
}
FWD_DECODE_MAX_N = 4  # attention.c: the forward of this few queries runs attention_decode's driver


def rounding(c: dict, what: str, op: str | None = None) -> float:
    """U16 of the case's dtype where the kernel variant that ran (c["variants"]) rounds `what` to it
    (ROUNDED), else 0."""
    dt, op = c["dtype"], op or c["op"]
    if dt not in U16:
        return 0.0
    variant = c["variants"][FAMILY.get(op, op)]
    for key in ((op, variant, dt), (op, variant, "*"), (op, "*", dt), (op, "*", "*")):
        if key in ROUNDED:
            return U16[dt] if what in ROUNDED[key] else 0.0
    raise KeyError(f"fuzz: ROUNDED states nothing for {op} ({variant}, {dt})")


def rounding_err(c: dict, what: str, value: torch.Tensor, op: str | None = None):
    """The error the rounding of `what` (exact value `value`) adds where the variant rounds it, else 0."""
    r = rounding(c, what, op)
    return r * value.abs() + A16[c["dtype"]] if r else torch.zeros_like(value)


# ---- drawing a case: plain Python random, so a case is the same on every run ----------------------


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi + 0.5)))))


def _near(rng: random.Random, mark: int) -> int:
    if rng.random() < 0.6:
        return mark + rng.randint(-2, 2)
    spread = max(1, mark // 8)
    return mark + rng.randint(-spread, spread)


def _dim(rng: random.Random, hi: int, marks=GEMM_MARKS, zero: float = 0.02) -> int:
    """A size: sometimes 0, sometimes tiny, log-uniform in [1, hi], uniform in [16, hi] (everyday
    sizes, where most plans pick between their block counts), or near a size where a plan changes (one
    of marks, or a multiple of 64)."""
    r = rng.random()
    if r < zero:
        return 0
    if r < 0.06:
        return rng.randint(1, 9)
    if r < 0.2:
        return _log_uniform(rng, 1, hi)
    if r < 0.65:
        return rng.randint(min(16, hi), hi)
    choices = [m for m in marks if m <= hi] + [64 * rng.randint(1, max(1, hi // 64))]
    return min(max(_near(rng, rng.choice(choices)), 1), hi)


def _chunk_rows(n: int) -> int:
    return max(64, CHUNK_FLOATS // n) if n > 0 else 1


def _gemm_dims(rng: random.Random, hi: int, wide: int, big: bool) -> tuple[int, int, int]:
    """(rows, columns, depth) of a product. Some (most of the big cases) are one or two row chunks of
    linear's backward and the 16-bit GEMMs (2**21 / n rows) and a last chunk of any size, with a depth
    just over a K slice: the last chunk's plan differs from the others', and a 16-bit result keeps
    float32 partial sums over the slices."""
    if rng.random() < (0.75 if big else 0.1):
        n = _log_uniform(rng, CHUNK_FLOATS // (2 * hi), wide) if rng.random() < 0.5 else \
            _near(rng, rng.choice([m for m in GEMM_MARKS if CHUNK_FLOATS // (2 * hi) <= m <= wide]))
        chunk = _chunk_rows(n)
        last = rng.randint(-2, 2) if rng.random() < 0.3 else max(_dim(rng, chunk - 1, zero=0.0), 1)
        m = max(1, chunk * rng.choice((1, 1, 2)) + last)
        k = rng.choice(K_SLICES) + rng.randint(1, 48) if rng.random() < 0.8 else _dim(rng, 2200)
        return m, n, k
    return _dim(rng, hi), _dim(rng, wide if rng.random() < 0.1 else hi), _dim(rng, 2200)


def _layout(rng: random.Random, shape, p_plain: float = 0.45, expand: bool = True):
    """How a tensor of `shape` is laid out: None (contiguous) or a view of a bigger base tensor, with its
    dims permuted (perm: the base's dim order), stepped (step) or offset within a padded dim (pad), or
    broadcast from size 1 (expand)."""
    nd = len(shape)
    if nd == 0 or rng.random() < p_plain:
        return None
    lay = {"perm": list(range(nd)), "step": [1] * nd, "pad": [0] * nd, "expand": []}
    if nd > 1 and rng.random() < 0.6:
        while lay["perm"] == list(range(nd)):
            rng.shuffle(lay["perm"])
    if rng.random() < 0.35:
        lay["step"][rng.randrange(nd)] = rng.choice((2, 3))
    if rng.random() < 0.35:
        lay["pad"][rng.randrange(nd)] = rng.randint(1, 5)
    wide = [d for d in range(nd) if shape[d] > 1]
    if expand and wide and rng.random() < 0.2:
        lay["expand"] = [rng.choice(wide)]
    return lay


def _layout_str(lay) -> str:
    if lay is None:
        return ""
    parts = []
    if lay["perm"] != sorted(lay["perm"]):
        parts.append("perm" + "".join(map(str, lay["perm"])))
    parts += [f"step{d}={s}" for d, s in enumerate(lay["step"]) if s != 1]
    parts += [f"pad{d}={p}" for d, p in enumerate(lay["pad"]) if p]
    parts += [f"expand{d}" for d in lay["expand"]]
    return "[" + ",".join(parts) + "]" if parts else ""


REF_RATE = 15e9  # flop/s of the references' float64 GEMMs
PASS_RATE = 1e8  # elements/s of their elementwise passes


def _seconds(c: dict, op_flops: float, ref_flops: float, passes: float) -> float:
    """A rough time for a case on 2 AVX2 cores: opforge's flops (float64 and ref run scalar loops), the
    references' GEMMs and elementwise passes over float64 tensors."""
    rate = 1e9 if c["dtype"] == "float64" else 6e9 if c["isa"] == "ref" else 25e9
    return op_flops / rate + ref_flops / REF_RATE + passes / PASS_RATE


def _draw_matmul(rng, c):
    c["batch"] = rng.choice((0, 0, 1, 2, rng.randint(1, 6)))  # 0: 2-d
    hi = 1536
    m, n, k = _gemm_dims(rng, hi, 8192, c["big"])
    c["m"], c["k"], c["n"] = m, k, n
    lead = [c["batch"]] if c["batch"] else []
    c["a_layout"] = _layout(rng, lead + [m, k])
    c["b_layout"] = _layout(rng, lead + [k, n])
    b = max(c["batch"], 1)
    flops = 2.0 * b * m * n * k
    return _seconds(c, flops, 2 * flops, b * (10 * m * n + 3 * m * k + 3 * k * n))


def _draw_linear(rng, c):
    c["act"] = rng.choice(list(ACTS))
    c["bias"] = rng.random() < 0.7
    c["mode"] = rng.choice(("inference", "raw", "backward", "backward", "retain"))
    c["recompute"] = rng.random() < 0.4
    if c["mode"] in ("backward", "retain"):
        c["grads"] = rng.choice(("xwb", "xwb", "x", "wb", "w"))
    hi = 1536
    rows, n, k = _gemm_dims(rng, hi, 4096, c["big"])
    nlead = rng.choices((0, 1, 2, 3), (0.05, 0.6, 0.25, 0.1))[0]
    lead = [rng.choice((1, 2, 3, rng.randint(1, 9))) for _ in range(max(nlead - 1, 0))] + [rows] * (nlead > 0)
    c["x_shape"], c["n"] = lead + [k], n
    c["x_layout"] = _layout(rng, c["x_shape"])
    c["w_layout"] = _layout(rng, [n, k])
    # float64 takes a contiguous bias only (a documented limit)
    c["b_layout"] = _layout(rng, [n]) if c["bias"] and c["dtype"] != "float64" else None
    c["w_scale"] = rng.choice((1.0, 1.0 / math.sqrt(max(k, 1))))
    m = math.prod(lead)
    bwd = c["mode"] in ("backward", "retain")
    gemms = 1 + bwd * (3 + c["recompute"]) * (1 + (c["mode"] == "retain"))
    flops = 2.0 * m * n * k
    return _seconds(c, gemms * flops, (6 if bwd else 2) * flops, (40 if bwd else 12) * m * n + 4 * (m + n) * k)


def _draw_attention(rng, c):
    c["dims"] = rng.choice((4, 4, 4, 3))
    c["b"] = rng.choice((1, 1, 2, 3))
    if c["dims"] == 4:
        c["hkv"] = rng.choice((1, 1, 2, 3))
        c["h"] = c["hkv"] * rng.choice((1, 1, 2, 4))
    else:
        c["h"] = c["hkv"] = 1
    c["n"] = _dim(rng, 1536, ATTN_MARKS, zero=0.01)
    c["s"] = c["n"] if rng.random() < 0.4 else _dim(rng, 1536, ATTN_MARKS, zero=0.01)
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
        c["mask_layout"] = _layout(rng, c["mask_shape"], p_plain=0.7)
    c["scale"] = None if rng.random() < 0.6 else rng.choice((0.3, 1.0, round(rng.uniform(0.01, 2.0), 4), -0.5))
    c["grad"] = rng.random() < 0.5
    qkv = [("q", c["h"], c["n"], c["d"]), ("k", c["hkv"], c["s"], c["d"]), ("v", c["hkv"], c["s"], c["dv"])]
    for name, h, length, d in qkv:
        shape = [c["b"], h, length, d] if c["dims"] == 4 else [c["b"], length, d]
        c[name + "_layout"] = _layout(rng, shape)
    area = c["b"] * c["h"] * c["n"] * c["s"]
    flops = 2.0 * area * (c["d"] + c["dv"]) * (3.5 if c["grad"] else 1)
    return _seconds(c, flops, 3 * flops, area * (45 if c["grad"] else 15))


def _draw_dispersion(rng, c):
    nd = rng.choices((0, 1, 2, 3, 4), (0.05, 0.3, 0.35, 0.2, 0.1))[0]
    shape = []
    for _ in range(nd):
        shape.append(_dim(rng, 1 << 17 if nd == 1 else 1536 if nd == 2 else 96, DC_MARKS, zero=0.03))
    while math.prod(shape) > 4_000_000:
        shape[shape.index(max(shape))] //= 2
    c["shape"] = shape
    c["layout"] = _layout(rng, shape)
    c["alpha"] = rng.choice((0.8, 0.0, -1.5, 1e-3, round(rng.uniform(-3, 3), 5)))
    c["specials"] = rng.random() < 0.3  # 0, -0, negatives, inf, nan, subnormals among the inputs
    c["grad"] = rng.random() < 0.5
    return _seconds(c, 0, 0, math.prod(shape) * 30)


GLU_MARKS = (1, 7, 8, 15, 16, 17, 33, 123, 1408, 4097, 5632)  # vector widths, Llama MLP sizes


def _draw_glu(rng, c):
    c["act"] = rng.choice(("silu", "gelu", "gelu_tanh"))
    c["packed"] = rng.random() < 0.3  # one (..., 2F) tensor split by chunk: two strided views
    nd = rng.choices((1, 2, 3), (0.2, 0.5, 0.3))[0]
    shape = [_dim(rng, 64 if nd == 3 else 2048, DC_MARKS, zero=0.03) for _ in range(nd - 1)]
    shape.append(_dim(rng, 6000, GLU_MARKS, zero=0.03))
    while math.prod(shape) > 2_000_000:
        shape[shape.index(max(shape))] //= 2
    c["shape"] = shape
    full = shape[:-1] + [2 * shape[-1]]
    c["gate_layout"] = _layout(rng, full if c["packed"] else shape)
    c["up_layout"] = None if c["packed"] else _layout(rng, shape)
    c["grad"] = rng.random() < 0.5
    return _seconds(c, 0, 0, math.prod(shape) * 60)


def _draw_rope(rng, c):
    c["b"] = rng.choice((1, 1, 2, 3))
    c["hq"] = rng.choice((1, 2, 4, 5, 8))
    c["hk"] = rng.choice((1, c["hq"], max(1, c["hq"] // 2)))
    c["n"] = _dim(rng, 1024, ATTN_MARKS, zero=0.02)
    c["d"] = rng.choice(HEAD_DIMS) if rng.random() < 0.7 else rng.randint(1, 160)
    c["r"] = c["d"] - c["d"] % 2 if rng.random() < 0.6 else 2 * rng.randint(0, c["d"] // 2)
    c["interleaved"] = rng.random() < 0.3
    c["cos"] = rng.choice(("2d", "3d", "3d-batch", "4d", "table"))
    c["q_layout"] = _layout(rng, [c["b"], c["hq"], c["n"], c["d"]])
    c["k_layout"] = _layout(rng, [c["b"], c["hk"], c["n"], c["d"]])
    c["grad"] = rng.random() < 0.5
    return _seconds(c, 0, 0, c["b"] * (c["hq"] + c["hk"]) * c["n"] * c["d"] * 40)




SM_MARKS = (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 123, 4097, 32000)  # vectors, lane chunks, vocab


def _draw_softmax(rng, c):
    nd = rng.choices((1, 2, 3), (0.2, 0.55, 0.25))[0]
    c["dim"] = rng.randrange(-nd, nd)
    shape = [_dim(rng, 96 if nd == 3 else 300, SM_MARKS, zero=0.02) for _ in range(nd)]
    shape[c["dim"]] = _dim(rng, 32000, SM_MARKS, zero=0.02)
    while math.prod(shape) > 2_000_000:
        others = [d for d in range(nd) if d != c["dim"] % nd and shape[d] > 1]
        d = max(others, key=lambda d: shape[d]) if others else c["dim"]
        shape[d] //= 2
    c["shape"] = shape
    c["layout"] = _layout(rng, shape)
    c["log"] = rng.random() < 0.5
    c["specials"] = rng.random() < 0.3  # -inf entries, and now and then a line of -inf only
    c["grad"] = rng.random() < 0.6
    return _seconds(c, 0, 0, math.prod(shape) * 40)


def _draw_cross_entropy(rng, c):
    nlead = rng.choices((0, 1, 2), (0.1, 0.7, 0.2))[0]
    lead = [_dim(rng, 64 if nlead == 2 else 300, SM_MARKS[:13], zero=0.02) for _ in range(nlead)]
    classes = max(1, _dim(rng, 32000, SM_MARKS, zero=0.0))
    while math.prod(lead) * classes > 1_500_000:
        lead[lead.index(max(lead))] //= 2
    c["shape"] = lead + [classes]
    c["layout"] = _layout(rng, c["shape"], expand=False)
    c["weight"] = rng.random() < 0.4
    c["smoothing"] = rng.choice((0.0, 0.0, 0.1, 1.0, round(rng.uniform(0, 1), 3)))
    c["softcap"] = rng.choice((None, None, 30.0, 1.5))
    c["reduction"] = rng.choice(("mean", "sum", "none"))
    c["ignore"] = rng.choice((0.0, 0.0, 0.3, 1.0))  # share of rows whose target is ignore_index
    c["specials"] = rng.random() < 0.2
    c["grad"] = rng.random() < 0.7
    return _seconds(c, 0, 0, math.prod(c["shape"]) * 60)


def _draw_lce(rng, c):
    c["t"] = _dim(rng, 4200, LCE_MARKS, zero=0.03)
    c["h"] = rng.choice((1, 7, 16, 64, rng.randint(1, 300)))
    c["v"] = _dim(rng, 4200, LCE_MARKS, zero=0.0)
    c["reduction"] = rng.choice(("mean", "sum", "none"))
    c["bias"] = rng.random() < 0.5
    c["ignore"] = rng.choice((0.0, 0.0, 0.3, 1.0))  # share of ignored targets
    c["label_smoothing"] = rng.choice((0.0, 0.0, 0.1, 1.0))
    c["softcap"] = rng.choice((None, None, 30.0, 2.0))
    c["grad"] = rng.random() < 0.7
    c["h_layout"] = _layout(rng, [c["t"], c["h"]], expand=False)
    c["w_layout"] = _layout(rng, [c["v"], c["h"]], expand=False)
    flops = 2.0 * c["t"] * c["h"] * c["v"]
    return _seconds(c, flops * (4 if c["grad"] else 1), flops * (3 if c["grad"] else 1), 30 * c["t"] * c["v"])


def _draw_attention_decode(rng, c):
    c["b"] = rng.choice((1, 1, 2, 3, 5)) if rng.random() > 0.02 else 0
    c["hkv"] = rng.choice((1, 1, 2, 3, 8))
    c["h"] = c["hkv"] * rng.choice((1, 2, 4, 8))
    c["n"] = rng.choice((1, 1, 1, 2, 4, 16, rng.randint(1, 16)))
    c["s"] = _dim(rng, 8192, DECODE_MARKS, zero=0.02)
    # each row's length: 0, full, or anywhere (near a chunk or block edge now and then)
    c["lens"] = [rng.choice((0, c["s"], rng.randint(0, c["s"]), min(c["s"], max(0, _near(rng, rng.choice(DECODE_MARKS))))))
                 for _ in range(c["b"])]
    c["lens_dtype"] = rng.choice(("int32", "int64"))
    c["d"] = rng.choice(HEAD_DIMS) if rng.random() < 0.7 else rng.randint(1, 160)
    c["dv"] = c["d"] if rng.random() < 0.7 else rng.choice(HEAD_DIMS)
    c["causal"] = rng.random() < 0.4
    c["scale"] = None if rng.random() < 0.6 else rng.choice((0.3, 1.0, round(rng.uniform(0.01, 2.0), 4), -0.5))
    c["q_layout"] = _layout(rng, [c["b"], c["h"], c["n"], c["d"]])
    c["k_layout"] = _layout(rng, [c["b"], c["hkv"], c["s"], c["d"]])
    c["v_layout"] = _layout(rng, [c["b"], c["hkv"], c["s"], c["dv"]])
    area = c["b"] * c["h"] * c["n"] * c["s"]
    flops = 2.0 * area * (c["d"] + c["dv"])
    return _seconds(c, flops, 3 * flops, area * 15 + c["b"] * c["hkv"] * c["s"] * (c["d"] + c["dv"]) * 3)


DRAW = {"matmul": _draw_matmul, "linear": _draw_linear, "attention": _draw_attention,
        "dispersion_correction": _draw_dispersion, "glu": _draw_glu, "rope": _draw_rope, "softmax": _draw_softmax,
        "cross_entropy": _draw_cross_entropy, "linear_cross_entropy": _draw_lce,
        "attention_decode": _draw_attention_decode}
# the GEMM ops have the most plans (blocks, threads, slices, chunks, paths of the backward)
OP_WEIGHTS = {"matmul": 0.25, "linear": 0.45, "attention": 0.2, "dispersion_correction": 0.1, "glu": 0.15,
              "rope": 0.15, "softmax": 0.15, "cross_entropy": 0.15,
              "linear_cross_entropy": 0.1, "attention_decode": 0.1}  # norm's weight is set with its generator
# ops added after test_fuzz.py's seeds were chosen take LATER_SHARE of the cases from a stream of their
# own (weights among themselves), so every other case of a seed stays the case it was
LATER_OPS = ("glu", "rope", "norm", "softmax", "cross_entropy", "linear_cross_entropy", "attention_decode")
LATER_SHARE = 0.3
# estimated seconds a case may take: most cases are small; a fifth may be big, since a 16-bit GEMM over
# row chunks needs M * N >= 2**21 and K over a slice (>= 8e8 multiply-adds)
CASE_SECONDS, BIG_CASE_SECONDS, BIG_SHARE = 0.8, 2.5, 0.2


@dataclass(frozen=True)
class Selection:
    """Which cases a run draws: subsets of the ops and dtypes (None: all), the ISAs they are drawn from
    (None: this CPU's; another CPU's list draws its cases, one ISA forces it), and an ISA every case runs
    under whatever it drew (None: the drawn one), e.g. a case drawn on a CPU with AMX run here under
    avx512_bf16, whose attention kernels it picks there too."""
    ops: tuple | None = None
    dtypes: tuple | None = None
    isas: tuple | None = None
    isa: str | None = None

    def args(self) -> list:
        """The command-line options that select the same cases."""
        out = []
        for flag, names in (("--ops", self.ops), ("--dtypes", self.dtypes), ("--isas", self.isas)):
            out += [flag, ",".join(names)] if names else []
        return out + (["--isa", self.isa] if self.isa else [])


def draw(seed: int, index: int, sel: Selection = Selection()) -> dict:
    """Case `index` of `seed`: a dict of plain values (JSON), the same on every run with the same ISA
    list. Draws again (from the same stream) while its estimated time is over its budget."""
    ops, isas = sel.ops, sel.isas or opforge.supported_isas()
    dtypes = [dt for dt in DTYPES if sel.dtypes is None or dt in sel.dtypes]
    rng = random.Random(f"opforge-fuzz:{seed}:{index}")
    first = [op for op in OP_WEIGHTS if op not in LATER_OPS and (ops is None or op in ops)]
    later = [op for op in LATER_OPS if ops is None or op in ops]
    op = rng.choices(first, [OP_WEIGHTS[o] for o in first])[0] if first else None
    side = random.Random(f"opforge-fuzz-later:{seed}:{index}")
    if later and (op is None or side.random() < LATER_SHARE):
        op = side.choices(later, [OP_WEIGHTS[o] for o in later])[0]
    budget = BIG_CASE_SECONDS if rng.random() < BIG_SHARE else CASE_SECONDS
    for _ in range(500):
        c = {"seed": seed, "index": index, "op": op,
             "dtype": rng.choices(dtypes, [DTYPE_WEIGHTS[dt] for dt in dtypes])[0],
             "isa": rng.choice(list(isas)), "threads": rng.choice((1, 2)), "data_seed": rng.getrandbits(62),
             "big": budget > CASE_SECONDS}
        cost = DRAW[op](rng, c)
        if cost <= budget:
            c["estimate_s"] = round(cost, 4)
            c["isa"] = sel.isa or c["isa"]
            return c
    raise RuntimeError(f"fuzz: no case of {op} within {budget} s after 500 draws (seed {seed}, case {index})")


def describe(c: dict) -> str:
    head = f"{c['op']} {c['dtype']} isa={c['isa']} threads={c['threads']}"
    if c["op"] == "norm":
        return _describe_norm(head, c)
    if c["op"] == "matmul":
        lead = f"{c['batch']}," if c["batch"] else ""
        return (f"{head} a=({lead}{c['m']},{c['k']}){_layout_str(c['a_layout'])} "
                f"b=({lead}{c['k']},{c['n']}){_layout_str(c['b_layout'])}")
    if c["op"] == "linear":
        x = ",".join(map(str, c["x_shape"]))
        bias = f"({c['n']}){_layout_str(c['b_layout'])}" if c["bias"] else "None"
        grads = f" grads={c['grads']}" if "grads" in c else ""
        w = f"({c['n']},{c['x_shape'][-1]}){_layout_str(c['w_layout'])}"
        return (f"{head} x=({x}){_layout_str(c['x_layout'])} w={w} b={bias} act={c['act']} "
                f"recompute={c['recompute']} mode={c['mode']}{grads}")
    if c["op"] == "attention":
        mask = f" mask={c['mask']}{tuple(c['mask_shape'])}{_layout_str(c['mask_layout'])} keep={c['mask_keep']}" \
            if c["mask"] else ""
        lay = "".join(f" {t}{_layout_str(c[t + '_layout'])}" for t in "qkv" if c[t + "_layout"])
        return (f"{head} {c['dims']}-d B={c['b']} H={c['h']} Hkv={c['hkv']} N={c['n']} S={c['s']} D={c['d']} "
                f"Dv={c['dv']} causal={c['causal']} scale={c['scale']}{mask}{lay} grad={c['grad']}")
    if c["op"] == "attention_decode":
        lay = "".join(f" {t}{_layout_str(c[t + '_layout'])}" for t in "qkv" if c[t + "_layout"])
        return (f"{head} B={c['b']} H={c['h']} Hkv={c['hkv']} N={c['n']} S_max={c['s']} D={c['d']} Dv={c['dv']} "
                f"seq_lens={c['lens']} ({c['lens_dtype']}) causal={c['causal']} scale={c['scale']}{lay}")
    if c["op"] == "glu":
        up = "packed" if c["packed"] else f"up{_layout_str(c['up_layout'])}"
        return (f"{head} act={c['act']} shape={tuple(c['shape'])} gate{_layout_str(c['gate_layout'])} {up} "
                f"grad={c['grad']}")
    if c["op"] == "rope":
        return (f"{head} B={c['b']} Hq={c['hq']} Hk={c['hk']} N={c['n']} D={c['d']} R={c['r']} "
                f"interleaved={c['interleaved']} cos={c['cos']} q{_layout_str(c['q_layout'])} "
                f"k{_layout_str(c['k_layout'])} grad={c['grad']}")
    if c["op"] == "softmax":
        return (f"{head} {'log_softmax' if c['log'] else 'softmax'} x={tuple(c['shape'])}{_layout_str(c['layout'])} "
                f"dim={c['dim']} specials={c['specials']} grad={c['grad']}")
    if c["op"] == "cross_entropy":
        return (f"{head} logits={tuple(c['shape'])}{_layout_str(c['layout'])} weight={c['weight']} "
                f"smoothing={c['smoothing']} softcap={c['softcap']} reduction={c['reduction']} ignore={c['ignore']} "
                f"specials={c['specials']} grad={c['grad']}")
    if c["op"] == "linear_cross_entropy":
        return (f"{head} T={c['t']} H={c['h']} V={c['v']} hidden{_layout_str(c['h_layout'])} "
                f"weight{_layout_str(c['w_layout'])} reduction={c['reduction']} bias={c['bias']} "
                f"ignore={c['ignore']} label_smoothing={c['label_smoothing']} softcap={c['softcap']} grad={c['grad']}")
    return (f"{head} x={tuple(c['shape'])}{_layout_str(c['layout'])} alpha={c['alpha']} specials={c['specials']} "
            f"grad={c['grad']}")


# ---- inputs -----------------------------------------------------------------------------------------


def random_tensor(gen: torch.Generator, shape, dtype: torch.dtype, fill: str = "randn", scale: float = 1.0):
    """Normal (or uniform in [0, 4) for fill="rand") values, drawn in float32 (float64 for float64) and
    rounded to dtype: the references read the rounded values."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    if fill == "randn":
        return (torch.randn(shape, generator=gen, dtype=work) * scale).to(dtype)
    return (torch.rand(shape, generator=gen, dtype=work) * 4.0).to(dtype)


def make(gen: torch.Generator, shape, dtype: torch.dtype, lay, fill="randn", scale: float = 1.0):
    """(base, view): a random base tensor and the view of `shape` that lay describes (the base itself
    when lay is None). Gradients are taken with respect to the view."""
    shape = list(shape)
    nd = len(shape)
    if lay is None:
        base_sizes, perm = shape, list(range(nd))
    else:
        perm = lay["perm"]
        logical = [1 if d in lay["expand"] else shape[d] * lay["step"][d] + lay["pad"][d] for d in range(nd)]
        base_sizes = [logical[p] for p in perm]
    base = random_tensor(gen, base_sizes, dtype, fill, scale)

    def view(t):
        if lay is None:
            return t
        t = t.permute([perm.index(d) for d in range(nd)])
        index = tuple(slice(None) if d in lay["expand"]
                      else slice(lay["pad"][d], lay["pad"][d] + shape[d] * lay["step"][d], lay["step"][d])
                      for d in range(nd))
        return t[index].expand(shape)

    return base, view


# ---- checks -------------------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    got: torch.Tensor
    want: torch.Tensor  # float64
    bound: torch.Tensor  # float64, elementwise, broadcastable to want
    dtype: torch.dtype


def compare(ck: Check) -> tuple[str | None, float]:
    """(failure message or None, worst error / bound)."""
    got = ck.got.detach()
    if tuple(got.shape) != tuple(ck.want.shape):
        return f"{ck.name}: shape {tuple(got.shape)}, want {tuple(ck.want.shape)}", math.inf
    if got.dtype != ck.dtype:
        return f"{ck.name}: dtype {got.dtype}, want {ck.dtype}", math.inf
    if got.numel() == 0:
        return None, 0.0
    g, w = got.double(), ck.want
    bound = ck.bound.expand_as(w)
    err = (g - w).abs()
    ok = (err <= bound) | (g.isnan() & w.isnan()) | ((g == w) & w.isinf())
    # beyond the type's range: infinity, or its largest finite value when the exact result is that close
    over = w.to(ck.dtype).isinf() & w.isfinite()
    if bool(over.any()):
        big = torch.finfo(ck.dtype).max
        ok |= over & ((g == math.inf * w.sign()) | ((g == big * w.sign()) & (w.abs() - big <= bound)))
    ratio = torch.where(ok, (err / bound).nan_to_num(0.0, 0.0, 0.0), (err / bound).nan_to_num(math.inf, math.inf))
    worst = float(ratio.max())
    if bool(ok.all()):
        return None, worst
    bad = (~ok).nonzero()
    i = tuple(int(v) for v in torch.unravel_index(ratio.flatten().argmax(), ratio.shape))
    span = " x ".join(f"{int(bad[:, d].min())}..{int(bad[:, d].max())}" for d in range(bad.shape[1]))
    return (f"{ck.name}: {bad.shape[0]} of {w.numel()} elements beyond the bound (indices {span}); worst at "
            f"{list(i)}: got {g[i].item()!r}, want {w[i].item()!r}, error {err[i].item():.4g}, bound "
            f"{bound[i].item():.4g}"), worst


def _out_tol(t: torch.Tensor, dt: str) -> torch.Tensor:
    return U_OUT[dt] * t.abs() + ATOL[dt]


# ---- the ops and their references ---------------------------------------------------------------------


def _inputs(gen, specs):
    """[(view, base)] for [(shape, dtype, layout, fill, scale)]."""
    out = []
    for shape, dtype, lay, fill, scale in specs:
        base, view = make(gen, shape, dtype, lay, fill, scale)
        out.append((base, view))
    return out


def check_matmul(c, gen, dtype, dt, call):
    lead = [c["batch"]] if c["batch"] else []
    (ab, av), (bb, bv) = _inputs(gen, [(lead + [c["m"], c["k"]], dtype, c["a_layout"], "randn", 1.0),
                                       (lead + [c["k"], c["n"]], dtype, c["b_layout"], "randn", 1.0)])
    a, b = av(ab), bv(bb)
    out = call(lambda: opforge.matmul(a, b))
    a64, b64 = a.double(), b.double()
    want = a64 @ b64
    bound = sum_err(U_ACC[dt], c["k"], a64.abs() @ b64.abs(), want) + _out_tol(want, dt)
    return [Check("out", out, want, bound, dtype)]


def _act_grad(act: str, pre: torch.Tensor) -> torch.Tensor:
    p = pre.detach().clone().requires_grad_()
    ACTS[act](p).backward(torch.ones_like(p))
    return p.grad if p.grad is not None else torch.ones_like(p)


def check_linear(c, gen, dtype, dt, call):
    k, n, act = c["x_shape"][-1], c["n"], c["act"]
    grads = c.get("grads", "")
    specs = [(c["x_shape"], dtype, c["x_layout"], "randn", 1.0), ([n, k], dtype, c["w_layout"], "randn", c["w_scale"])]
    if c["bias"]:
        specs.append(([n], dtype, c["b_layout"], "randn", 1.0))
    inputs = _inputs(gen, specs)
    for (base, _), name in zip(inputs, "xwb"):
        base.requires_grad_(name in grads)
    x, w, b = [view(base) for base, view in inputs] + [None] * (3 - len(inputs))
    out_shape = list(c["x_shape"][:-1]) + [n]
    g = random_tensor(gen, out_shape, dtype)
    u = U_ACC[dt]
    r_pre, r_gp = rounding(c, "preact"), rounding(c, "g'")

    # references in float64 over the rows (M, K)
    m = math.prod(c["x_shape"][:-1])
    x64, w64 = x.detach().double().reshape(m, k), w.detach().double()
    b64 = b.detach().double() if b is not None else torch.zeros(n, dtype=torch.float64)
    pre = x64 @ w64.T + b64
    pre_err = sum_err(u, k + 1, x64.abs() @ w64.abs().T + b64.abs(), pre)
    out_want = ACTS[act](pre)
    fn_err = 0.0 if act in ("none", "relu") else C_FN * u
    out_bound = (ACT_L1 if act != "none" else 1.0) * pre_err + fn_err * pre.abs() + _out_tol(out_want, dt)
    checks = []
    shape_out = lambda t: t.reshape(out_shape)  # noqa: E731

    if c["mode"] == "inference":
        with torch.no_grad():
            out = call(lambda: opforge.linear(x, w, b, act, recompute=c["recompute"]))
        return [Check("out", out, shape_out(out_want), shape_out(out_bound), dtype)]
    if c["mode"] == "raw":
        code = opforge.functional.ACTIVATIONS[act]
        save = c["recompute"]  # reused as save_preact
        with torch.no_grad():
            out, pre_got = call(lambda: torch.ops.opforge.linear(x, w, b, code, save))
        checks.append(Check("out", out, shape_out(out_want), shape_out(out_bound), dtype))
        if code and save:
            checks.append(Check("preact", pre_got, shape_out(pre), shape_out(pre_err + _out_tol(pre, dt)), dtype))
        elif pre_got.numel() != 0:
            checks.append(Check("preact (empty)", pre_got, torch.zeros(0, dtype=torch.float64),
                                torch.zeros(0, dtype=torch.float64), dtype))
        return checks

    views = [t for t, name in ((x, "x"), (w, "w"), (b, "b")) if t is not None and name in grads]
    names = [name for t, name in ((x, "x"), (w, "w"), (b, "b")) if t is not None and name in grads]

    def forward_backward():
        y = opforge.linear(x, w, b, act, recompute=c["recompute"])
        first = torch.autograd.grad(y, views, g, retain_graph=c["mode"] == "retain")
        second = torch.autograd.grad(y, views, g) if c["mode"] == "retain" else None
        return y, first, second

    y, first, second = call(forward_backward)
    checks.append(Check("out", y, shape_out(out_want), shape_out(out_bound), dtype))
    # g' = g * act'(pre), from a pre-activation off by pre_err (and rounded where it is kept), and
    # rounded itself where the backward rounds it (ROUNDED); without an activation g' is g
    g64 = g.double().reshape(m, n)
    d1 = _act_grad(act, pre)
    gp = g64 * d1
    pre_off = pre_err + r_pre * pre.abs() + (A16[dt] if r_pre else 0.0)
    if act == "none":
        gp_err = torch.zeros_like(gp)
    else:
        gp_err = g64.abs() * (ACT_L2 * pre_off + C_FN * u) + (u + r_gp) * gp.abs() + (A16[dt] if r_gp else 0.0)
        if act == "relu":  # act' jumps at 0: a pre-activation within its error of 0 may go either way
            gp_err = torch.where(pre.abs() <= pre_off, g64.abs(), gp_err)
    # errors carried from g' and made by the sums (over n for dx, over the m rows for dweight and dbias)
    dx, dw, db = gp @ w64, gp.T @ x64, gp.sum(0)
    want = {
        "x": (dx, (gp_err + u * c_sum(n) * gp.abs()) @ w64.abs() + u * 0.5 * n * dx.abs()),
        "w": (dw, (gp_err + u * c_sum(m) * gp.abs()).T @ x64.abs() + u * 0.5 * m * dw.abs()),
        "b": (db, (gp_err + u * c_sum(m) * gp.abs()).sum(0) + u * 0.5 * m * db.abs()),
    }
    for name, got, view in zip(names, first, views):
        ref, err = want[name]
        ref, err = ref.reshape(view.shape), err.reshape(view.shape)
        checks.append(Check(f"d{name}", got, ref, err + _out_tol(ref, dt), dtype))
    # a retained graph's second backward (the first must leave the kept pre-activation as it was); not
    # bit for bit the first: it may take the in-place path, whose 16-bit g' is rounded to 16 bits
    for name, got, view in zip(names, second or (), views):
        ref, err = want[name]
        ref, err = ref.reshape(view.shape), err.reshape(view.shape)
        checks.append(Check(f"d{name} (second backward)", got, ref, err + _out_tol(ref, dt), dtype))
    return checks


def _attention_reference(q, k, v, mask, causal, scale, g, dt, r_pv=0.0, r_p=0.0, r_ds=0.0, r_out=0.0):
    """SDPA in float64 with error bounds: (out, out_bound, grads {q,k,v: (want, bound)} or None).

    Scores s = q k^T scale + mask are off by es <= u c(D) |q||k|^T |scale| (+ a rounding of the masked
    sum); softmax turns that into a relative error of each weight p_ij of es_ij + sum_j p_ij es_ij, plus
    the exp and the row sum's roundings. The backward (dv = p^T g, dp = g v^T, ds = p (dp - rowsum(g o)),
    dq = ds k scale, dk = ds^T q scale) carries those errors through each product. The kernel's own
    roundings (ROUNDED), relative: r_pv of P before the forward's P V, r_p of P before the backward's
    P^T dO, r_ds of dS before dS K and dS^T Q, r_out of the saved out that delta reads."""
    u = U_ACC[dt]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    n, s_len, d, dv = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    qk = q @ k.transpose(-2, -1)
    s = qk * scale
    es = sum_err(u, d, q.abs() @ k.abs().transpose(-2, -1), qk) * abs(scale)
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
    rel = es + (p * es).sum(-1, keepdim=True) + u * (C_FN + c_sum(s_len) + 0.5 * s_len)  # exp, the row sum
    dp_abs = p * rel  # |error| of each weight
    out = p @ v
    pv_abs = p @ v.abs()
    out_err = dp_abs @ v.abs() + sum_err(u, s_len, pv_abs, out) + r_pv * pv_abs
    out_bound = out_err + _out_tol(out, dt)
    if g is None:
        return out, out_bound, None
    gv = g @ v.transpose(-2, -1)
    egv = sum_err(u, dv, g.abs() @ v.abs().transpose(-2, -1), gv)
    dd = (g * out).sum(-1, keepdim=True)
    out_saved = out_err + r_out * out.abs() + (A16[dt] if r_out else 0.0)
    edd = (g.abs() * out_saved).sum(-1, keepdim=True) + sum_err(u, dv, (g.abs() * out.abs()).sum(-1, keepdim=True), dd)
    ds = p * (gv - dd)
    eds = dp_abs * (gv - dd).abs() + p * (egv + edd) + 4 * u * ds.abs()
    a_scale = abs(scale)

    def group(t):  # grouped-query heads: the gradient of a K/V head sums its query heads'
        return t.reshape(t.shape[0], t.shape[1] // rep, rep, *t.shape[2:]).sum(2) if rep > 1 else t

    dq = ds @ k
    dsk_abs = ds.abs() @ k.abs()
    dq_b = (eds @ k.abs() + sum_err(u, s_len, dsk_abs, dq) + r_ds * dsk_abs) * a_scale
    dq = dq * scale
    dk = ds.transpose(-2, -1) @ q
    dsq_abs = ds.abs().transpose(-2, -1) @ q.abs()
    dk_b = group((eds.transpose(-2, -1) @ q.abs() + sum_err(u, n, dsq_abs, dk) + r_ds * dsq_abs) * a_scale)
    dk = group(dk * scale)
    dvv = p.transpose(-2, -1) @ g
    pg_abs = p.transpose(-2, -1) @ g.abs()
    dv_b = group(dp_abs.transpose(-2, -1) @ g.abs() + sum_err(u, n, pg_abs, dvv) + r_p * pg_abs)
    dvv = group(dvv)
    return out, out_bound, {"q": (dq, dq_b), "k": (dk, dk_b), "v": (dvv, dv_b)}


def check_attention(c, gen, dtype, dt, call):
    four = c["dims"] == 4
    shapes = {"q": (c["h"], c["n"], c["d"]), "k": (c["hkv"], c["s"], c["d"]), "v": (c["hkv"], c["s"], c["dv"])}
    inputs = {}
    for name, (h, length, d) in shapes.items():
        shape = [c["b"], h, length, d] if four else [c["b"], length, d]
        base, view = make(gen, shape, dtype, c[name + "_layout"])
        base.requires_grad_(c["grad"])
        inputs[name] = view(base)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    mask = None
    if c["mask"]:
        mbase, mview = make(gen, c["mask_shape"], torch.float64, c["mask_layout"])
        if c["mask"] == "bool":
            mbase = torch.rand(mbase.shape, generator=gen, dtype=torch.float64) < c["mask_keep"]
        elif c["mask"] == "float-inf":
            drop = torch.rand(mbase.shape, generator=gen, dtype=torch.float64) >= c["mask_keep"]
            mbase = mbase.masked_fill(drop, -math.inf)
        mbase = mbase if mbase.dtype == torch.bool else mbase.to(dtype)
        mask = mview(mbase)
    out_shape = list(q.shape[:-1]) + [c["dv"]]
    g = random_tensor(gen, out_shape, dtype)

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
    want, bound, gwant = _attention_reference(four_d(q.detach().double()), four_d(k.detach().double()),
                                              four_d(v.detach().double()), m64, c["causal"], scale,
                                              four_d(g.double()) if c["grad"] else None, dt,
                                              r_pv=rounding(c, "P", fwd), r_p=rounding(c, "P"),
                                              r_ds=rounding(c, "dS"), r_out=rounding(c, "out"))

    def back(t):
        return t if four else t.squeeze(1)

    checks = [Check("out", out, back(want), back(bound), dtype)]
    if c["grad"]:
        for name, got in zip("qkv", grads):
            ref, err = gwant[name]
            checks.append(Check(f"d{name}", got, back(ref), back(err) + _out_tol(back(ref), dt), dtype))
    return checks


def check_attention_decode(c, gen, dtype, dt, call):
    shapes = {"q": (c["h"], c["n"], c["d"]), "k": (c["hkv"], c["s"], c["d"]), "v": (c["hkv"], c["s"], c["dv"])}
    t = {}
    for name, (h, length, d) in shapes.items():
        base, view = make(gen, [c["b"], h, length, d], dtype, c[name + "_layout"])
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
    want, bound, _ = _attention_reference(t["q"].double(), t["k"].double(), t["v"].double(), keep, False, scale,
                                          None, dt)
    return [Check("out", out, want, bound, dtype)]


EDGE_VALUES = (0.0, -0.0, -1.0, math.inf, -math.inf, math.nan, 1e-40, 1e-6, 65000.0)


def check_dispersion(c, gen, dtype, dt, call):
    base, view = make(gen, c["shape"], dtype, c["layout"], fill="rand")
    if c["specials"] and base.numel():
        idx = torch.randint(0, base.numel(), (min(base.numel(), 32),), generator=gen)
        pick = torch.randint(0, len(EDGE_VALUES), idx.shape, generator=gen)
        base.view(-1)[idx] = torch.tensor(EDGE_VALUES, dtype=torch.float64)[pick].to(dtype)
    base.requires_grad_(c["grad"])
    x = view(base)
    alpha = c["alpha"]
    g = random_tensor(gen, c["shape"], dtype)

    def forward_backward():
        y = opforge.dispersion_correction(x, alpha)
        return y, (torch.autograd.grad(y, x, g)[0] if c["grad"] else None)

    if c["grad"]:
        y, dx = call(forward_backward)
    else:
        with torch.no_grad():
            y, dx = call(forward_backward)
    # alpha is rounded to the compute type: float32 for all but float64
    a = alpha if dtype == torch.float64 else float(torch.tensor(alpha, dtype=torch.float32))
    u = U_ACC[dt]
    x64 = x.detach().double()
    root = x64.sqrt()
    want = x64 * a + root
    terms = (x64 * a).abs() + root.abs()
    checks = [Check("out", y, want, 4 * u * terms.nan_to_num(0.0, 0.0, 0.0) + _out_tol(want, dt), dtype)]
    if c["grad"]:
        g64 = g.double()
        gwant = g64 * a + g64 / (2 * root)
        gterms = (g64 * a).abs() + (g64 / (2 * root)).abs()
        checks.append(Check("dx", dx, gwant, 4 * u * gterms.nan_to_num(0.0, 0.0, 0.0) + _out_tol(gwant, dt), dtype))
    return checks


def check_glu(c, gen, dtype, dt, call):
    shape = c["shape"]
    if c["packed"]:
        base, view = make(gen, shape[:-1] + [2 * shape[-1]], dtype, c["gate_layout"], scale=3.0)
        base.requires_grad_(c["grad"])
        x = view(base)
        gate, up = x.chunk(2, -1)
        args, wrt = (x,), (x,)
    else:
        gbase, gview = make(gen, shape, dtype, c["gate_layout"], scale=3.0)
        ubase, uview = make(gen, shape, dtype, c["up_layout"])
        gbase.requires_grad_(c["grad"])
        ubase.requires_grad_(c["grad"])
        gate, up = gview(gbase), uview(ubase)
        args, wrt = (gate, up), (gate, up)
    g = random_tensor(gen, shape, dtype)
    fn = {"silu": opforge.functional.swiglu, "gelu": opforge.functional.geglu,
          "gelu_tanh": lambda *a: opforge.functional.geglu(*a, approximate="tanh")}[c["act"]]

    def forward_backward():
        out = fn(*args)
        return out, (torch.autograd.grad(out, wrt, g) if c["grad"] else None)

    if c["grad"]:
        out, grads = call(forward_backward)
    else:
        with torch.no_grad():
            out, grads = call(forward_backward)
    x64, u64, g64 = gate.detach().double(), up.detach().double(), g.double()
    with torch.enable_grad():
        xr = x64.clone().requires_grad_()
        a = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
             "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[c["act"]](xr)
        (da,) = torch.autograd.grad(a, xr, torch.ones_like(a))
    a = a.detach()
    u = U_ACC[dt]
    # the vector exp / erf / tanh: a few float32 ulps of |act| + |x| (erf's error is absolute); the
    # derivative of gelu_tanh is a difference of O(1 + |x|) terms
    want = a * u64
    checks = [Check("out", out, want, 16 * u * (a.abs() + x64.abs()) * u64.abs() + _out_tol(want, dt), dtype)]
    if c["grad"]:
        dgate, dup = g64 * u64 * da, g64 * a
        bound_g = 64 * u * (g64 * u64).abs() * (1 + x64.abs()) + _out_tol(dgate, dt)
        bound_u = 16 * u * g64.abs() * (a.abs() + x64.abs()) + _out_tol(dup, dt)
        if c["packed"]:
            checks.append(Check("dx", grads[0], torch.cat((dgate, dup), -1), torch.cat((bound_g, bound_u), -1), dtype))
        else:
            checks += [Check("dgate", grads[0], dgate, bound_g, dtype), Check("dup", grads[1], dup, bound_u, dtype)]
    return checks


def check_rope(c, gen, dtype, dt, call):
    from opforge.references import rope as rope_reference

    b, n, d, r = c["b"], c["n"], c["d"], c["r"]
    qbase, qview = make(gen, [b, c["hq"], n, d], dtype, c["q_layout"])
    kbase, kview = make(gen, [b, c["hk"], n, d], dtype, c["k_layout"])
    for t in (qbase, kbase):
        t.requires_grad_(c["grad"])
    q, k = qview(qbase), kview(kbase)
    rows = n + 5 if c["cos"] == "table" else n
    theta = torch.rand(b if c["cos"] == "3d-batch" else 1, rows, r, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = theta.cos().to(dtype), theta.sin().to(dtype)
    pos = None
    if c["cos"] == "table":
        cos, sin = cos[0], sin[0]
        pos = torch.randint(0, rows, (rng_batch(gen, b), n), generator=gen)
    elif c["cos"] == "2d":
        cos, sin = cos[0], sin[0]
    elif c["cos"] == "4d":
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    gq, gk = random_tensor(gen, q.shape, dtype), random_tensor(gen, k.shape, dtype)

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
    u = U_ACC[dt]
    # two products and a sum in the compute precision: within 2u of |x cos| + |rot(x) sin| <= 2 max|x|
    # (|cos|, |sin| <= 1 here)
    wq, wk = rope_reference(q64, k64, c64, s64, pos, c["interleaved"])
    scale_q = q64.abs().amax(-1, keepdim=True) * 2
    scale_k = k64.abs().amax(-1, keepdim=True) * 2
    checks = [Check("q_out", oq, wq, 2 * u * scale_q + _out_tol(wq, dt), dtype),
              Check("k_out", ok, wk, 2 * u * scale_k + _out_tol(wk, dt), dtype)]
    if c["grad"]:
        from opforge.references import rope_backward as rope_backward_reference

        dq, dk = rope_backward_reference(gq.double(), gk.double(), c64, s64, pos, c["interleaved"])
        sq, sk = gq.double().abs().amax(-1, keepdim=True) * 2, gk.double().abs().amax(-1, keepdim=True) * 2
        checks += [Check("dq", grads[0], dq, 2 * u * sq + _out_tol(dq, dt), dtype),
                   Check("dk", grads[1], dk, 2 * u * sk + _out_tol(dk, dt), dtype)]
    return checks


def rng_batch(gen: torch.Generator, b: int) -> int:
    """Position ids of one row (broadcast over the batch) or of every sequence."""
    return 1 if int(torch.randint(0, 2, (1,), generator=gen)) else b




def check_softmax(c, gen, dtype, dt, call):
    base, view = make(gen, c["shape"], dtype, c["layout"], scale=3.0)
    dim = c["dim"]
    if c["specials"] and base.numel():
        idx = torch.randint(0, base.numel(), (min(base.numel(), 64),), generator=gen)
        base.view(-1)[idx] = -math.inf
        lay = c["layout"]
        if base.dim() and (lay is None or not lay["expand"]) and torch.rand((), generator=gen) < 0.3:
            line = tuple(slice(None) if d == dim % base.dim() else 0 for d in range(base.dim()))
            view(base)[line] = -math.inf  # a line of -inf only: NaN, as torch
    base.requires_grad_(c["grad"])
    x = view(base)
    fn = opforge.functional.log_softmax if c["log"] else opforge.functional.softmax
    g = random_tensor(gen, c["shape"], dtype)

    def forward_backward():
        y = fn(x, dim)
        return y, (torch.autograd.grad(y, x, g)[0] if c["grad"] else None)

    if c["grad"]:
        y, dx = call(forward_backward)
    else:
        with torch.no_grad():
            y, dx = call(forward_backward)
    x64 = x.detach().double()
    n = x64.shape[dim] if x64.dim() else 1
    u = U_ACC[dt]
    sm = F.softmax(x64, dim)
    mx = x64.amax(dim, keepdim=True) if x64.numel() else x64
    d = (x64 - mx).abs().nan_to_num(0.0, 0.0, 0.0)  # the exp's argument: its rounding is relative to it
    if c["log"]:
        want = F.log_softmax(x64, dim)
        bound = C_FN * u * (d + mx.abs().nan_to_num(0.0, 0.0, 0.0) + 1.0) + c_sum(n) * u + _out_tol(want, dt)
    else:
        want = sm
        bound = (C_FN * u * (1.0 + d) + c_sum(n) * u) * sm + _out_tol(want, dt)
    checks = [Check("out", y, want, bound.nan_to_num(0.0, 0.0, 0.0), dtype)]
    if c["grad"]:
        g64 = g.double()
        x64r = x64.clone().requires_grad_()
        with torch.enable_grad():
            (gwant,) = torch.autograd.grad((F.log_softmax if c["log"] else F.softmax)(x64r, dim), x64r, g64)
        ga = g64.abs()
        # the backward reads y as saved: its forward error, and its rounding where ROUNDED says so
        # (relative, or half a float16 subnormal's spacing)
        y_rnd = rounding_err(c, "y", want)
        if c["log"]:  # dx = dy - exp(y) sum(dy)
            gsum = ga.sum(dim, keepdim=True)
            err_y = C_FN * u * (d + mx.abs().nan_to_num(0.0, 0.0, 0.0) + 1.0)
            gb = 4 * (sm * gsum * (err_y + c_sum(n) * u) + C_FN * u * ga) + sm * gsum * y_rnd.expm1()
        else:  # dx = y (dy - sum(dy y))
            def carried(ey):
                return ey * (ga + (ga * sm).sum(dim, keepdim=True)) + sm * (ga * ey).sum(dim, keepdim=True)

            gb = 4 * (carried(sm * C_FN * u * (1.0 + d)) + c_sum(n) * u * sm * (ga * sm).sum(dim, keepdim=True)) \
                + carried(y_rnd)
        checks.append(Check("dx", dx, gwant, gb.nan_to_num(0.0, 0.0, 0.0) + _out_tol(gwant, dt), dtype))
    return checks


def check_cross_entropy(c, gen, dtype, dt, call):
    base, view = make(gen, c["shape"], dtype, c["layout"], scale=3.0)
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
    g = random_tensor(gen, loss_shape, dtype)

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
    u = U_ACC[dt]
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
    row_b = (C_FN * u * (1 + (0 if cap is None else cap)) + c_sum(classes) * u) * terms
    if red == "none":
        lb = row_b.reshape(lead) + _out_tol(want.detach(), dt)
    else:
        total_w = float((wt * keep).sum())
        lb = (row_b.sum() + c_sum(max(1, tf.numel())) * u * terms.sum()) / (total_w if red == "mean" and total_w else 1.0)
        lb = lb + _out_tol(want.detach(), dt)
    checks = [Check("loss", loss, want.detach(), lb, dtype)]
    if c["grad"]:
        scale = g.double().abs().reshape(-1) if red == "none" else torch.full((tf.numel(),), abs(float(g)))
        if red == "mean":
            total_w = float((wt * keep).sum())
            scale = scale / (total_w if total_w else 1.0)
        p = torch.softmax(zd, -1).nan_to_num(0.0, 0.0, 0.0)
        a = (scale * ((1 - eps) * wt + eps / classes * wc))[:, None]
        err_p = C_FN * u * (1 + zd.abs().nan_to_num(0.0, 0.0, 0.0) + lse.abs().nan_to_num(0.0, 0.0, 0.0)[:, None])
        gb = a * p * err_p + (scale * (1 + wt))[:, None] * C_FN * u * (eps / classes + (1 - eps))
        checks.append(Check("dlogits", dx, gwant, (4 * gb).reshape(gwant.shape) + _out_tol(gwant, dt), dtype))
    return checks


def check_lce(c, gen, dtype, dt, call):
    """Bounds, as for linear and cross_entropy: the logits u = hidden weight^T + bias are off by a sum's
    error eu, z (capped) by ez; the float32 lse by the weights' sum_v p_v ez_v and the exp's and sums'
    roundings; each du = s (p - eps / V - (1 - eps) [v = y]) (1 - (z / c)^2) by p's relative error, the
    few float32 operations, and its rounding where the variant rounds it (ROUNDED); the gradients are
    sums of du times 16-bit operands, rounded once (or twice: ROUNDED's "grads")."""
    t, h, v = c["t"], c["h"], c["v"]
    specs = [([t, h], dtype, c["h_layout"], "randn", 1.0), ([v, h], dtype, c["w_layout"], "randn", 2 / max(h, 1) ** 0.5)]
    if c["bias"]:
        specs.append(([v], dtype, None, "randn", 1.0))
    inputs = _inputs(gen, specs)
    for base, _ in inputs:
        base.requires_grad_(c["grad"])
    hid, w, b = [view(base) for base, view in inputs] + [None] * (3 - len(inputs))
    y = torch.randint(0, max(v, 1), (t,), generator=gen)
    y[torch.rand(t, generator=gen) < c["ignore"]] = -100
    kw = dict(ignore_index=-100, label_smoothing=c["label_smoothing"], reduction=c["reduction"], softcap=c["softcap"])
    g = random_tensor(gen, [t] if c["reduction"] == "none" else [], dtype)
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

    u = U_ACC[dt]
    h64, w64 = refs[0].detach(), refs[1].detach()
    b64 = refs[2].detach() if b is not None else torch.zeros(v, dtype=torch.float64)
    logits = h64 @ w64.T + b64
    eu = sum_err(u, h + 1, h64.abs() @ w64.abs().T + b64.abs(), logits)
    z = z.detach()
    dcap = 1 - (z / cap) ** 2 if cap is not None else torch.ones_like(z)
    ez = eu * dcap + (C_FN * u * z.abs() if cap is not None else 0.0)  # tanhf, and the scaling around it
    keep = y != -100  # (V >= 1: _draw_lce)
    lse = torch.logsumexp(z, -1, keepdim=True)
    p = (z - lse).exp()
    dist = (z - z.amax(-1, keepdim=True)).abs()  # the exp's argument, rounded relative to it
    # the float32 lse (an online max and sum over the vocab blocks, log, the add), as lse_update computes it
    e_lse = (p * (ez + u * dist)).sum(-1, keepdim=True) + u * (C_FN + c_sum(v) + 0.5 * v) \
        + u * (C_FN + 1) * lse.abs()
    yc = y.clamp_min(0)[:, None]
    # loss_t = lse - (1 - eps) z_y - eps / V sum_v z_v, in double from float32 lse, z_y and sum z
    e_loss = e_lse[:, 0] + (1 - eps) * ez.gather(1, yc)[:, 0]
    if eps:
        e_loss = e_loss + eps / v * (ez.sum(-1) + sum_err(u, v, z.abs().sum(-1), z.sum(-1)))
    e_loss = torch.where(keep, e_loss, torch.zeros_like(e_loss))
    count = int(keep.sum())
    lb = e_loss if red == "none" else e_loss.sum() / (count if red == "mean" and count else 1)
    checks = [Check("loss", loss, want.detach(), lb + _out_tol(want.detach(), dt), dtype)]
    if not c["grad"]:
        return checks
    gwant = torch.autograd.grad(want, refs, g.double())
    # s_t: the gradient of token t's loss (0 where ignored); du as the kernels make it (grad_rows)
    base = 1.0 / count if red == "mean" and count else 1.0
    s_t = torch.where(keep, base * g.double().expand(t), torch.zeros(t, dtype=torch.float64))[:, None]
    onehot = torch.zeros_like(z).scatter_(1, yc, 1.0) * keep[:, None]
    graw = s_t * (p - eps / v - (1 - eps) * onehot)
    du = graw * dcap
    e_p = p * (ez + e_lse + u * (C_FN + (z - lse).abs()))
    e_graw = s_t.abs() * (e_p + 2 * u * (p + eps / v + (1 - eps) * onehot))
    e_du = e_graw * dcap.abs()
    if cap is not None:  # 1 - (z / c)^2 from the float32 z: z's error, and the few roundings of its own
        e_du = e_du + graw.abs() * (2 * z.abs() * ez / cap**2 + 4 * u * (1 + 2 * (z / cap) ** 2))
    e_du16 = e_du + rounding_err(c, "du", du)  # the operand of the dhidden and dweight products
    dh, dw, db = du @ w64, du.T @ h64, du.sum(0)
    bounds = {
        "dhidden": e_du16 @ w64.abs() + sum_err(u, v, du.abs() @ w64.abs(), dh),
        "dweight": e_du16.T @ h64.abs() + sum_err(u, t, du.abs().T @ h64.abs(), dw),
        "dbias": e_du.sum(0) + sum_err(u, t, du.abs().sum(0), db),
    }
    # reduction mean or sum over one block: the forward rounds the gradients of a unit g, the backward
    # scales them by g and rounds again (_out_tol's): the first rounding, scaled, adds U16 |ref| + A16 |g|
    r_twice = rounding(c, "grads") if red != "none" and t * v <= opforge.functional.LCE_BLOCK_FLOATS else 0.0
    for name, got, ref in zip(("dhidden", "dweight", "dbias"), grads, gwant):
        again = r_twice * ref.abs() + (A16[dt] * abs(float(g)) if r_twice else 0.0)
        checks.append(Check(name, got, ref, bounds[name] + again + _out_tol(ref, dt), dtype))
    return checks


CHECKERS = {"matmul": check_matmul, "linear": check_linear, "attention": check_attention,
            "dispersion_correction": check_dispersion, "glu": check_glu, "rope": check_rope,
            "softmax": check_softmax, "cross_entropy": check_cross_entropy, "linear_cross_entropy": check_lce,
            "attention_decode": check_attention_decode}


class OpError(Exception):
    """opforge raised on a valid call."""


@dataclass
class Outcome:
    failures: list = field(default_factory=list)
    worst: dict = field(default_factory=dict)  # check name -> error / bound
    seconds: float = 0.0


def kernel_variants(isa: str) -> dict:
    """{kernel family: the variant it runs under isa}."""
    opforge.set_isa(isa)
    try:
        return {fam: name for fam, vs in opforge.kernel_variants().items() for name, _, now in vs if now}
    finally:
        opforge.set_isa("auto")


def run_case(c: dict) -> Outcome:
    """Runs one case in this process: the op under the case's ISA and threads, the references after."""
    dtype, dt = DTYPES[c["dtype"]], c["dtype"]
    gen = torch.Generator().manual_seed(c["data_seed"])
    res = Outcome()
    threads = torch.get_num_threads()

    def call(fn):
        opforge.set_isa(c["isa"])
        torch.set_num_threads(c["threads"])
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            raise OpError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        finally:
            res.seconds = time.perf_counter() - t0
            torch.set_num_threads(threads)
            opforge.set_isa("auto")

    c = {**c, "variants": kernel_variants(c["isa"])}
    try:
        checks = CHECKERS[c["op"]](c, gen, dtype, dt, call)
    except OpError as e:
        res.failures.append(f"opforge raised {e}")
        return res
    except Exception as e:  # noqa: BLE001
        res.failures.append(f"the fuzzer's reference raised {type(e).__name__}: {e}")
        return res
    for ck in checks:
        msg, worst = compare(ck)
        res.worst[ck.name] = worst
        if msg:
            res.failures.append(msg)
    return res


# ---- normalisation: rms_norm, add_rms_norm, layer_norm ------------------------------------------------

# hidden sizes around the 8-lane vectors and their 32-wide unrolled loops; rows around the backward's row
# blocks (32 rows, up to 256 blocks) and the forward's grain (16384 / H rows a task)
NORM_HIDDEN = (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 123, 128, 1000, 4096, 4097)
NORM_ROWS = (1, 3, 31, 32, 33, 37, 64, 257, 8193)


def _draw_norm(rng, c):
    c["kind"] = rng.choice(("rms", "rms", "add", "add", "layer"))
    h = rng.choice(NORM_HIDDEN) if rng.random() < 0.6 else _dim(rng, 4200, NORM_HIDDEN, zero=0.01)
    rows = _near(rng, rng.choice(NORM_ROWS)) if rng.random() < 0.5 else _dim(rng, 2000, NORM_ROWS, zero=0.02)
    rows = max(rows, 0)
    while rows * h > 600_000:
        rows //= 2
    nlead = rng.choices((0, 1, 2), (0.1, 0.6, 0.3))[0]
    if nlead == 0:
        rows = 1
    lead = [rows] if nlead == 1 else [rng.choice((1, 2, 3)), rows] if nlead == 2 else []
    c["shape"] = lead + [h]
    c["x_layout"] = _layout(rng, c["shape"])
    c["r_layout"] = _layout(rng, c["shape"]) if c["kind"] == "add" else None
    c["weight"] = rng.random() < 0.75
    c["bias"] = c["kind"] == "layer" and rng.random() < 0.6
    c["offset"] = c["kind"] != "layer" and c["weight"] and rng.random() < 0.3
    c["eps"] = rng.choice((1e-6, 1e-5, 0.1))
    c["shift"] = rng.choice((0.0, 0.0, 3.0))  # a mean far from 0 (layer_norm's variance of x - mean)
    c["grad"] = rng.random() < 0.6
    return _seconds(c, 0, 0, math.prod(c["shape"]) * (60 if c["grad"] else 20))


def _describe_norm(head, c):
    extra = (f" residual{_layout_str(c['r_layout'])}" if c["kind"] == "add" else "") + (
        " weight" if c["weight"] else "") + (" bias" if c["bias"] else "") + (" offset" if c["offset"] else "")
    return (f"{head} {c['kind']} x={tuple(c['shape'])}{_layout_str(c['x_layout'])}{extra} eps={c['eps']} "
            f"shift={c['shift']} grad={c['grad']}")


def check_norm(c, gen, dtype, dt, call):
    """Bounds: a row's sums (of squares, of x, of g w xh) carry u (c(H) + H / 2) relative errors into rstd, mean and the
    backward's mean(g w xh); each output is a few products of those (u each) and one rounding to its type;
    the weight and bias gradients add a sum over the rows (u c(R))."""
    shape, h = c["shape"], c["shape"][-1]
    specs = [(shape, dtype, c["x_layout"], "randn", 1.0)]
    if c["kind"] == "add":
        specs.append((shape, dtype, c["r_layout"], "randn", 1.0))
    ins = _inputs(gen, specs)
    if c["shift"]:
        ins[0] = (ins[0][0].add_(c["shift"]), ins[0][1])
    xb = ins[0][0].requires_grad_(c["grad"])
    x = ins[0][1](xb)
    r = ins[1][1](ins[1][0].requires_grad_(c["grad"])) if c["kind"] == "add" else None
    w = (random_tensor(gen, [h], dtype, scale=0.5) + (0 if c["offset"] else 1)).requires_grad_(c["grad"]) \
        if c["weight"] else None
    b = random_tensor(gen, [h], dtype).requires_grad_(c["grad"]) if c["bias"] else None
    g, gs = random_tensor(gen, shape, dtype), random_tensor(gen, shape, dtype)
    leaves = [t for t in (x, r, w, b) if t is not None]
    names = [n for n, t in zip(("dx", "dresidual", "dweight", "dbias"), (x, r, w, b)) if t is not None]

    def forward_backward():
        if c["kind"] == "rms":
            outs = (opforge.rms_norm(x, w, c["eps"], c["offset"]),)
        elif c["kind"] == "add":
            outs = opforge.add_rms_norm(x, r, w, c["eps"], c["offset"])
        else:
            outs = (opforge.layer_norm(x, w, b, c["eps"]),)
        grads = torch.autograd.grad(outs, leaves, (g, gs)[:len(outs)]) if c["grad"] else None
        return outs, grads

    if c["grad"]:
        outs, grads = call(forward_backward)
    else:
        with torch.no_grad():
            outs, grads = call(forward_backward)

    u, n = U_ACC[dt], max(h, 1)
    cu = u * (c_sum(n) + 0.5 * n + 16)  # sums of one sign (squares; x broadcast along a row) drift like n / 2
    # y and the backward start from s as the kernel keeps it: x + residual rounded to x's dtype (ROUNDED)
    src = (x.detach().double() + r.detach().double()).to(dtype) if c["kind"] == "add" else x.detach()
    s64 = src.double()
    w64 = w.detach().double() if w is not None else torch.ones(h, dtype=torch.float64)
    we = 1 + w64 if c["offset"] else w64
    eps = c["eps"] if dtype == torch.float64 else float(torch.tensor(c["eps"], dtype=torch.float32))
    mu = s64.mean(-1, keepdim=True) if c["kind"] == "layer" else torch.zeros_like(s64[..., :1])
    d = s64 - mu
    rstd = ((d * d).mean(-1, keepdim=True) + eps).rsqrt()
    xh = d * rstd
    # |error of xh|: rstd's relative error, and the mean's absolute one times rstd; the mean's error also
    # enters the variance (a row of equal values: x - mean is all rounding, eps alone bounds rstd)
    mean_err = cu * s64.abs().mean(-1, keepdim=True) * (c["kind"] == "layer")
    rstd_rel = cu + (mean_err * rstd) ** 2
    xh_err = rstd_rel * xh.abs() + rstd * mean_err
    y = xh * we + (b.detach().double() if b is not None else 0)
    checks = [Check("out", outs[0], y, xh_err * we.abs() + cu * y.abs() + _out_tol(y, dt), dtype)]
    if c["kind"] == "add":
        checks.append(Check("sum", outs[1], s64, torch.zeros_like(s64), dtype))
    if not c["grad"]:
        return checks
    g64, gs64 = g.double(), gs.double()
    gw = g64 * we
    rows_dims = tuple(range(len(shape) - 1))
    m_gwx = (gw * xh).mean(-1, keepdim=True)
    m_gw = gw.mean(-1, keepdim=True) if c["kind"] == "layer" else torch.zeros_like(m_gwx)
    dx = rstd * (gw - m_gw - xh * m_gwx)
    scale = rstd * (gw.abs() + gw.abs().mean(-1, keepdim=True) + (xh.abs() + xh_err) * (gw * xh).abs().mean(-1, keepdim=True))
    dx_b = (cu + rstd_rel) * scale + rstd * xh_err * m_gwx.abs() + rstd * (gw.abs() * xh_err).mean(-1, keepdim=True) * xh.abs()
    want = {"dx": (dx + (gs64 if c["kind"] == "add" else 0), dx_b)}
    if c["kind"] == "add":
        want["dresidual"] = want["dx"]
    rows = max(math.prod(shape[:-1]), 1)
    gxh = (g64 * xh).sum(rows_dims) if rows_dims else g64 * xh
    gxh_abs = (g64.abs() * (xh.abs() + xh_err)).sum(rows_dims) if rows_dims else g64.abs() * (xh.abs() + xh_err)
    want["dweight"] = (gxh, u * c_sum(rows) * gxh_abs + (g64.abs() * xh_err).sum(rows_dims) if rows_dims
                       else (g64.abs() * xh_err) + u * gxh_abs)
    gsum = g64.sum(rows_dims) if rows_dims else g64
    want["dbias"] = (gsum, u * c_sum(rows) * (g64.abs().sum(rows_dims) if rows_dims else g64.abs()))
    for name, got in zip(names, grads):
        ref, err = want[name]
        checks.append(Check(name, got, ref, err + _out_tol(ref, dt), dtype))
    return checks


DRAW["norm"] = _draw_norm
OP_WEIGHTS["norm"] = 0.2
CHECKERS["norm"] = check_norm


# ---- child processes ------------------------------------------------------------------------------------

PROTO = "@@fuzz "


def worker(seed: int, start: int, step: int, stop: int | None, deadline: float | None, sel: Selection) -> None:
    """Runs cases start, start + step, ... until stop or deadline, one protocol line before and after each."""
    torch.set_num_threads(2)
    i = start
    while (stop is None or i < stop) and (deadline is None or time.time() < deadline):
        c = draw(seed, i, sel)
        print(PROTO + json.dumps({"begin": i, "op": c["op"]}), flush=True)
        t0 = time.perf_counter()
        res = run_case(c)
        print(PROTO + json.dumps({"end": i, "op": c["op"], "failures": res.failures, "desc": describe(c),
                                  "seconds": round(time.perf_counter() - t0, 3),
                                  "worst": max(res.worst.values(), default=0.0)}), flush=True)
        i += step


def heap_check_env(env: dict) -> dict:
    """env with glibc's heap checks on, where it has them and no sanitizer runtime is preloaded."""
    preload = env.get("LD_PRELOAD", "")
    lib = ctypes.util.find_library("c_malloc_debug")
    if not lib or "asan" in preload or "MALLOC_CHECK_" in env:
        return env
    env = dict(env)
    env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    env["MALLOC_CHECK_"] = "3"
    env["MALLOC_PERTURB_"] = "165"
    return env


def _child_env(malloc_check: bool) -> dict:
    env = dict(os.environ)
    # the children import the opforge this process imported
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(opforge.__file__)))
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return heap_check_env(env) if malloc_check else env


def _signal_name(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with status {rc}"


def _stderr_tail(path: str, lines: int = 12) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    keep = [ln for ln in text.splitlines() if ln.strip()]
    # an ASan report: its headline and summary say what and where
    asan = [ln for ln in keep if "ERROR: AddressSanitizer" in ln or "SUMMARY:" in ln or "runtime error:" in ln]
    return "\n       ".join(asan[:4] if asan else keep[-lines:])


@dataclass
class Failure:
    seed: int
    cases: list  # the case numbers that reproduce it, run in this order in one process
    desc: str
    what: str
    sel: Selection = Selection()  # how the cases were drawn

    def reproducer(self) -> str:
        """The command that reruns the case, with the environment that picks the library (a sanitized
        copy needs its runtimes preloaded)."""
        env = [f"{k}={shlex.quote(os.environ[k])}" for k in ("ASAN_OPTIONS", "LD_PRELOAD", "PYTHONPATH")
               if os.environ.get(k) and (k == "PYTHONPATH" or "asan" in os.environ.get("LD_PRELOAD", ""))]
        cmd = [f"python tests/python/fuzz.py --seed {self.seed}"] + [f"--case {i}" for i in self.cases]
        return " ".join(env + cmd + self.sel.args())


@dataclass
class Report:
    seed: int
    cases: int = 0
    per_op: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    seconds: float = 0.0
    worst: float = 0.0  # largest error / bound of the passing cases
    ratios: list = field(default_factory=list)  # each passing case's largest error / bound

    def summary(self) -> str:
        ops = ", ".join(f"{op} {n}" for op, n in sorted(self.per_op.items()))
        lines = [f"fuzz: seed {self.seed}: {self.cases} cases in {self.seconds:.0f} s ({ops}); "
                 f"{len(self.failures)} failed; largest error/bound of a passing check {self.worst:.3g}"
                 + (f" (a passing case's largest: median {statistics.median(self.ratios):.3g}, 90th percentile "
                    f"{statistics.quantiles(self.ratios, n=10)[-1]:.3g})" if len(self.ratios) > 1 else "")]
        for f in self.failures:
            lines.append(f"FAIL {f.desc}\n     {f.what}\n     reproduce: {f.reproducer()}")
        return "\n".join(lines)


class _Child:
    def __init__(self, wid, seed, start, step, stop, deadline, sel, env):
        self.wid, self.step, self.current, self.started, self.previous = wid, step, None, 0.0, None
        self.errfile = tempfile.NamedTemporaryFile(prefix="opforge-fuzz-", suffix=".stderr", delete=False)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--seed", str(seed), "--start", str(start),
               "--step", str(step)]
        cmd += ["--stop", str(stop)] if stop is not None else []
        cmd += ["--deadline", str(deadline)] if deadline is not None else []
        cmd += sel.args()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.errfile, env=env, text=True, bufsize=1)

    def pump(self, q):
        for line in self.proc.stdout:
            q.put((self.wid, line))
        q.put((self.wid, None))

    def close(self):
        self.errfile.close()
        os.unlink(self.errfile.name)


def _run_alone(seed: int, cases: list, sel: Selection, env: dict, timeout: float) -> int:
    """Runs cases in one fresh child, in this order: its return code."""
    cmd = [sys.executable, os.path.abspath(__file__), "--seed", str(seed), "--quiet"]
    cmd += [a for i in cases for a in ("--case", str(i))] + sel.args()
    try:
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return -signal.SIGKILL


def run(seed: int, cases: int | None = None, seconds: float | None = None, jobs: int = 1,
        sel: Selection = Selection(), malloc_check: bool = True, case_timeout: float = 300.0, log=print,
        progress_every: float = 30.0) -> Report:
    """Runs cases 0..cases-1 of seed (or as many as fit in `seconds`) in `jobs` child processes."""
    assert cases is not None or seconds is not None
    env = _child_env(malloc_check)
    deadline = time.time() + seconds if seconds is not None else None
    rep = Report(seed)
    t0 = time.time()
    q: queue.Queue = queue.Queue()
    children: dict[int, _Child] = {}

    def start(wid, first):
        if (cases is not None and first >= cases) or (deadline is not None and time.time() >= deadline):
            return
        ch = _Child(wid, seed, first, jobs, cases, deadline, sel, env)
        children[wid] = ch
        threading.Thread(target=ch.pump, args=(q,), daemon=True).start()

    for w in range(jobs):
        start(w, w)
    last_progress = time.time()
    while children:
        try:
            wid, line = q.get(timeout=1.0)
        except queue.Empty:
            for ch in list(children.values()):
                if ch.current is not None and time.time() - ch.started > case_timeout:
                    ch.proc.kill()  # its reader sees EOF next
            continue
        ch = children[wid]
        if line is not None:
            if not line.startswith(PROTO):
                continue
            msg = json.loads(line[len(PROTO):])
            if "begin" in msg:
                ch.current, ch.started = msg["begin"], time.time()
                continue
            ch.previous, ch.current = msg["end"], None
            rep.cases += 1
            rep.per_op[msg["op"]] = rep.per_op.get(msg["op"], 0) + 1
            if msg["failures"]:
                f = Failure(seed, [msg["end"]], msg["desc"], "; ".join(msg["failures"]), sel)
                rep.failures.append(f)
                log(f"FAIL case {msg['end']}: {f.desc}\n     {f.what}\n     reproduce: {f.reproducer()}")
            else:
                rep.worst = max(rep.worst, msg["worst"])
                rep.ratios.append(msg["worst"])
            if time.time() - last_progress > progress_every:
                last_progress = time.time()
                log(f"fuzz: {rep.cases} cases, {len(rep.failures)} failed, {time.time() - t0:.0f} s")
            continue
        # the child is gone
        rc = ch.proc.wait()
        del children[wid]
        crashed, prev = ch.current, ch.previous
        tail = _stderr_tail(ch.errfile.name)
        ch.close()
        if crashed is None:
            if rc != 0:
                raise RuntimeError(f"fuzz: a worker {_signal_name(rc)} outside any case:\n{tail}")
            continue
        rep.cases += 1
        c = draw(seed, crashed, sel)
        rep.per_op[c["op"]] = rep.per_op.get(c["op"], 0) + 1
        hung = time.time() - ch.started > case_timeout
        what = f"hung (over {case_timeout:.0f} s)" if hung else f"crashed: the worker {_signal_name(rc)}"
        what += f": {tail}" if tail and not hung else ""
        # does it crash alone? else with the case run before it in the same process?
        repro = [crashed]
        if not hung:
            rc1 = _run_alone(seed, [crashed], sel, env, case_timeout)
            if rc1 == 0 and prev is not None:
                rc2 = _run_alone(seed, [prev, crashed], sel, env, case_timeout)
                repro = [prev, crashed] if rc2 != 0 else repro
                if rc2 == 0:
                    what += " (not reproduced by the case alone nor after the case before it)"
            elif rc1 == 0:
                what += " (not reproduced by the case alone)"
        f = Failure(seed, repro, describe(c), what, sel)
        rep.failures.append(f)
        log(f"FAIL case {crashed}: {f.desc}\n     {f.what}\n     reproduce: {f.reproducer()}")
        start(wid, crashed + jobs)
    rep.seconds = time.time() - t0
    return rep


# ---- command line ------------------------------------------------------------------------------------------


def _verbose_case(seed: int, index: int, sel: Selection, quiet: bool) -> bool:
    c = draw(seed, index, sel)
    if not quiet:
        print(f"case {index} of seed {seed}: {describe(c)}")
        print(f"  spec {json.dumps(c)}")
        print(f"  opforge {opforge.__file__}", flush=True)
    t0 = time.perf_counter()
    res = run_case(c)
    if not quiet:
        for name, worst in res.worst.items():
            print(f"  {name}: largest error / bound {worst:.3g}")
        print(f"  op {res.seconds:.3f} s, case {time.perf_counter() - t0:.3f} s (estimate {c['estimate_s']} s)")
        for f in res.failures:
            print(f"  FAIL {f}")
        print("  ok" if not res.failures else f"  {len(res.failures)} failed")
    return not res.failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="randomized differential test of opforge's ops against float64 PyTorch")
    p.add_argument("--seed", type=int, help="the seed of the cases (default: a fresh one, printed)")
    p.add_argument("--cases", type=int, help="run cases 0..N-1")
    p.add_argument("--seconds", type=float, help="run cases until this much time has passed")
    p.add_argument("--case", type=int, action="append", help="run this case in this process, in detail (repeatable)")
    p.add_argument("--jobs", type=int, default=1, help="child processes (default 1)")
    p.add_argument("--ops", help="comma-separated subset of " + ",".join(OP_WEIGHTS))
    p.add_argument("--dtypes", help="comma-separated subset of " + ",".join(DTYPES))
    p.add_argument("--isas", help="the ISAs cases are drawn from (default: this CPU's, "
                   + ",".join(opforge.supported_isas()) + "): another CPU's list draws its cases, one forces it")
    p.add_argument("--isa", help="run every case under this ISA whatever it drew (one of this CPU's)")
    p.add_argument("--no-malloc-check", action="store_true", help="children without glibc's heap checks")
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--step", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    sel = Selection(*(tuple(v.split(",")) if v else None for v in (a.ops, a.dtypes, a.isas)), a.isa)
    for flag, names, known in (("--ops", sel.ops, OP_WEIGHTS), ("--dtypes", sel.dtypes, DTYPES)):
        for name in names or ():
            if name not in known:
                p.error(f"{flag}: unknown {name!r}: one of {', '.join(known)}")
    here = opforge.supported_isas()
    if sel.isa is not None and sel.isa not in here:
        p.error(f"--isa: this CPU runs {', '.join(here)}, not {sel.isa!r}")
    if sel.isa is None and set(sel.isas or ()) - set(here):
        p.error(f"--isas: this CPU lacks {', '.join(sorted(set(sel.isas) - set(here)))}: name one it runs with --isa")
    if a.worker:
        worker(a.seed, a.start, a.step, a.stop, a.deadline, sel)
        return 0
    if a.case:
        if a.seed is None:
            p.error("--case needs --seed")
        return 0 if all([_verbose_case(a.seed, i, sel, a.quiet) for i in a.case]) else 1
    if a.cases is None and a.seconds is None:
        p.error("give --cases N, --seconds T or --case I")
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"fuzz: seed {seed}, {a.cases} cases" if a.cases is not None else f"fuzz: seed {seed}, {a.seconds:.0f} s",
          f"on {a.jobs} job(s); ISAs {', '.join(opforge.supported_isas())}; opforge {opforge.__file__}", flush=True)
    rep = run(seed, a.cases, a.seconds, a.jobs, sel, not a.no_malloc_check)
    print(rep.summary(), flush=True)
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
