"""opforge.matmul (the GEMM engine) against torch.mm (MKL / oneDNN in the CPU
wheel) on square sizes and transformer shapes, one thread and all threads,
as GFLOP/s, % of the FMA peak measured in this process, and the ratio;
float32, and bfloat16 at two shapes.

    python benchmarks/bench_gemm.py [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes

import torch

import opforge
from opforge.benchmark import RESULTS, compare, fma_probe, plot, write_results

opforge.library.dll.opforge_gemm_matmul_key.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int64,
                                                                              ctypes.c_char_p, ctypes.c_size_t]


def provider(m, k, n, threads, dtype, mode):
    """The GEMM an m x k x n product's class runs on in mode: "own" or "torch" (auto: its choice)."""
    if mode != "auto":
        return mode
    key = ctypes.create_string_buffer(256)
    opforge.library.dll.opforge_gemm_matmul_key(m, n, k, int(dtype == "bfloat16"), threads, key, 256)
    hits = [c["provider"] for c in opforge.gemm_choices() if c["key"] == key.value.decode()]
    return hits[-1] if hits else "own"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    all_threads = torch.get_num_threads()
    mode = opforge.get_gemm()
    probe, probe_flops = fma_probe()
    square = [128, 256] if a.smoke else [256, 512, 1024, 2048]
    # (tokens, hidden in, hidden out): the MLP of a transformer, ratio 4
    mlp = [(128, 64, 256)] if a.smoke else [(128, 1024, 4096), (1024, 1024, 4096), (4096, 1024, 4096), (4096, 4096, 1024),
                                             (8192, 512, 2048), (512, 4096, 16384)]
    shapes = [(n, n, n) for n in square] + mlp
    # bfloat16 (float32 accumulation): the pair kernel where the ISA is avx512_bf16 or amx; % of twice the fp32
    # peak, the rate of one bfloat16 dot product (two products per lane) per FMA slot (no such bound for AMX
    # tiles: no % there)
    bf16_peak = 0 if opforge.get_isa() == "amx" else 2
    runs = [(torch.float32, shapes, 1, dict(rtol=1e-4, atol=1e-3)),
            (torch.bfloat16, [(128, 128, 128)] if a.smoke else [(1024, 1024, 1024), (4096, 1024, 4096)], bf16_peak,
             dict(rtol=2e-2, atol=2e-1))]
    rows = []
    for dtype, dtype_shapes, peak_factor, tol in runs:
        name = str(dtype).split(".")[1]
        for threads in sorted({1, all_threads}):
            torch.set_num_threads(threads)
            for m, k, n in dtype_shapes:
                x, w = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
                torch.testing.assert_close(opforge.matmul(x, w).float(), x.float() @ w.float(), **tol)
                opforge.set_gemm(mode)
                for _ in range(20):  # auto: the class's first products are its measurement (6, or 16 on a near
                    opforge.matmul(x, w)  # tie); the table shows what a long run gets after them
                    if provider(m, k, n, threads, name, mode) != "measuring":
                        break
                # opforge in its default mode (auto: the faster GEMM for the product's class, chosen on
                # its first call) and on its own kernels alone
                now = [None]  # the mode set last by a variant below

                def in_mode(md):  # the mode set once per run of calls, as a user sets it: set_gemm forgets the
                    def call():  # eager routing's kept answers, so a switch in every call would time their lookup
                        if now[0] != md:
                            opforge.set_gemm(md)
                            now[0] = md
                        return opforge.matmul(x, w)
                    return call

                variants = {"opforge": in_mode(mode), "own": in_mode("own"), "torch.mm": lambda: torch.mm(x, w)}
                if probe:  # the FMA peak sampled in the same rounds: the machine's speed drifts
                    variants["peak"] = probe
                t = compare(variants, reps=3 if a.smoke else 7, target_s=0.01 if a.smoke else 0.2)
                peak = peak_factor * probe_flops / t["peak"] / 1e9 * threads if probe and peak_factor else 0.0
                flops = 2 * m * n * k
                row = {"threads": threads, "M": m, "K": k, "N": n, "dtype": name,
                       "opforge_GFLOPs": flops / t["opforge"] / 1e9, "torch_mm_GFLOPs": flops / t["torch.mm"] / 1e9,
                       "opforge_pct_peak": 100 * flops / t["opforge"] / 1e9 / peak if peak else float("nan"),
                       "vs_torch_mm": t["torch.mm"] / t["opforge"], "own_vs_torch_mm": t["torch.mm"] / t["own"],
                       "provider": provider(m, k, n, threads, name, mode)}
                rows.append(row)
                print(f"{name} {threads} thr {m}x{k}x{n}: {row['opforge_GFLOPs']:.1f} GFLOP/s "
                      f"({row['opforge_pct_peak']:.0f}% of {peak:.0f}), torch.mm {row['torch_mm_GFLOPs']:.1f}: "
                      f"{row['vs_torch_mm']:.2f}x ({row['provider']}; own kernels {row['own_vs_torch_mm']:.2f}x)",
                      flush=True)
    torch.set_num_threads(all_threads)
    opforge.set_gemm(mode)
    table = write_results("gemm", rows, [
        f"ISA {opforge.get_isa()}; peak = an FMA loop in C (one thread, x threads), timed as a third "
        "variant in the same rounds as each shape, median against median; bfloat16 rows: twice that (a dot product of two bfloat16 pairs per lane)",
        f"vs_torch_mm: torch.mm time / opforge.matmul time (>1: opforge faster), GEMM provider mode {mode} "
        "(provider: the GEMM it chose for the shape's class); own_vs_torch_mm: opforge's own kernels alone",
    ], a.out)
    one = [r for r in rows if r["threads"] == 1 and r["M"] == r["K"] == r["N"] and r["dtype"] == "float32"]
    plot("gemm", [r["M"] for r in one], {"vs torch.mm (1 thread)": [r["vs_torch_mm"] for r in one],
                                         "% of peak / 100": [r["opforge_pct_peak"] / 100 for r in one]},
         "M = N = K", "ratio", a.out)
    print(table)


if __name__ == "__main__":
    main()
