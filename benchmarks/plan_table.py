"""How opforge's GEMM plan gives work to 8-64 threads: for each product of bench_gemm.py and of
bench_transformer.py's default GPT step (forward, and the backward's dx and dweight), the tasks of a
pass, the tasks per thread and the largest idle share at 16 and 64 threads, read from the plan itself
(gemm_plan_make, the one the kernels run), since no 2-core machine can time 64 threads.

    python benchmarks/plan_table.py [--threads 8,16,32,64] [--out DIR]

idle share: 1 - tasks / (threads x the most tasks one worker runs); tasks are equal row blocks x
column chunks of one K slice of one N panel, so this is the share of thread-time a pass leaves idle.
"""

from __future__ import annotations

import argparse
import ctypes
import math

import opforge
from opforge.benchmark import RESULTS, write_results

_plan = opforge._runtime._dll.opforge_gemm_plan
_plan.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]


def plan(m, n, k, bf16, threads):
    out = (ctypes.c_int64 * 5)()
    _plan(m, n, k, int(bf16), threads, out)
    tasks, workers, mblocks, ntn, panels = out
    most = math.ceil(tasks / workers) if workers else 0
    return {"tasks": tasks, "row_blocks": mblocks, "col_chunks": ntn, "panels": panels,
            "tasks_per_thread": tasks / threads, "idle": 1 - tasks / (threads * most) if most else 1.0}


def products():
    """(where, m, n, k, bf16): C (m, n) = A (m, k) B (k, n)"""
    out = [(f"bench_gemm {s}^3", s, s, s, False) for s in (256, 512, 1024, 2048)]
    out += [(f"bench_gemm {m}x{k}x{n}", m, n, k, False) for m, k, n in (
        (128, 1024, 4096), (1024, 1024, 4096), (4096, 1024, 4096), (4096, 4096, 1024), (8192, 512, 2048),
        (512, 4096, 16384))]
    out += [(f"bench_gemm bf16 {m}x{k}x{n}", m, n, k, True) for m, k, n in ((1024, 1024, 1024), (4096, 1024, 4096))]
    # the default GPT step: 8 x 256 tokens, dim 512, 8 heads (2 key/value heads of 64), MLP 1408, vocab 8192
    t, d, kv, f, v = 2048, 512, 128, 1408, 8192
    for name, n, k in (("q/o proj", d, d), ("k/v proj", kv, d), ("MLP gate+up", 2 * f, d), ("MLP down", d, f),
                       ("LCE logits block", 2048, d)):
        out.append((f"GPT {name} fwd", t, n, k, False))
        out.append((f"GPT {name} dx", t, k, n, False))
        out.append((f"GPT {name} dweight", n, k, t, False))
    del v
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="16,64")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    counts = [int(x) for x in a.threads.split(",")]
    rows = []
    for where, m, n, k, bf16 in products():
        row = {"product": where, "M": m, "N": n, "K": k}
        for th in counts:
            pl = plan(m, n, k, bf16, th)
            row[f"tasks_{th}"] = pl["tasks"]
            row[f"per_thread_{th}"] = round(pl["tasks_per_thread"], 2)
            row[f"idle_{th}"] = f"{100 * pl['idle']:.0f}%"
        rows.append(row)
    print(write_results("gemm_plan", rows, [
        f"ISA {opforge.get_isa()} (the block sizes of its GEMM table); tasks of one pass over one K slice "
        "of one N panel; idle: the share of thread-time that pass leaves idle"], a.out))


if __name__ == "__main__":
    main()
