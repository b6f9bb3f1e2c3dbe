#!/usr/bin/env python3
"""Randomized differential test: opforge's ops against float64 PyTorch.

Each case is drawn from (seed, index) alone: an op, as its test module describes it (FUZZ in
tests/python/test_<stem>.py: e.g. linear with each activation, bias or not, a backward with or
without a retained graph; scaled_dot_product_attention with causal, bool or float masks broadcast
from any shape, grouped-query heads), its shapes, the layouts of its inputs (permuted, sliced,
stepped, expanded: read in place by the kernels), a dtype (float32, bfloat16, float16, float64), an
ISA of ``opforge.supported_isas()`` and a thread count (1 or 2).

Shapes run from 0 to ~1500 a dim: log-uniform, or near the sizes where
opforge's plans change (each op's marks, kept beside its description: GEMM
register, cache and thread blocks, the 16-bit slice depth, the 8 MiB row chunks
of linear, attention's 64-row blocks, the elementwise grain), with the total
work of a case capped so a case takes a fraction of a second.

Every output and gradient is checked element by element against a float64
reference on the same (rounded) inputs, within a bound that follows the
rounding: a sum of K products accumulated in precision u is within
u * c(K) * (|A| @ |B|) of the exact one, errors of a pre-activation or of the
scores carry through the activation's or softmax's derivative, and a 16-bit
result adds one rounding (an ulp of its type). What a kernel variant rounds to
16 bits on the way (attention's P and dS on avx512_bf16, a saved output the
backward reads, ...) is stated per (variant, dtype) in each op's description
(Op.rounded), and each such rounding's error is carried into the bound as the
sums' are. Garbage, a dropped K slice, a wrong row chunk or NaN exceed it by
orders of magnitude.

This file is the generic machinery (seeds, dtypes, ISAs, layouts, the bounds'
model, the runner and its command line) and names no op: the ops are found
by their test modules (tests/python/discover.py), each FUZZ table a
{case name: Op} of draw, check and describe functions, a weight and what its
kernels round. An op of the library that no FUZZ covers is not drawn;
test_fuzz.py fails naming it.

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
import dataclasses
import functools
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
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if __name__ == "__main__":
    # the test modules this script reads import it as `fuzz`: the same module, not a second copy
    sys.modules.setdefault("fuzz", sys.modules["__main__"])
    if not os.environ.get("PYTHONPATH"):
        sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

import device_mirror  # noqa: E402  (beside this file: on the path when run as a script, and under pytest)
import opforge  # noqa: E402

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
# returns once (U_OUT, out_tol). Each op's Op.rounded states what else each kernel variant rounds to the
# 16-bit type: an intermediate before a product, a value saved for the backward. One rounding to nearest
# moves a value v by at most U16 |v|, or A16 where v is subnormal (float16's below 2**-14; the bfloat16
# pair products flush bfloat16 subnormals, vdpbf16ps), and each checker carries that error through the
# rest of the computation into its bound, as it does the sums' own errors: a rounded P adds
# U16 sum_j |P_ij| |V_jd| to out[i, d], beside the product's u c(S) sum_j |P_ij| |V_jd|.
#
# Key: (variant, dtype) -> the names a checker asks `rounding` about. The variant is the one of the
# op's kernel family (Op.family; opforge.kernel_variants()) that ran under the case's ISA, "*" any; the
# dtype a 16-bit type, "*" either; the most specific key wins. The ISA alone does not say it: amx runs
# attention's avx512_bf16 variant, avx512_bf16 the avx512 row kernels of softmax, norm, ... .
U16 = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
A16 = {"bfloat16": 2.0**-126, "float16": 2.0**-25}


def rounding(c: dict, what: str, op: str | None = None) -> float:
    """U16 of the case's dtype where the kernel variant that ran (c["variants"]) rounds `what` to it
    (the rounded table of op's description; op: the case's own by default), else 0."""
    dt, op = c["dtype"], op or c["op"]
    if dt not in U16:
        return 0.0
    desc = descriptions()[op]
    variant = c["variants"][desc.family]
    for key in ((variant, dt), (variant, "*"), ("*", dt), ("*", "*")):
        if key in desc.rounded:
            return U16[dt] if what in desc.rounded[key] else 0.0
    raise KeyError(f"fuzz: the description of {op} (its rounded table) states nothing for ({variant}, {dt})")


def rounding_err(c: dict, what: str, value: torch.Tensor, op: str | None = None):
    """The error the rounding of `what` (exact value `value`) adds where the variant rounds it, else 0."""
    r = rounding(c, what, op)
    return r * value.abs() + A16[c["dtype"]] if r else torch.zeros_like(value)


# ---- drawing a case: plain Python random, so a case is the same on every run ----------------------


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi + 0.5)))))


def near(rng: random.Random, mark: int) -> int:
    if rng.random() < 0.6:
        return mark + rng.randint(-2, 2)
    spread = max(1, mark // 8)
    return mark + rng.randint(-spread, spread)


def dim(rng: random.Random, hi: int, marks, zero: float = 0.02) -> int:
    """A size: sometimes 0, sometimes tiny, log-uniform in [1, hi], uniform in [16, hi] (everyday
    sizes, where most plans pick between their block counts), or near a size where a plan changes (one
    of marks, or a multiple of 64)."""
    r = rng.random()
    if r < zero:
        return 0
    if r < 0.06:
        return rng.randint(1, 9)
    if r < 0.2:
        return log_uniform(rng, 1, hi)
    if r < 0.65:
        return rng.randint(min(16, hi), hi)
    choices = [m for m in marks if m <= hi] + [64 * rng.randint(1, max(1, hi // 64))]
    return min(max(near(rng, rng.choice(choices)), 1), hi)


def layout(rng: random.Random, shape, p_plain: float = 0.45, expand: bool = True):
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


def layout_str(lay) -> str:
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


def seconds(c: dict, op_flops: float, ref_flops: float, passes: float) -> float:
    """A rough time for a case on 2 AVX2 cores: opforge's flops (float64 and ref run scalar loops), the
    references' GEMMs and elementwise passes over float64 tensors."""
    rate = 1e9 if c["dtype"] == "float64" else 6e9 if c["isa"] == "ref" else 25e9
    return op_flops / rate + ref_flops / REF_RATE + passes / PASS_RATE


# ---- the ops: each described in its own test module --------------------------------------------------


@dataclass(frozen=True)
class Op:
    """How the fuzzer draws and checks cases of one op: an entry of FUZZ = {case name: Op(...)} in the op's
    test module, tests/python/test_<stem>.py (discover.py finds it). The case name is c["op"], what
    --ops selects and what a report counts."""
    # (rng, c) -> the case's estimated seconds (seconds()): adds the op's shapes, layouts and options to
    # the case c (a dict of plain values: JSON), drawing from rng alone
    draw: Callable[[random.Random, dict], float]
    # (c, gen, dtype, dt, call) -> [Check]: makes the inputs from gen, runs opforge inside call(fn) (which
    # sets the case's ISA and threads) and gives each result with its float64 reference and bound
    check: Callable[..., list]
    # c -> the case's options and shapes, after the head describe() writes (op, dtype, ISA, threads)
    describe: Callable[[dict], str]
    weight: float  # the op's share of the cases of its stream, relative to the others' weights
    # the op's place in the draw, the order ops joined the fuzzer: a new op takes the next number
    # (equal numbers go by name)
    order: int
    # (variant, dtype) -> the names `rounding` is asked about that the variant rounds to the 16-bit dtype
    # (see above); the most specific key wins, and one must match: ("*", "*") for the rest
    rounded: dict
    covers: tuple[str, ...] = ()  # the library's forward ops its cases run (default: the case name)
    family: str = ""  # the kernel family (opforge.kernel_variants()) that rounds (default: the case name)
    # drawn from the main stream: the ops that were there when test_fuzz.py's seeds were chosen. The
    # others (a new op too) take LATER_SHARE of the cases from a stream of their own, so that every
    # other case of a seed stays the case it was
    seeded: bool = False


@functools.cache
def descriptions() -> dict[str, Op]:
    """{case name: Op} of every test module's FUZZ, with covers and family filled in, in draw order."""
    import discover  # it imports the test modules, which import this one: so here, once this one is whole

    ops = {}
    for name, op in discover.entries("FUZZ").items():
        if not isinstance(op, Op):
            raise TypeError(f"fuzz: FUZZ[{name!r}] is a {type(op).__name__}, not a fuzz.Op")
        ops[name] = dataclasses.replace(op, covers=op.covers or (name,), family=op.family or name)
    return dict(sorted(ops.items(), key=lambda kv: (kv[1].order, kv[0])))


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
    device: str = "cpu"  # where the ops run (device_mirror.py): "cuda" runs the CUDA kernels

    def args(self) -> list:
        """The command-line options that select the same cases."""
        out = []
        for flag, names in (("--ops", self.ops), ("--dtypes", self.dtypes), ("--isas", self.isas)):
            out += [flag, ",".join(names)] if names else []
        return out + (["--isa", self.isa] if self.isa else []) + (["--device", self.device]
                                                                  if self.device != "cpu" else [])


def draw(seed: int, index: int, sel: Selection = Selection()) -> dict:
    """Case `index` of `seed`: a dict of plain values (JSON), the same on every run with the same ISA
    list and the same descriptions. Draws again (from the same stream) while its estimated time is over
    its budget."""
    ops, isas = sel.ops, sel.isas or opforge.supported_isas()
    dtypes = [dt for dt in DTYPES if sel.dtypes is None or dt in sel.dtypes]
    described = descriptions()
    rng = random.Random(f"opforge-fuzz:{seed}:{index}")
    first = [name for name, d in described.items() if d.seeded and (ops is None or name in ops)]
    later = [name for name, d in described.items() if not d.seeded and (ops is None or name in ops)]
    op = rng.choices(first, [described[o].weight for o in first])[0] if first else None
    side = random.Random(f"opforge-fuzz-later:{seed}:{index}")
    if later and (op is None or side.random() < LATER_SHARE):
        op = side.choices(later, [described[o].weight for o in later])[0]
    if op is None:
        raise RuntimeError("fuzz: no op to draw: no test module describes " + (", ".join(ops) if ops else "any")
                           + " in its FUZZ table")
    budget = BIG_CASE_SECONDS if rng.random() < BIG_SHARE else CASE_SECONDS
    for _ in range(500):
        c = {"seed": seed, "index": index, "op": op,
             "dtype": rng.choices(dtypes, [DTYPE_WEIGHTS[dt] for dt in dtypes])[0],
             "isa": rng.choice(list(isas)), "threads": rng.choice((1, 2)), "data_seed": rng.getrandbits(62),
             "big": budget > CASE_SECONDS}
        cost = described[op].draw(rng, c)
        if cost <= budget:
            c["estimate_s"] = round(cost, 4)
            c["isa"] = sel.isa or c["isa"]
            if sel.device != "cpu":
                c["device"] = sel.device
            return c
    raise RuntimeError(f"fuzz: no case of {op} within {budget} s after 500 draws (seed {seed}, case {index})")


def describe(c: dict) -> str:
    return f"{c['op']} {c['dtype']} isa={c['isa']} threads={c['threads']} " + descriptions()[c["op"]].describe(c)


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


def out_tol(t: torch.Tensor, dt: str) -> torch.Tensor:
    return U_OUT[dt] * t.abs() + ATOL[dt]


def inputs(gen, specs):
    """[(base, view)] for [(shape, dtype, layout, fill, scale)]."""
    out = []
    for shape, dtype, lay, fill, scale in specs:
        base, view = make(gen, shape, dtype, lay, fill, scale)
        out.append((base, view))
    return out


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
            with device_mirror.on_device(c.get("device", "cpu")) as mode:
                out = fn()
            if mode is not None and mode.calls == 0:
                raise RuntimeError(f"no op of the case ran on {c['device']}")
            return out
        except Exception as e:  # noqa: BLE001
            raise OpError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        finally:
            res.seconds = time.perf_counter() - t0
            torch.set_num_threads(threads)
            opforge.set_isa("auto")

    c = {**c, "variants": kernel_variants(c["isa"])}
    try:
        checks = descriptions()[c["op"]].check(c, gen, dtype, dt, call)
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
    p.add_argument("--ops", help="comma-separated subset of " + ",".join(descriptions()))
    p.add_argument("--dtypes", help="comma-separated subset of " + ",".join(DTYPES))
    p.add_argument("--isas", help="the ISAs cases are drawn from (default: this CPU's, "
                   + ",".join(opforge.supported_isas()) + "): another CPU's list draws its cases, one forces it")
    p.add_argument("--isa", help="run every case under this ISA whatever it drew (one of this CPU's)")
    p.add_argument("--device", default="cpu", help="run the ops on this device (cuda: their CUDA kernels, "
                   "against the same float64 references on the CPU)")
    p.add_argument("--no-malloc-check", action="store_true", help="children without glibc's heap checks")
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--step", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    sel = Selection(*(tuple(v.split(",")) if v else None for v in (a.ops, a.dtypes, a.isas)), a.isa, a.device)
    for flag, names, known in (("--ops", sel.ops, descriptions()), ("--dtypes", sel.dtypes, DTYPES)):
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
