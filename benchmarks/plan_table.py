"""How opforge's GEMM plan gives work to 8-64 threads: for each product of bench_gemm.py and of
bench_transformer.py's default GPT step (forward, and the backward's dx and dweight), the tasks of a
pass, the tasks per thread and the largest idle share at 8, 16, 32 and 64 threads, read from the plan itself
(gemm_plan_make, the one the kernels run), since no 2-core machine can time 64 threads.

    python benchmarks/plan_table.py [--threads 8,16,32,64] [--out DIR]

units: what the plan deals to the workers in one pass (one K slice of one N panel): row blocks, where
each worker packs its own A blocks, else row slivers x column chunks (gemm_col_chunks); where a pass has
fewer than 4 tiles a thread and K several slices, S slices at once (gemm_plan.ksplit: S x rows x
columns, a tile each, their sums added onto C in slice order afterwards). idle share:
1 - the pass's MR x NR tiles / (threads x the most tiles one worker runs), counted tile by tile as the
workers run them, so unequal row blocks or chunks count too.
packers: the threads busy packing B's slice before each pass (and A's, where its blocks are shared); a panel
with fewer slivers than threads has each sliver's packing cut into runs along K (gemm_pack_b_parts).
"""

from __future__ import annotations

import argparse
import ctypes

import opforge
from opforge.benchmark import RESULTS, write_results

_plan = opforge._runtime._dll.opforge_gemm_plan
_plan.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]


def plan(m, n, k, bf16, threads):
    out = (ctypes.c_int64 * 10)()
    _plan(m, n, k, int(bf16), threads, out)
    units, workers, rows, ntn, panels, pack_b, pack_a, most, tiles, ksplit = out
    return {"units": units, "rows": rows, "col_chunks": ntn, "panels": panels, "ksplit": ksplit,
            "packers": f"{min(threads, pack_b + pack_a)}" if ksplit > 1 else  # one phase packs both
            f"{min(threads, pack_b)}" + (f"+{min(threads, pack_a)}" if pack_a else ""),
            "units_per_thread": units / threads, "idle": 1 - tiles / (threads * most) if most else 1.0}


def products():
    """(where, m, n, k, bf16): C (m, n) = A (m, k) B (k, n)"""
    out = [(f"bench_gemm {s}^3", s, s, s, False) for s in (256, 512, 1024, 2048)]
    out += [(f"bench_gemm {m}x{k}x{n}", m, n, k, False) for m, k, n in (
        (128, 1024, 4096), (1024, 1024, 4096), (4096, 1024, 4096), (4096, 4096, 1024), (8192, 512, 2048),
        (512, 4096, 16384))]
    out += [(f"bench_gemm bf16 {m}x{k}x{n}", m, n, k, True) for m, k, n in ((1024, 1024, 1024), (4096, 1024, 4096))]
    # deep K against few rows and columns: a pass of one K slice has fewer tiles than 4 a thread
    out += [(f"deep K {m}x{k}x{n}", m, n, k, False) for m, k, n in ((32, 8192, 256), (64, 4096, 512), (64, 65536, 64))]
    # the default GPT step: 8 x 256 tokens, dim 512, 8 heads (2 key/value heads of 64), MLP 1408, vocab 8192
    t, d, kv, f, v = 2048, 512, 128, 1408, 8192
    for name, n, k in (("q/o proj", d, d), ("k/v proj", kv, d), ("MLP gate+up", 2 * f, d), ("MLP down", d, f),
                       ("LCE logits block", 2048, d)):
        out.append((f"GPT {name} fwd", t, n, k, False))
        out.append((f"GPT {name} dx", t, k, n, False))
        out.append((f"GPT {name} dweight", n, k, t, False))
    del v
    return out


_attn_costs = opforge._runtime._dll.opforge_attention_plan_costs
_attn_costs.argtypes = [ctypes.c_int64] * 6 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                                               ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
_attn_costs.restype = ctypes.c_int64


def pulled_idle(costs, threads) -> float:
    """The share of thread-time idle when `threads` workers pull tasks of these costs in order, each the
    next task as soon as it is free (as attention's workers pull from their counter): 1 - work /
    (threads x the last finish)."""
    free = [0] * threads
    for c in costs:
        i = min(range(threads), key=free.__getitem__)
        free[i] += c
    end = max(free) if costs else 0
    return 1 - sum(costs) / (threads * end) if end else 0.0


def attention_rows(counts):
    """Attention: tasks (query blocks x heads x key splits forward; head groups or key blocks
    backward) per thread, and the idle share of the workers pulling them (pulled_idle), each task's
    cost the query-key pairs it computes (causal tasks differ)."""
    rows = []
    for where, b, h, hkv, n, causal in (("GPT attention (B8 H8 Hkv2 N256 D64, causal)", 8, 8, 2, 256, True),
                                        ("bench_attention B4 H8 N1024 D64", 4, 8, 8, 1024, False),
                                        ("bench_attention B4 H8 N1024 D64 causal", 4, 8, 8, 1024, True),
                                        ("bench_attention B1 H8 N1024 D64", 1, 8, 8, 1024, False)):
        row = {"product": where}
        for th in counts:
            for part, bwd in (("fwd", 0), ("bwd", 1)):
                tasks = _attn_costs(b, h, hkv, n, n, 64, int(causal), th, bwd, None, 0)
                costs = (ctypes.c_int64 * max(tasks, 1))()
                _attn_costs(b, h, hkv, n, n, 64, int(causal), th, bwd, costs, tasks)
                row[f"{part}_tasks_{th}"], row[f"{part}_per_thread_{th}"] = tasks, round(tasks / th, 2)
                row[f"{part}_idle_{th}"] = f"{100 * pulled_idle(list(costs)[:tasks], th):.0f}%"
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="8,16,32,64")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    counts = [int(x) for x in a.threads.split(",")]
    rows = []
    for where, m, n, k, bf16 in products():
        row = {"product": where, "M": m, "N": n, "K": k}
        for th in counts:
            pl = plan(m, n, k, bf16, th)
            row[f"units_{th}"] = (f"{pl['ksplit']}x" if pl["ksplit"] > 1 else "") + f"{pl['rows']}x{pl['col_chunks']}"
            row[f"per_thread_{th}"] = round(pl["units_per_thread"], 2)
            row[f"idle_{th}"] = f"{100 * pl['idle']:.0f}%"
            row[f"packers_{th}"] = pl["packers"]
        rows.append(row)
    print(write_results("attention_plan", attention_rows(counts), [
        "tasks of attention's forward and backward plans, per thread; idle: the share of thread-time left "
        "idle by the workers pulling the tasks in the plan's order, each the next as soon as it is free, a "
        "task's cost the query-key pairs it computes (the backward's waits for its turns to add into dQ "
        "and into a cut key block's dK and dV are not counted: a lower bound there)"], a.out, timed=False))
    print(write_results("gemm_plan", rows, [
        f"ISA {opforge.get_isa()} (the block sizes of its GEMM table); units of one pass over one K slice of "
        "one N panel, dealt to the workers in contiguous runs: row blocks x 1 where each worker packs its own A "
        "blocks (packers without +), else row slivers x column chunks; idle: the share of thread-time that pass "
        "leaves idle, counted in MR x NR tiles (unequal blocks or chunks included); S x rows x columns: S K "
        "slices run at once (fewer tiles than 4 a thread in one slice's pass), a tile each, then added onto C "
        "in slice order",
        "packers: the threads that pack a K slice of B's panel before the pass (+ those that pack A, where its "
        "blocks are shared by the workers rather than packed by each worker); where the panel has fewer slivers "
        "than threads, each sliver's packing is cut into runs along K of 16 KiB or more; slices at once: the "
        "threads that pack their A and B in one phase"], a.out, timed=False))


if __name__ == "__main__":
    main()
