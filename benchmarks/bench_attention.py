"""Fused attention (opforge.scaled_dot_product_attention) against PyTorch's
fused CPU kernel (F.scaled_dot_product_attention) and eager math attention
(softmax(q k^T * scale + mask) v, as written by hand): forward and
forward+backward time ratios, forward as % of the FMA peak measured in this
process (unmasked FLOPs only), and the peak memory of a forward+backward.
Then KV-cache decoding (opforge.attention_decode: N new tokens against S cached keys, grouped-query
heads, the cache a view of a preallocated (B, Hkv, S_max, D) buffer) against F.scaled_dot_product_attention
on the sliced cache (enable_gqa=True) and torch.compile of it, with the bandwidth the decode reaches
(bytes of K and V read / time) as a % of a plain copy of the same K and V measured in the same rounds.

    python benchmarks/bench_attention.py [--smoke] [--only train|decode] [--small] [--out DIR]

--small: the training part on small shapes only (B x H of 1 and 2, N 64 to 256, where the query blocks
alone are too few to keep the cores busy), with (4, 8, 128, 64) for comparison, into attention_small.md.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import opforge
from opforge.benchmark import RESULTS, compare, fma_probe, peak_memory, write_results


def math_attention(q, k, v, causal):
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


VARIANTS = {
    "opforge": lambda q, k, v, causal: opforge.scaled_dot_product_attention(q, k, v, is_causal=causal),
    "sdpa": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    "math": math_attention,
}


def unmasked_pairs(n: int, s: int, causal: bool) -> int:
    """(query, key) pairs a causal (top-left) mask keeps."""
    if not causal:
        return n * s
    return sum(min(i + 1, s) for i in range(n))


def bar_plot(rows, out_dir, stem="attention"):
    """fwd+bwd speed-ups per configuration, as bars (configs differ in more than one dimension)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{ {'float32': 'fp32', 'bfloat16': 'bf16'}.get(r['dtype'], r['dtype'])} {r['B']}x{r['H']} N{r['N']} D{r['D']}{' c' if r['causal'] else ''}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(7, 0.5 * len(rows)), 4.5))
    for k, (key, name) in enumerate([("fwdbwd_vs_sdpa", "fwd+bwd vs F.sdpa"), ("fwdbwd_vs_math", "fwd+bwd vs math")]):
        ax.bar([i + 0.4 * k for i in x], [min(r[key], 10) for r in rows], width=0.4, label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks([i + 0.2 for i in x], labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("speed-up (x, capped at 10)")
    ax.set_title("attention (B x H, N, D; c = causal)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{stem}.png"), dpi=110)
    plt.close(fig)


def sdpa_decode(q, k, v, mask):
    """What a user writes without opforge: SDPA on the used part of the cache."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def bench_decode(smoke: bool, out_dir: str) -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    # (B, H, Hkv, D, N new tokens, S cached keys, dtype): Llama-3-8B-like heads
    if smoke:
        grid = [(1, 4, 2, 64, 1, 300, f32), (1, 4, 2, 64, 3, 300, bf16)]
    else:
        grid = [(1, 32, 8, 128, 1, 4096, f32), (1, 32, 8, 128, 1, 32768, f32), (1, 32, 8, 128, 4, 4096, f32),
                (1, 32, 8, 128, 4, 32768, f32), (1, 32, 8, 128, 1, 4096, bf16), (1, 32, 8, 128, 1, 32768, bf16)]
    compiled = torch.compile(sdpa_decode, fullgraph=True)
    rows = []
    for b, h, hkv, d, n, s, dtype in grid:
        s_max = s + 256  # a preallocated cache with room left
        g = torch.Generator().manual_seed(0)
        kbuf, vbuf = (torch.randn(b, hkv, s_max, d, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(b, h, n, d, generator=g).to(dtype)
        lens = torch.full((b,), s, dtype=torch.int32)
        k, v = kbuf[:, :, :s], vbuf[:, :, :s]
        # N > 1: the new tokens are the last N of the cache (bottom-right causal), an explicit mask for SDPA
        mask = None if n == 1 else torch.arange(s).view(1, -1) <= (s - n + torch.arange(n)).view(-1, 1)
        kcopy, vcopy = torch.empty_like(k), torch.empty_like(v)

        def copy():
            kcopy.copy_(k)
            vcopy.copy_(v)

        with torch.no_grad():
            got = opforge.attention_decode(q, kbuf, vbuf, lens, causal=n > 1)
            want = sdpa_decode(q.double(), k.double(), v.double(), mask)
            tol = 2e-5 if dtype == f32 else 2e-2
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
            reps, target = (3, 0.01) if smoke else (7, 0.2)
            t = compare({"opforge": lambda: opforge.attention_decode(q, kbuf, vbuf, lens, causal=n > 1),
                         "sdpa": lambda: sdpa_decode(q, k, v, mask), "compiled": lambda: compiled(q, k, v, mask),
                         "attention": lambda: opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                         "copy": copy}, reps=reps, target_s=target)
        kv_bytes = (k.numel() + v.numel()) * k.element_size()
        bw = kv_bytes / t["opforge"] / 1e9
        copy_bw = 2 * kv_bytes / t["copy"] / 1e9  # a copy reads and writes every byte
        row = {"dtype": str(dtype).split(".")[1], "B": b, "H": h, "Hkv": hkv, "D": d, "N": n, "S": s,
               "us_opforge": t["opforge"] * 1e6, "vs_sdpa": t["sdpa"] / t["opforge"],
               "vs_compile": t["compiled"] / t["opforge"], "attention_vs_sdpa": t["sdpa"] / t["attention"], "GBs": bw, "copy_GBs": copy_bw,
               "pct_copy_bw": 100 * bw / copy_bw}
        rows.append(row)
        print(f"decode {row['dtype']} B={b} H={h} Hkv={hkv} D={d} N={n} S={s}: {row['us_opforge']:.0f} us, "
              f"{row['vs_sdpa']:.2f}x sdpa, {row['vs_compile']:.2f}x compiled sdpa (the attention op on the sliced "
              f"cache: {row['attention_vs_sdpa']:.2f}x sdpa); {bw:.1f} GB/s of K/V read, "
              f"{row['pct_copy_bw']:.0f}% of a copy's {copy_bw:.1f} GB/s", flush=True)
    table = write_results("attention_decode", rows, [
        f"ISA {opforge.get_isa()}, {torch.get_num_threads()} threads; ratios = baseline time / opforge time "
        "(>1: opforge faster); sdpa = F.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S], "
        "enable_gqa=True) (N > 1: with a bottom-right causal bool mask), compile = torch.compile of it; "
        "attention_vs_sdpa: opforge.scaled_dot_product_attention on the same sliced cache and mask (no seq_lens: "
        "what a model without a cache object calls) against that sdpa",
        "GBs: bytes of the K and V rows read / opforge's median time; copy_GBs: (bytes read + bytes written) / "
        "time of copy_ of the same K and V into preallocated tensors, timed in the same rounds; pct_copy_bw = "
        "GBs / copy_GBs",
    ], out_dir)
    print(table)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--only", choices=("train", "decode"), help="run one of the two parts")
    p.add_argument("--small", action="store_true", help="the training part on small shapes only")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    if a.only != "train":
        bench_decode(a.smoke, a.out)
    if a.only == "decode":
        return
    f32, bf16 = torch.float32, torch.bfloat16
    # (batch, heads, N, D, dtype): B x H in {1, 8, 32}; each with and without a causal mask; small
    # shapes: B x H in {1, 2} with N in {64, 128, 256}, fewer query blocks than cores
    small = [(b, h, n, 64, f32) for b, h in ((1, 1), (1, 2)) for n in (64, 128, 256)] + [(4, 8, 128, 64, f32)]
    if a.smoke:
        grid = [(1, 2, 64, 32, f32), (1, 2, 64, 32, bf16)]
    else:
        grid = [(4, 8, 1024, 64, f32), (1, 1, 1024, 64, f32), (1, 1, 4096, 64, f32), (1, 8, 512, 64, f32),
                (1, 8, 2048, 64, f32), (4, 8, 128, 64, f32), (4, 8, 512, 64, f32), (1, 8, 1024, 128, f32),
                (1, 8, 1024, 64, bf16)] + small[:-1]
    if a.small:
        grid = small
    threads = torch.get_num_threads()
    probe, probe_flops = fma_probe()
    rows = []
    for b, h, n, d, dtype in grid:
        for causal in (False, True):
            q, k, v = (torch.randn(b, h, n, d).to(dtype) for _ in range(3))
            want = math_attention(q.double(), k.double(), v.double(), causal)
            tol = 2e-5 if dtype == f32 else 2e-2
            torch.testing.assert_close(VARIANTS["opforge"](q, k, v, causal).double(), want, rtol=tol, atol=tol)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            grad = torch.randn(b, h, n, d).to(dtype)

            def step(f):
                f(*leaves, causal).backward(grad)
                for t in leaves:
                    t.grad = None

            reps, target = (3, 0.01) if a.smoke else (5, 0.3)
            with torch.no_grad():  # the FMA peak sampled in the same rounds as the forward: speed drifts
                fwd = compare({**{name: (lambda f=f: f(q, k, v, causal)) for name, f in VARIANTS.items()},
                               **({"peak": probe} if probe else {})}, reps=reps, target_s=target)
            peak = probe_flops / fwd["peak"] / 1e9 * threads if probe else 0.0
            both = compare({name: (lambda f=f: step(f)) for name, f in VARIANTS.items()}, reps=reps, target_s=target)
            mem = {name: peak_memory(lambda f=f: step(f)) for name, f in VARIANTS.items()}
            flops = 4 * b * h * d * unmasked_pairs(n, n, causal)
            row = {"dtype": str(dtype).split(".")[1], "B": b, "H": h, "N": n, "D": d, "causal": causal,
                   "fwd_vs_sdpa": fwd["sdpa"] / fwd["opforge"], "fwd_vs_math": fwd["math"] / fwd["opforge"],
                   "fwdbwd_vs_sdpa": both["sdpa"] / both["opforge"], "fwdbwd_vs_math": both["math"] / both["opforge"],
                   "fwd_GFLOPs": flops / fwd["opforge"] / 1e9,
                   "fwd_pct_peak": 100 * flops / fwd["opforge"] / 1e9 / peak if peak else float("nan"),
                   "peak_MiB_opforge": mem["opforge"] / 2**20, "peak_MiB_sdpa": mem["sdpa"] / 2**20,
                   "peak_MiB_math": mem["math"] / 2**20,
                   "mem_saved_vs_sdpa_pct": 100 * (1 - mem["opforge"] / mem["sdpa"]),
                   "mem_saved_vs_math_pct": 100 * (1 - mem["opforge"] / mem["math"])}
            rows.append(row)
            print(f"{row['dtype']} B={b} H={h} N={n} D={d} causal={causal}: fwd {row['fwd_vs_sdpa']:.2f}x sdpa "
                  f"{row['fwd_vs_math']:.2f}x math ({row['fwd_pct_peak']:.0f}% of peak); fwd+bwd "
                  f"{row['fwdbwd_vs_sdpa']:.2f}x sdpa {row['fwdbwd_vs_math']:.2f}x math; peak memory "
                  f"{row['mem_saved_vs_sdpa_pct']:.0f}% less than sdpa, {row['mem_saved_vs_math_pct']:.0f}% less than math",
                  flush=True)
    stem = "attention_small" if a.small else "attention"  # a file of its own: a full run's is kept
    table = write_results(stem, rows, [
        f"ISA {opforge.get_isa()}; ratios = baseline time / opforge time (>1: opforge faster); sdpa = "
        "F.scaled_dot_product_attention (PyTorch's fused CPU kernel), math = softmax(q k^T * scale) v in eager ops",
        f"fwd_pct_peak: unmasked forward FLOPs (4 D per kept query-key pair) / time / FMA peak: a single-thread "
        f"FMA loop x {threads} threads, timed as one more variant in the forward's rounds, median against median",
        "peak memory: allocator high-water mark of one forward+backward (the running total of the torch "
        "profiler's memory events), inputs excluded, the same way for every variant",
    ], a.out)
    bar_plot(rows, a.out, stem)
    print(table)


if __name__ == "__main__":
    main()
