"""Fused linear + bias + GELU (opforge.linear) against eager
F.gelu(F.linear(x, w, b)) and torch.compile of it: forward and forward+backward
time ratios, and the peak memory of a forward+backward.

    python benchmarks/bench_linear.py [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import opforge
from opforge.benchmark import RESULTS, compare, peak_memory, plot, write_results


def eager(x, w, b):
    return F.gelu(F.linear(x, w, b))


def fused(x, w, b):
    return opforge.linear(x, w, b, "gelu")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    compiled = torch.compile(eager, dynamic=False)
    shapes = [(64, 32, 128)] if a.smoke else [(128, 1024, 4096), (1024, 1024, 4096), (4096, 1024, 4096), (4096, 4096, 1024)]
    variants = {"opforge": fused, "eager": eager, "compile": compiled}
    rows = []
    for tokens, hin, hout in shapes:
        x = torch.randn(tokens, hin)
        w = torch.randn(hout, hin) / hin**0.5
        b = torch.randn(hout)
        torch.testing.assert_close(fused(x, w, b), eager(x, w, b), rtol=1e-4, atol=1e-4)
        xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
        grad = torch.randn(tokens, hout)

        def step(f):
            f(xg, wg, bg).backward(grad)
            xg.grad = wg.grad = bg.grad = None

        reps, target = (3, 0.01) if a.smoke else (5, 0.3)
        fwd = compare({k: (lambda f=f: f(x, w, b)) for k, f in variants.items()}, reps=reps, target_s=target)
        both = compare({k: (lambda f=f: step(f)) for k, f in variants.items()}, reps=reps, target_s=target)
        mem = {k: peak_memory(lambda f=f: step(f)) for k, f in variants.items()}
        row = {"tokens": tokens, "in": hin, "out": hout,
               "fwd_vs_eager": fwd["eager"] / fwd["opforge"], "fwd_vs_compile": fwd["compile"] / fwd["opforge"],
               "fwdbwd_vs_eager": both["eager"] / both["opforge"], "fwdbwd_vs_compile": both["compile"] / both["opforge"],
               "peak_MiB_opforge": mem["opforge"] / 2**20, "peak_MiB_eager": mem["eager"] / 2**20,
               "mem_saved_vs_eager_pct": 100 * (1 - mem["opforge"] / mem["eager"]),
               "mem_saved_vs_compile_pct": 100 * (1 - mem["opforge"] / mem["compile"])}
        rows.append(row)
        print(f"{tokens}x{hin}->{hout}: fwd {row['fwd_vs_eager']:.2f}x eager {row['fwd_vs_compile']:.2f}x compile; "
              f"fwd+bwd {row['fwdbwd_vs_eager']:.2f}x eager {row['fwdbwd_vs_compile']:.2f}x compile; peak memory "
              f"{row['mem_saved_vs_eager_pct']:.0f}% less than eager, {row['mem_saved_vs_compile_pct']:.0f}% less than compile",
              flush=True)
    table = write_results("linear_gelu", rows, [
        f"fp32, ISA {opforge.get_isa()}; ratios = baseline time / opforge time (>1: opforge faster)",
        "peak memory: allocator high-water mark of one forward+backward (torch profiler memory events), "
        "inputs and parameters excluded, the same way for every variant",
    ], a.out)
    plot("linear_gelu", [r["tokens"] * r["out"] for r in rows],
         {k: [r[k] for r in rows] for k in ("fwd_vs_eager", "fwdbwd_vs_eager", "fwdbwd_vs_compile")},
         "tokens x out_features", "speed-up (x)", a.out)
    print(table)


if __name__ == "__main__":
    main()
