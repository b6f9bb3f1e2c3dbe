"""Rotary position embedding (opforge.functional.rope) against Hugging Face's
eager q * cos + rotate_half(q) * sin (and the same for k) and torch.compile of
it, at Llama-like attention shapes: q and k as the attention layer makes them
(the (B, N, H, D) projection viewed as (B, H, N, D)), cos / sin (B, N, D) from
the rotary embedding. Forward and forward+backward time ratios and the peak
memory of a forward+backward, float32 and bfloat16.

    python benchmarks/bench_rope.py [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import opforge
from opforge import functional as F
from opforge.benchmark import RESULTS, compare, peak_memory, plot, write_results
from opforge.references import rope as reference
from opforge.references import rope_cos_sin


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def eager(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (Llama)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def fused(q, k, cos, sin):
    return F.rope(q, k, cos, sin)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    compiled = torch.compile(eager, dynamic=False)
    f32, bf16 = torch.float32, torch.bfloat16
    if a.smoke:
        shapes = [(1, 2, 2, 16, 64, f32), (1, 2, 2, 16, 64, bf16)]
    else:
        # (B, Hq, Hk, N, D): Llama-2 7B heads (32 x 128), grouped-query (32 over 8), 8 x 64 heads
        shapes = [(1, 32, 32, 512, 128, f32), (2, 8, 8, 2048, 64, f32), (4, 32, 32, 1024, 128, f32),
                  (1, 32, 8, 4096, 128, f32), (4, 8, 8, 4096, 64, f32),
                  (1, 32, 32, 512, 128, bf16), (4, 32, 32, 1024, 128, bf16), (1, 32, 8, 4096, 128, bf16)]
    variants = {"opforge": fused, "eager": eager, "compile": compiled}
    rows = []
    for b, hq, hk, n, d, dtype in shapes:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(b, n, hq, d, generator=gen).to(dtype).transpose(1, 2)
        k = torch.randn(b, n, hk, d, generator=gen).to(dtype).transpose(1, 2)
        cos, sin = (t[None].expand(b, n, d).to(dtype).contiguous() for t in rope_cos_sin(n, d))
        gq = torch.randn(b, n, hq, d, generator=gen).to(dtype).transpose(1, 2)
        gk = torch.randn(b, n, hk, d, generator=gen).to(dtype).transpose(1, 2)
        tol = 1e-5 if dtype == f32 else 2e-2
        for got, want in zip(fused(q, k, cos, sin), reference(q.double(), k.double(), cos.double(), sin.double())):
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()

        def step(fn):
            torch.autograd.backward(fn(qg, kg, cos, sin), (gq, gk))
            qg.grad = kg.grad = None

        reps, target = (3, 0.01) if a.smoke else (9, 0.2)
        fwd = compare({key: (lambda fn=fn: fn(q, k, cos, sin)) for key, fn in variants.items()}, reps=reps,
                      target_s=target)
        # fwd+bwd: the median and the best sample of each (contention on a shared machine only ever slows a sample)
        both_stats = compare({key: (lambda fn=fn: step(fn)) for key, fn in variants.items()}, reps=reps,
                             target_s=target, stat=lambda s: (statistics.median(s), min(s)))
        both, best = ({key: v[i] for key, v in both_stats.items()} for i in (0, 1))
        mem = {key: peak_memory(lambda fn=fn: step(fn)) for key, fn in variants.items()}
        row = {"dtype": str(dtype).split(".")[1], "B": b, "Hq": hq, "Hk": hk, "N": n, "D": d,
               "fwd_us": fwd["opforge"] * 1e6,
               "fwd_vs_eager": fwd["eager"] / fwd["opforge"], "fwd_vs_compile": fwd["compile"] / fwd["opforge"],
               "fwdbwd_us": both["opforge"] * 1e6,
               "fwdbwd_vs_eager": both["eager"] / both["opforge"],
               "fwdbwd_vs_compile": both["compile"] / both["opforge"],
               "fwdbwd_best_vs_eager": best["eager"] / best["opforge"],
               "fwdbwd_best_vs_compile": best["compile"] / best["opforge"],
               "peak_vs_eager": mem["opforge"] / mem["eager"], "peak_vs_compile": mem["opforge"] / mem["compile"]}
        rows.append(row)
        print(f"{row['dtype']} B{b} H{hq}/{hk} N{n} D{d}: fwd {row['fwd_vs_eager']:.2f}x eager "
              f"{row['fwd_vs_compile']:.2f}x compile; fwd+bwd {row['fwdbwd_vs_eager']:.2f}x eager "
              f"{row['fwdbwd_vs_compile']:.2f}x compile; peak memory {row['peak_vs_eager']:.2f}x eager's, "
              f"{row['peak_vs_compile']:.2f}x compile's", flush=True)
    table = write_results("rope", rows, [
        f"ISA {opforge.get_isa()}, {torch.get_num_threads()} threads; ratios = baseline time / opforge time "
        "(>1: opforge faster), medians of interleaved samples in shuffled order; fwdbwd_best_*: of each variant's "
        "fastest sample",
        "eager: transformers' apply_rotary_pos_emb (q * cos + rotate_half(q) * sin, same for k); compile: "
        "torch.compile of the same; q, k: (B, N, H, D) projections viewed as (B, H, N, D)",
        "peak_vs_*: allocator high-water mark of one forward+backward, opforge / baseline (<1: opforge less)",
    ], a.out)
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    plot("rope", [r["B"] * (r["Hq"] + r["Hk"]) * r["N"] * r["D"] for r in fp32],
         {key: [r[key] for r in fp32] for key in ("fwd_vs_eager", "fwdbwd_vs_eager", "fwdbwd_vs_compile")},
         "elements of q and k (float32)", "speed-up (x)", a.out)
    print(table)


if __name__ == "__main__":
    main()
