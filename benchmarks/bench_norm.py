"""RMSNorm, add + RMSNorm and LayerNorm (opforge.rms_norm, add_rms_norm,
layer_norm) against the hand-written eager formula, torch's own F.rms_norm /
F.layer_norm, and torch.compile of the eager formula: forward and
forward+backward time ratios and the peak memory of a forward+backward, at
Llama-like shapes (tokens 512..8192 x hidden 512..4096), float32 and bfloat16.

    python benchmarks/bench_norm.py [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import opforge
from opforge.benchmark import RESULTS, compare, peak_memory, plot, write_results

EPS = 1e-6


def eager_rms(x, w):
    """What a model writes by hand (Llama's RMSNorm): float32 statistics, one rounding at the end."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def eager_add_rms(x, r, w):
    s = x + r
    return eager_rms(s, w), s


def eager_layer(x, w, b):
    xf = x.float()
    mu = xf.mean(-1, keepdim=True)
    var = (xf - mu).pow(2).mean(-1, keepdim=True)
    return ((xf - mu) * torch.rsqrt(var + EPS) * w.float() + b.float()).to(x.dtype)


OPS = {
    # name: (opforge, eager formula, torch's function, inputs beyond x: "w", "r", "b")
    "rms_norm": (lambda x, w: opforge.rms_norm(x, w, EPS), eager_rms,
                 lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS), "w"),
    "add_rms_norm": (lambda x, r, w: opforge.add_rms_norm(x, r, w, EPS), eager_add_rms,
                     lambda x, r, w: (F.rms_norm(x + r, (x.shape[-1],), w, EPS), x + r), "rw"),
    "layer_norm": (lambda x, w, b: opforge.layer_norm(x, w, b, EPS), eager_layer,
                   lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS), "wb"),
}


def _outs(o):
    return o if isinstance(o, tuple) else (o,)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ", ".join(OPS))
    a = p.parse_args(argv)
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    f32, bf16 = torch.float32, torch.bfloat16
    if a.smoke:
        shapes = [(64, 128, f32), (64, 128, bf16)]
    else:
        shapes = [(512, 4096, f32), (2048, 2048, f32), (8192, 512, f32), (8192, 4096, f32), (2048, 4096, bf16),
                  (8192, 4096, bf16)]
    reps, target = (3, 0.01) if a.smoke else (5, 0.2)
    rows = []
    for name in a.ops.split(","):
        fused, eager, torch_fn, extra = OPS[name]
        compiled = torch.compile(eager, dynamic=False)
        variants = {"opforge": fused, "eager": eager, "torch": torch_fn, "compile": compiled}
        for tokens, hidden, dtype in shapes:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(tokens, hidden, generator=g).to(dtype)
            more = {"w": torch.randn(hidden, generator=g).to(dtype), "r": torch.randn(tokens, hidden, generator=g).to(dtype),
                    "b": torch.randn(hidden, generator=g).to(dtype)}
            args = (x, *(more[k] for k in extra))
            # correctness first: every variant against float64
            want = _outs(eager(*(t.double() for t in args)))
            tol = dict(rtol=1e-4, atol=1e-4) if dtype == f32 else dict(rtol=2e-2, atol=5e-2)
            for vname, f in variants.items():
                for got, w64 in zip(_outs(f(*args)), want):
                    torch.testing.assert_close(got.double(), w64, **tol, msg=lambda m, v=vname: f"{name} {v}: {m}")
            leaves = [t.clone().requires_grad_() for t in args]
            grads = [torch.randn(tokens, hidden, generator=g).to(dtype) for _ in want]

            def step(f):
                torch.autograd.backward(_outs(f(*leaves)), grads)
                for t in leaves:
                    t.grad = None

            fwd = compare({k: (lambda f=f: f(*args)) for k, f in variants.items()}, reps=reps, target_s=target,
                          stat=lambda s: (statistics.median(s), min(s)))
            both = compare({k: (lambda f=f: step(f)) for k, f in variants.items()}, reps=reps, target_s=target,
                           stat=lambda s: (statistics.median(s), min(s)))
            mem = {k: peak_memory(lambda f=f: step(f)) for k, f in variants.items()}
            row = {"op": name, "dtype": str(dtype).split(".")[1], "tokens": tokens, "hidden": hidden}
            for base in ("eager", "torch", "compile"):
                row[f"fwd_vs_{base}"] = fwd[base][0] / fwd["opforge"][0]
            for base in ("eager", "torch", "compile"):
                row[f"fwdbwd_vs_{base}"] = both[base][0] / both["opforge"][0]
            for base in ("eager", "torch", "compile"):
                row[f"fwdbwd_best_vs_{base}"] = both[base][1] / both["opforge"][1]
            row["fwdbwd_ms_opforge"] = both["opforge"][0] * 1e3
            for base in ("eager", "torch", "compile"):
                row[f"peak_mem_vs_{base}"] = mem["opforge"] / mem[base] if mem[base] else float("nan")
            rows.append(row)
            print(f"{name} {row['dtype']} {tokens}x{hidden}: fwd {row['fwd_vs_eager']:.2f}x eager "
                  f"{row['fwd_vs_torch']:.2f}x torch {row['fwd_vs_compile']:.2f}x compile; fwd+bwd "
                  f"{row['fwdbwd_vs_eager']:.2f}x eager {row['fwdbwd_vs_torch']:.2f}x torch "
                  f"{row['fwdbwd_vs_compile']:.2f}x compile (best samples {row['fwdbwd_best_vs_eager']:.2f}x, "
                  f"{row['fwdbwd_best_vs_torch']:.2f}x, {row['fwdbwd_best_vs_compile']:.2f}x); peak memory "
                  f"{row['peak_mem_vs_eager']:.2f}x eager's, {row['peak_mem_vs_compile']:.2f}x compile's", flush=True)
    table = write_results("norm", rows, [
        f"ISA {opforge.get_isa()}; ratios = baseline time / opforge time (>1: opforge faster)",
        "eager: the hand-written formula (Llama's RMSNorm: float32 statistics, one rounding; LayerNorm the same "
        "way); torch: F.rms_norm / F.layer_norm (add_rms_norm: x + r, then F.rms_norm); compile: "
        "torch.compile of the eager formula",
        "fwd+bwd: one forward and backward with gradients for x (and residual), weight (and bias); add_rms_norm "
        "gets a gradient on both outputs",
        "ratios are of medians over interleaved samples in shuffled order; fwdbwd_best_*: of each variant's "
        "fastest sample",
        "peak_mem_vs_*: opforge's allocator high-water mark of one forward+backward over the baseline's "
        "(<1: opforge holds less); inputs and incoming gradients excluded",
    ], a.out)
    f32_rows = [r for r in rows if r["dtype"] == "float32"]
    if f32_rows:
        _plot(f32_rows, a.out)
    print(table)


def _plot(rows, out):
    """One line per op and baseline: forward+backward speed-up against tokens x hidden (float32)."""
    series, x = {}, None
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["tokens"] * r["hidden"])
        x = [r["tokens"] * r["hidden"] for r in mine]
        for base in ("eager", "torch", "compile"):
            series[f"{op} vs {base}"] = [r[f"fwdbwd_vs_{base}"] for r in mine]
    return plot("norm", x, series, "tokens x hidden (float32)", "fwd+bwd speed-up (x)", out)


if __name__ == "__main__":
    main()
