"""opforge softmax against F.softmax and torch.compile of it: forward and
forward+backward time ratios and the peak memory of a forward+backward, over
rows 512..8192 x C 512..32000, float32 and bfloat16 (the last dim, the common
case: attention scores, vocab logits).

    python benchmarks/bench_softmax.py [--smoke] [--max-elems N] [--threads T] [--dtypes D,...] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from opforge import functional as OF
from opforge.benchmark import RESULTS, compare, environment, peak_memory, plot, write_results


def eager(x):
    return F.softmax(x, -1)


def ours(x):
    return OF.softmax(x, -1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--max-elems", type=int, default=1 << 25,
                   help="skip shapes with more elements (default 2**25: 128 MiB of float32 per tensor)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads for every variant (0: torch's default)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    compiled = torch.compile(eager, dynamic=False)
    dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
    if a.smoke:
        shapes = [(64, 512, torch.float32), (64, 512, torch.bfloat16)]
    else:
        shapes = [(r, c, dt) for dt in dtypes for r in (512, 2048, 8192)
                  for c in (512, 4096, 32000) if r * c <= a.max_elems]
    variants = {"opforge": ours, "eager": eager, "compile": compiled}
    rows = []
    for n, c, dtype in shapes:
        x = (torch.randn(n, c) * 3).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(ours(x).double(), eager(x.double()), rtol=tol, atol=tol)
        xg = x.clone().requires_grad_()
        grad = torch.randn(n, c).to(dtype)
        xr = xg.detach().double().requires_grad_()
        eager(xr).backward(grad.double())
        ours(xg).backward(grad)
        torch.testing.assert_close(xg.grad.double(), xr.grad, rtol=10 * tol, atol=tol)

        def step(f):
            f(xg).backward(grad)
            xg.grad = None

        reps, target = (3, 0.01) if a.smoke else (7, 0.2)
        fwd = compare({k: (lambda f=f: f(x)) for k, f in variants.items()}, reps=reps, target_s=target)
        both = compare({k: (lambda f=f: step(f)) for k, f in variants.items()}, reps=reps, target_s=target)
        mem = {k: peak_memory(lambda f=f: step(f)) for k, f in variants.items()}
        row = {"dtype": str(dtype).split(".")[1], "rows": n, "C": c,
               "fwd_us_opforge": fwd["opforge"] * 1e6,
               "fwd_vs_eager": fwd["eager"] / fwd["opforge"], "fwd_vs_compile": fwd["compile"] / fwd["opforge"],
               "fwdbwd_vs_eager": both["eager"] / both["opforge"],
               "fwdbwd_vs_compile": both["compile"] / both["opforge"],
               "mem_vs_eager": mem["opforge"] / mem["eager"], "mem_vs_compile": mem["opforge"] / mem["compile"]}
        rows.append(row)
        print(f"{row['dtype']} {n}x{c}: fwd {row['fwd_vs_eager']:.2f}x F.softmax {row['fwd_vs_compile']:.2f}x compile; "
              f"fwd+bwd {row['fwdbwd_vs_eager']:.2f}x F.softmax {row['fwdbwd_vs_compile']:.2f}x compile; peak memory "
              f"{row['mem_vs_eager']:.2f}x eager's", flush=True)
    stem = "softmax" + ("_smoke" if a.smoke else "") + ("" if a.dtypes == "float32,bfloat16" else "_" + a.dtypes.replace(",", "_"))
    table = write_results(stem, rows, [
        environment(),
        "ratios = baseline time / opforge time (>1: opforge faster); mem_*: opforge's peak / the baseline's "
        "(<1: opforge uses less)",
        "fwd: y = softmax(x, -1); fwdbwd: y.backward(grad); peak memory: allocator high-water mark of one "
        "forward+backward (torch profiler memory events), the same way for every variant",
    ], a.out)
    fp32 = sorted((r for r in rows if r["dtype"] == "float32"), key=lambda r: r["rows"] * r["C"])
    if fp32 and not a.smoke:
        plot(stem, [r["rows"] * r["C"] for r in fp32],
             {k: [r[k] for r in fp32] for k in ("fwd_vs_eager", "fwd_vs_compile", "fwdbwd_vs_eager")},
             "rows x C (float32)", "speed-up (x)", a.out)
    print(table)


if __name__ == "__main__":
    main()
