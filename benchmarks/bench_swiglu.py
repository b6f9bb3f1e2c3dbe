"""SwiGLU (opforge.functional.swiglu) against eager F.silu(gate) * up (as
Llama's MLP writes it) and torch.compile of it, at Llama-like MLP shapes
(tokens x intermediate size): forward and forward+backward time ratios and
the peak memory of a forward+backward, float32 and bfloat16.

    python benchmarks/bench_swiglu.py [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as TF

import opforge
from opforge import functional as F
from opforge.benchmark import RESULTS, compare, peak_memory, plot, write_results
from opforge.references import glu as reference


def eager(gate, up):
    return TF.silu(gate) * up


def fused(gate, up):
    return F.swiglu(gate, up)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    compiled = torch.compile(eager, dynamic=False)
    f32, bf16 = torch.float32, torch.bfloat16
    if a.smoke:
        shapes = [(64, 128, f32), (64, 128, bf16)]
    else:
        # tokens 512..8192 x intermediate 1408 (TinyLlama-like / 4) .. 11008 (Llama-2 7B)
        shapes = [(512, 1408, f32), (2048, 2816, f32), (2048, 5632, f32), (4096, 11008, f32), (8192, 1408, f32),
                  (512, 1408, bf16), (2048, 5632, bf16), (4096, 11008, bf16)]
    variants = {"opforge": fused, "eager": eager, "compile": compiled}
    rows = []
    for tokens, f, dtype in shapes:
        gen = torch.Generator().manual_seed(0)
        gate = (torch.randn(tokens, f, generator=gen) * 2).to(dtype)
        up = torch.randn(tokens, f, generator=gen).to(dtype)
        grad = torch.randn(tokens, f, generator=gen).to(dtype)
        tol = 1e-5 if dtype == f32 else 2e-2
        want = reference(gate.double(), up.double(), "silu")
        torch.testing.assert_close(fused(gate, up).double(), want, rtol=tol, atol=tol)
        gg, ug = gate.clone().requires_grad_(), up.clone().requires_grad_()

        def step(fn):
            fn(gg, ug).backward(grad)
            gg.grad = ug.grad = None

        reps, target = (3, 0.01) if a.smoke else (9, 0.2)
        fwd = compare({k: (lambda fn=fn: fn(gate, up)) for k, fn in variants.items()}, reps=reps, target_s=target)
        # fwd+bwd: the median and the best sample of each (contention on a shared machine only ever slows a sample)
        both_stats = compare({k: (lambda fn=fn: step(fn)) for k, fn in variants.items()}, reps=reps, target_s=target,
                             stat=lambda s: (statistics.median(s), min(s)))
        both, best = ({k: v[i] for k, v in both_stats.items()} for i in (0, 1))
        mem = {k: peak_memory(lambda fn=fn: step(fn)) for k, fn in variants.items()}
        row = {"dtype": str(dtype).split(".")[1], "tokens": tokens, "F": f,
               "fwd_us": fwd["opforge"] * 1e6,
               "fwd_vs_eager": fwd["eager"] / fwd["opforge"], "fwd_vs_compile": fwd["compile"] / fwd["opforge"],
               "fwdbwd_us": both["opforge"] * 1e6,
               "fwdbwd_vs_eager": both["eager"] / both["opforge"],
               "fwdbwd_vs_compile": both["compile"] / both["opforge"],
               "fwdbwd_best_vs_eager": best["eager"] / best["opforge"],
               "fwdbwd_best_vs_compile": best["compile"] / best["opforge"],
               "GBps_fwdbwd": 9 * tokens * f * gate.element_size() / both["opforge"] / 1e9,
               "peak_vs_eager": mem["opforge"] / mem["eager"], "peak_vs_compile": mem["opforge"] / mem["compile"]}
        rows.append(row)
        print(f"{row['dtype']} {tokens}x{f}: fwd {row['fwd_vs_eager']:.2f}x eager {row['fwd_vs_compile']:.2f}x "
              f"compile; fwd+bwd {row['fwdbwd_vs_eager']:.2f}x eager {row['fwdbwd_vs_compile']:.2f}x compile; "
              f"peak memory {row['peak_vs_eager']:.2f}x eager's, {row['peak_vs_compile']:.2f}x compile's", flush=True)
    table = write_results("swiglu", rows, [
        f"ISA {opforge.get_isa()}, {torch.get_num_threads()} threads; ratios = baseline time / opforge time "
        "(>1: opforge faster), medians of interleaved samples in shuffled order; fwdbwd_best_*: of each variant's "
        "fastest sample",
        "eager: F.silu(gate) * up; compile: torch.compile of the same; gate and up separate (T, F) tensors",
        "GBps_fwdbwd: the 9 tensor passes of a forward+backward (forward reads gate, up and writes out; backward "
        "reads grad, gate, up and writes dgate, dup) per second",
        "peak_vs_*: allocator high-water mark of one forward+backward, opforge / baseline (<1: opforge less)",
    ], a.out)
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    plot("swiglu", [r["tokens"] * r["F"] for r in fp32],
         {k: [r[k] for r in fp32] for k in ("fwd_vs_eager", "fwdbwd_vs_eager", "fwdbwd_vs_compile")},
         "tokens x F (float32)", "speed-up (x)", a.out)
    print(table)


if __name__ == "__main__":
    main()
