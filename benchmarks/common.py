"""Shared benchmark method (see PERF.md): correctness first, warm-up, baseline
and candidate interleaved in one process, medians, ratios, CSV + markdown + PNG."""

from __future__ import annotations

import csv
import os
import statistics
import sys
import time
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))  # baselines come from the tests' refs
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _calibrate(fn: Callable[[], object], target_s: float) -> int:
    """Calls per timing sample so that one sample lasts about target_s."""
    n, elapsed = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= target_s / 4 or n >= 1 << 20:
            return max(1, int(n * target_s / max(elapsed, 1e-9)))
        n *= 4


def compare(fns: dict[str, Callable[[], object]], reps: int = 7, target_s: float = 0.05) -> dict[str, float]:
    """Median seconds per call of each fn, sampled round-robin so that drift in
    machine load hits every variant alike."""
    for fn in fns.values():  # warm-up (and compile)
        fn()
        fn()
    calls = {name: _calibrate(fn, target_s) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            n = calls[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    return {name: statistics.median(s) for name, s in samples.items()}


def write_results(stem: str, rows: list[dict], notes: list[str] | None = None, out_dir: str = RESULTS) -> str:
    """Writes <stem>.csv and <stem>.md; returns the markdown table."""
    os.makedirs(out_dir, exist_ok=True)
    cols = list(rows[0])
    with open(os.path.join(out_dir, f"{stem}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    table = "\n".join(lines)
    header = [f"# {stem}", "", environment(), ""] + [f"- {n}" for n in notes or []] + [""]
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write("\n".join(header) + table + "\n")
    return table


def environment() -> str:
    import opforge

    cpu = opforge.cpu_features()["model"] or "unknown CPU"
    return (
        f"torch {torch.__version__}, opforge {opforge.__version__}, {cpu}, ISA {opforge.get_isa()}, "
        f"{torch.get_num_threads()} threads. Ratios are medians of interleaved runs in one process."
    )


def plot(stem: str, x: list, series: dict[str, list[float]], xlabel: str, ylabel: str, out_dir: str = RESULTS,
         logx: bool = True, hline: float | None = 1.0) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in series.items():
        ax.plot(x, ys, marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if hline is not None:
        ax.axhline(hline, color="grey", lw=0.8, ls="--")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(stem)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, f"{stem}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
