"""opforge's fused cross_entropy against F.cross_entropy and torch.compile of
it: forward and forward+backward time ratios and the peak memory of a
forward+backward, at tokens 512..4096 x vocab 32000 and 128256 (float32, and
bfloat16 logits). opforge keeps one float64 logsumexp per row between forward
and backward; eager keeps the (tokens, vocab) log_softmax.

    python benchmarks/bench_cross_entropy.py [--smoke] [--max-elems N] [--threads T] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from opforge import functional as OF
from opforge.benchmark import RESULTS, compare, environment, peak_memory, plot, write_results


def eager(x, t):
    return F.cross_entropy(x, t)


def ours(x, t):
    return OF.cross_entropy(x, t)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--max-elems", type=int, default=1 << 27,
                   help="skip shapes with more logits (default 2**27: 512 MiB of float32 logits)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads for every variant (0: torch's default)")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    compiled = torch.compile(eager, dynamic=False)
    if a.smoke:
        shapes = [(64, 1000, torch.float32), (64, 1000, torch.bfloat16)]
    else:
        shapes = [(n, v, torch.float32) for v in (32000, 128256) for n in (512, 1024, 4096) if n * v <= a.max_elems]
        shapes += [(n, v, torch.bfloat16) for n, v in ((1024, 32000), (512, 128256)) if n * v <= a.max_elems]
    variants = {"opforge": ours, "eager": eager, "compile": compiled}
    rows = []
    for n, v, dtype in shapes:
        x = (torch.randn(n, v) * 2).to(dtype)
        t = torch.randint(0, v, (n,))
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        xg = x.clone().requires_grad_()
        xr = x.double().requires_grad_()
        want = eager(xr, t)
        want.backward()
        got = ours(xg, t)
        got.backward()
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(xg.grad.double(), xr.grad, rtol=10 * tol, atol=tol / n)
        del xr, want

        def step(f):
            f(xg, t).backward()
            xg.grad = None

        reps, target = (3, 0.01) if a.smoke else (5, 0.3)
        fwd = compare({k: (lambda f=f: f(x, t)) for k, f in variants.items()}, reps=reps, target_s=target)
        both = compare({k: (lambda f=f: step(f)) for k, f in variants.items()}, reps=reps, target_s=target)
        mem = {k: peak_memory(lambda f=f: step(f)) for k, f in variants.items()}
        row = {"dtype": str(dtype).split(".")[1], "tokens": n, "vocab": v,
               "fwdbwd_ms_opforge": both["opforge"] * 1e3,
               "fwd_vs_eager": fwd["eager"] / fwd["opforge"], "fwd_vs_compile": fwd["compile"] / fwd["opforge"],
               "fwdbwd_vs_eager": both["eager"] / both["opforge"],
               "fwdbwd_vs_compile": both["compile"] / both["opforge"],
               "peak_MiB_opforge": mem["opforge"] / 2**20, "peak_MiB_eager": mem["eager"] / 2**20,
               "mem_vs_eager": mem["opforge"] / mem["eager"], "mem_vs_compile": mem["opforge"] / mem["compile"]}
        rows.append(row)
        print(f"{row['dtype']} {n}x{v}: fwd {row['fwd_vs_eager']:.2f}x eager {row['fwd_vs_compile']:.2f}x compile; "
              f"fwd+bwd {row['fwdbwd_vs_eager']:.2f}x eager {row['fwdbwd_vs_compile']:.2f}x compile; peak memory "
              f"{row['mem_vs_eager']:.2f}x eager's, {row['mem_vs_compile']:.2f}x compile's", flush=True)
    table = write_results("cross_entropy" + ("_smoke" if a.smoke else ""), rows, [
        environment(),
        "ratios = baseline time / opforge time (>1: opforge faster); mem_*: opforge's peak / the baseline's "
        "(<1: opforge uses less)",
        "fwd: the mean loss; fwdbwd: loss.backward() into logits; peak memory: allocator high-water mark of one "
        "forward+backward (torch profiler memory events), logits and target excluded, the same way for every "
        "variant",
    ], a.out)
    fp32 = sorted((r for r in rows if r["dtype"] == "float32"), key=lambda r: r["tokens"] * r["vocab"])
    if fp32 and not a.smoke:
        plot("cross_entropy", [r["tokens"] * r["vocab"] for r in fp32],
             {k: [r[k] for r in fp32] for k in ("fwdbwd_vs_eager", "fwdbwd_vs_compile", "mem_vs_eager")},
             "tokens x vocab (float32)", "ratio", a.out)
    print(table)


if __name__ == "__main__":
    main()
