"""dispersion_correction against eager PyTorch, torch.compile of the same
formula and two copy probes, 4K to 64M elements; then the per-call overhead on
a 1-element tensor against torch.sqrt.

Copy probes, run in the same process: `x.clone()` moves the same bytes into a
fresh output, as every op here must; `buf.copy_(x)` into a buffer written
before (no page faults) is the machine's copy bandwidth.

    python benchmarks/bench_dispersion_correction.py [--smoke] [--dtype float32]
"""

from __future__ import annotations

import argparse

import torch

import opforge
from opforge.benchmark import RESULTS, compare, plot, write_results
from opforge.references.dispersion_correction import dispersion_correction as reference
from opforge.testing import assert_close

ALPHA = 0.8


def bench_sizes(sizes, dtype, reps, target_s):
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    compiled = torch.compile(reference, dynamic=False)
    rows = []
    for n in sizes:
        x = torch.rand(n, dtype=dtype) + 0.01
        buf = torch.ones_like(x)
        y = opforge.dispersion_correction(x, ALPHA)
        assert_close(y, reference(x.double(), ALPHA), dtype, f"n={n}")  # correct before timed
        t = compare(
            {
                "opforge": lambda: opforge.dispersion_correction(x, ALPHA),
                "eager": lambda: reference(x, ALPHA),
                "compile": lambda: compiled(x, ALPHA),
                "clone": lambda: x.clone(),
                "copy_": lambda: buf.copy_(x),
            },
            reps=reps,
            target_s=target_s,
        )
        gbs = 2 * n * x.element_size() / t["opforge"] / 1e9
        rows.append(
            {
                "elements": n,
                "dtype": str(dtype).split(".")[1],
                "opforge_us": t["opforge"] * 1e6,
                "vs_eager": t["eager"] / t["opforge"],
                "vs_compile": t["compile"] / t["opforge"],
                "vs_clone": t["clone"] / t["opforge"],
                "copy_bw_share": t["copy_"] / t["opforge"],
                "opforge_GBps": gbs,
            }
        )
        print(
            f"{n:>10} {rows[-1]['dtype']}: vs eager {rows[-1]['vs_eager']:.2f}x  vs compile "
            f"{rows[-1]['vs_compile']:.2f}x  vs clone {rows[-1]['vs_clone']:.2f}x  copy-bandwidth share {rows[-1]['copy_bw_share']:.0%}  ({gbs:.1f} GB/s)",
            flush=True,
        )
    return rows


def bench_overhead(reps, target_s):
    a = torch.rand(1)
    op = torch.ops.opforge.dispersion_correction.default
    t = compare(
        {
            "torch.sqrt": lambda: torch.sqrt(a),
            "opforge.dispersion_correction": lambda: opforge.dispersion_correction(a, ALPHA),
            "torch.ops.opforge.dispersion_correction": lambda: op(a, ALPHA),
        },
        reps=reps,
        target_s=target_s,
    )
    with torch.inference_mode():
        b = torch.rand(1)
        ti = compare(
            {"torch.sqrt": lambda: torch.sqrt(b), "torch.ops.opforge.dispersion_correction": lambda: op(b, ALPHA)},
            reps=reps,
            target_s=target_s,
        )
    base = t["torch.sqrt"]
    rows = [
        {"call": name, "mode": "default", "us": v * 1e6, "vs_sqrt": v / base} for name, v in t.items()
    ] + [
        {"call": name, "mode": "inference_mode", "us": v * 1e6, "vs_sqrt": v / ti["torch.sqrt"]}
        for name, v in ti.items()
    ]
    for r in rows:
        print(f"{r['call']:>42} [{r['mode']}]: {r['us']:.2f} us, {r['vs_sqrt']:.2f}x torch.sqrt")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, few repeats (CI)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    if a.smoke:
        sizes, reps, target = [1 << 12, 1 << 16], 3, 0.005
    else:
        sizes, reps, target = [1 << k for k in range(12, 27, 2)], 9, 0.1  # 4K .. 64M
    rows = bench_sizes(sizes, dtype, reps, target)
    stem = f"dispersion_correction_{a.dtype}"
    notes = [
        "vs_eager / vs_compile: time of `x * alpha + torch.sqrt(x)` eager / torch.compile over opforge's time (>1: opforge faster)",
        "vs_clone: time of x.clone() (same bytes, same fresh output) over opforge's time",
        "copy_bw_share: opforge's bandwidth as a share of buf.copy_(x) into an already-touched buffer",
    ]
    table = write_results(stem, rows, notes, a.out)
    plot(stem, [r["elements"] for r in rows],
         {k: [r[k] for r in rows] for k in ("vs_eager", "vs_compile", "vs_clone", "copy_bw_share")},
         "elements", "speed-up (x)", a.out)
    over = bench_overhead(reps, target)
    write_results("dispersion_correction_overhead", over,
                  ["per call on a 1-element float32 tensor without grad; vs_sqrt: time over torch.sqrt's time"], a.out)
    print("\n" + table)


if __name__ == "__main__":
    main()
