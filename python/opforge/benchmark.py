"""Benchmarking an op against its PyTorch reference: correctness first,
warm-up, baseline and candidate interleaved in one process, medians, ratios,
peak memory measured alike for both, CSV + markdown + PNG.

    import opforge.benchmark as ob
    rows = ob.bench(torch.ops.opforge.dispersion_correction, reference, sizes=[1 << 16, 1 << 20])
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import torch

RESULTS = os.path.join(os.getcwd(), "benchmarks", "results")


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


def compare(fns: dict[str, Callable[[], object]], reps: int = 7, target_s: float = 0.05,
            stat: Callable[[list[float]], Any] = statistics.median, into: dict | None = None,
            warm: bool = True) -> dict[str, Any]:
    """Median seconds per call of each fn (or another `stat` of its samples,
    such as min), sampled round-robin so that drift in machine load hits every
    variant alike. The order changes every round (a fixed shuffle): with calls
    of a large op, whatever one variant leaves behind (freed memory, cold
    caches, busy threads) would otherwise always fall on the variant that
    follows it. into: a dict of sample lists to add to (measure() takes more rounds into it); warm: False
    when the variants ran already."""
    if warm:
        for fn in fns.values():  # warm-up (and compile)
            fn()
            fn()
    calls = {name: _calibrate(fn, target_s) for name, fn in fns.items()}
    samples: dict[str, list[float]] = into if into is not None else {}
    for name in fns:
        samples.setdefault(name, [])
    order, shuffle = list(fns), random.Random(0)
    for _ in range(reps):
        for name in order:
            fn, n = fns[name], calls[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
        shuffle.shuffle(order)
    return {name: stat(s) for name, s in samples.items()}


# A variant's timing is trusted when the middle half of its samples lies within this factor (third quartile
# / first quartile); measure() takes more rounds until every variant's does, within its time budget.
SPREAD_BOUND = 1.25
# A ratio past this (either way) is not printed: on these ops it means one side's time is not the op's work
# (seen: eager x * a + sqrt(x) on 16K floats at 0.04 to 7.8 ms a call on a VM, fresh memory's page faults).
MAX_RATIO = 100.0


@dataclasses.dataclass
class Timing:
    """Seconds per call of one variant: the median, the quartiles and how many samples they come from."""

    median: float
    q1: float
    q3: float
    samples: int

    @property
    def spread(self) -> float:
        return self.q3 / self.q1 if self.q1 > 0 else math.inf

    @property
    def reliable(self) -> bool:
        return self.spread <= SPREAD_BOUND


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def measure(fns: dict[str, Callable[[], object]], reps: int = 7, target_s: float = 0.05,
            budget_s: float | None = None) -> dict[str, Timing]:
    """compare()'s interleaved rounds, then more rounds while any variant's spread (the middle half of its
    samples, q3/q1) is above SPREAD_BOUND, until `budget_s` seconds of sampling (default: 4x what the first
    rounds took). A variant still over the bound then is reported as such (Timing.reliable), for the
    caller to say so instead of printing a ratio from it."""
    samples: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    compare(fns, reps=reps, target_s=target_s, stat=lambda s: s, into=samples)
    first = time.perf_counter() - t0
    deadline = time.perf_counter() + (budget_s if budget_s is not None else 4 * first)
    while time.perf_counter() < deadline:
        if all(_quartiles(s)[2] <= SPREAD_BOUND * _quartiles(s)[0] for s in samples.values()):
            break
        compare(fns, reps=1, target_s=target_s, stat=lambda s: s, into=samples, warm=False)
    return {k: Timing(_quartiles(s)[1], _quartiles(s)[0], _quartiles(s)[2], len(s)) for k, s in samples.items()}


def ratio_text(base: Timing, ours: Timing, bound: float = MAX_RATIO) -> str:
    """base / ours as a reader may take it: "2.31x (2.20-2.43)" (the ratio of medians, and of the
    quartiles' extremes); "unreliable (...)" when either side's spread is past SPREAD_BOUND; "not shown"
    past `bound` either way."""
    worst = max(base.spread, ours.spread)
    if not (base.reliable and ours.reliable):
        return f"unreliable (timings spread {worst:.2g}x: a busy machine; re-run)"
    r = base.median / ours.median
    if r > bound or r < 1 / bound:
        return (f"not shown ({r:.3g}x is past {bound:.0f}x: one side's time is then dominated by something other "
                f"than the op, such as page faults on fresh memory or a busy CPU, not by its arithmetic)")
    return f"{r:.2f}x ({base.q1 / ours.q3:.2f}-{base.q3 / ours.q1:.2f})"


def fma_probe(seconds: float = 0.02) -> tuple[Callable[[], float] | None, float]:
    """The single-thread fp32 FMA loop in C with the widest vectors the CPU
    has (whatever ISA opforge runs), sized to about `seconds` a call, and the
    FLOPs of one call; (None, 0) where no ISA has a probe. Timed as one more
    variant of compare(), the peak is sampled in the same rounds as the ops it
    is a peak for: "% of peak" then compares a median to a median."""
    import ctypes

    from ._runtime import library

    probe = library.dll.opforge_probe_fma
    probe.restype, probe.argtypes = ctypes.c_double, [ctypes.c_int64]
    iters = 1 << 12
    while True:
        t0 = time.perf_counter()
        flops = probe(iters)
        dt = time.perf_counter() - t0
        if flops == 0:
            return None, 0.0
        if dt >= seconds / 2 or iters >= 1 << 40:
            break
        iters *= 2
    return (lambda: probe(iters)), flops


def page_faults(fn: Callable[[], object], reps: int = 3) -> int:
    """Median minor page faults of the process during one call of fn (getrusage; every thread's); -1
    where the OS does not count them. A tensor whose memory the C allocator has just taken from the
    kernel (glibc: any allocation above its mmap threshold, at most 32 MiB, and the top of a heap
    trimmed after a free) is paged in on first touch, a fault per page (4 KiB, or 2 MiB where
    transparent huge pages back it): time that is the allocator's, not the op's."""
    try:
        import resource
    except ImportError:
        return -1

    counts = []
    for _ in range(reps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = fn()
        del out
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return int(statistics.median(counts))


MALLOC_MODES = ("default", "keep")


def glibc() -> bool:
    """Whether this process's C library is glibc (whose mallopt set_malloc calls)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        return False


def set_malloc(mode: str) -> None:
    """"keep": glibc's malloc keeps freed memory for reuse (mallopt: no mmap for large blocks, no trimming
    of the heap's top), so that a tensor reallocated every step does not page in fresh memory; what a
    training process gets from jemalloc or tcmalloc, or from GLIBC_TUNABLES=glibc.malloc.mmap_max=0:
    glibc.malloc.trim_threshold=<large> set before it starts. Applies to every variant of a benchmark
    alike, for the rest of the process. "default": nothing changed. Raises where the C library is not
    glibc (with jemalloc or tcmalloc preloaded, glibc's mallopt succeeds and changes nothing: that
    allocator keeps memory its own way)."""
    if mode not in MALLOC_MODES:
        raise ValueError(f"malloc mode {mode!r}: expected one of {', '.join(MALLOC_MODES)}")
    if mode == "default":
        return
    import ctypes

    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    try:
        if not glibc():
            raise OSError("not glibc")
        mallopt = ctypes.CDLL("libc.so.6").mallopt
        done = [mallopt(M_MMAP_MAX, 0), mallopt(M_TRIM_THRESHOLD, 2**31 - 1)]
    except (OSError, AttributeError, TypeError) as e:
        raise RuntimeError(f"set_malloc('keep') needs glibc's mallopt ({e}); run the benchmark with jemalloc or "
                           "tcmalloc preloaded instead") from None
    if done != [1, 1]:
        raise RuntimeError(f"set_malloc('keep'): glibc's mallopt refused (M_MMAP_MAX, M_TRIM_THRESHOLD: {done})")


def malloc_suffix(mode: str) -> str:
    """What a benchmark run in set_malloc's `mode` adds to its results' file names."""
    return "_malloc_keep" if mode == "keep" else ""


def malloc_note(mode: str) -> str:
    """The results' header line saying how memory was allocated (set_malloc's `mode`)."""
    if mode == "keep":
        return ("malloc: keep (glibc keeps freed memory for reuse: no mmap of large blocks, no trimming; every "
                "variant alike)")
    return "malloc: glibc's default (large blocks mapped fresh on every allocation)"


def peak_memory(fn: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator held during one call of fn, above what it
    held before: the high-water mark of the allocator's running total, read
    from every allocation and free that torch's profiler records (the same
    for every variant; frees inside an op count when they happen)."""
    import json

    with _without_profiler_log(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = sorted((e for e in trace["traceEvents"] if e.get("name") == "[memory]" and e.get("args", {}).get(
        "Device Type", 0) == 0), key=lambda e: float(e["ts"]))
    if not events:
        return 0
    base = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return max(0, max(e["args"]["Total Allocated"] for e in events) - base)


def cuda_peak_memory(fn: Callable[[], object]) -> int:
    """Peak bytes torch's CUDA allocator held during one call of fn, above what it held before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return max(0, torch.cuda.max_memory_allocated() - base)


# Kineto logs every profiler start and stop ("USDT: ... profiler_start") to
# fd 2 from C++; its KINETO_LOG_LEVEL is read once, when torch loads, so only
# redirecting the descriptor silences it. Other lines are passed on.
_PROFILER_LOG = re.compile(r"^(USDT|STAGE):.*SyncActivityProfilerHandler")


@contextlib.contextmanager
def _without_profiler_log():
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            rest = [line for line in log if not _PROFILER_LOG.match(line)]
            if rest:
                sys.stderr.write("".join(rest))


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, label: str = ""):
        self.total, self.done, self.label = total, 0, label

    def step(self, what: str = "") -> None:
        self.done += 1
        filled = int(30 * self.done / max(self.total, 1))
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {what:<24}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def bench(
    op,
    reference: Callable,
    sizes: Sequence[int] = (1 << 12, 1 << 16, 1 << 20, 1 << 22),
    dtype: torch.dtype = torch.float32,
    make_inputs: Callable[[int, torch.dtype], tuple] | None = None,
    backward: bool = True,
    reps: int = 7,
    target_s: float = 0.05,
    atol: float | None = None,
    rtol: float | None = None,
    device: str | None = None,
) -> list[dict]:
    """Speed and peak memory of op against the eager reference and against
    torch.compile of it, per size: forward (and forward+backward) medians with
    the op's spread (q3/q1), ratios of medians (>1: op faster / leaner). Rounds are added until every
    variant's spread is within SPREAD_BOUND (measure()); a ratio from a variant still past it, or past
    MAX_RATIO, is NaN, with a warning on stderr saying why.
    make_inputs(n, dtype) builds the argument tuple; by default every Tensor
    argument is n positive values, floats 0.8. op must match the reference
    before it is timed, within opforge.testing.tolerance(dtype, atol, rtol).
    device "cuda": every variant runs on the GPU (inputs made as on the CPU, copied there with their
    layouts), each timed call followed by a synchronisation, peak memory from torch.cuda's counters."""
    from ._lib import op_function
    from .testing import _as_overload, _is_float_tensor, _to64, _tuple, assert_close, to_device

    on_gpu = device is not None and torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    memory = cuda_peak_memory if on_gpu else peak_memory

    op = _as_overload(op)
    make_inputs = make_inputs or (lambda n, dt: _default_inputs(op, n, dt))
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    compiled = torch.compile(reference, dynamic=False)
    # the op as opforge's Python functions call it (no autograd round trip without grad)
    call = op_function(op)(reference)
    variants = {"op": call, "eager": reference, "compile": compiled}
    rows, warnings = [], []
    progress = Progress(len(sizes), f"bench {op}")
    for n in sizes:
        cpu_args = make_inputs(n, dtype)
        args = tuple(to_device(a, device) for a in cpu_args)
        for o, w in zip(_tuple(op(*args)), _tuple(reference(*[_to64(a) for a in cpu_args]))):
            assert_close(o.cpu(), w, dtype, f"{op} n={n}", atol=atol, rtol=rtol)  # correct before timed
        timed = measure({k: (lambda f=f: (f(*args), sync())) for k, f in variants.items()}, reps=reps,
                        target_s=target_s)
        noisy = _noisy(timed, f"size {n} forward")
        mem = {k: memory(lambda f=f: f(*args)) for k, f in variants.items()}
        row = {"size": n, "dtype": str(dtype).split(".")[1], "op_fwd_us": timed["op"].median * 1e6,
               "op_fwd_spread": timed["op"].spread,
               "fwd_vs_eager": _ratio(timed["eager"], timed["op"]), "fwd_vs_compile": _ratio(timed["compile"], timed["op"]),
               "fwd_peak_mem_vs_eager": mem["eager"] / max(mem["op"], 1)}
        if backward:
            grad_args = [tuple(a.detach().requires_grad_() if _is_float_tensor(a) else a for a in args)]

            def step(f):
                outs = _tuple(f(*grad_args[0]))
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                return outs

            timed = measure({k: (lambda f=f: (step(f), sync())) for k, f in variants.items()}, reps=reps,
                            target_s=target_s)
            noisy += _noisy(timed, f"size {n} forward+backward")
            mem = {k: memory(lambda f=f: step(f)) for k, f in variants.items()}
            row.update({"op_fwdbwd_us": timed["op"].median * 1e6, "op_fwdbwd_spread": timed["op"].spread,
                        "fwdbwd_vs_eager": _ratio(timed["eager"], timed["op"]),
                        "fwdbwd_vs_compile": _ratio(timed["compile"], timed["op"]),
                        "peak_mem_vs_eager": mem["eager"] / max(mem["op"], 1),
                        "peak_mem_vs_compile": mem["compile"] / max(mem["op"], 1)})
        rows.append(row)
        progress.step(f"size {n}")
        warnings += noisy
    for line in warnings:  # after the progress bar's last line
        sys.stderr.write(f"warning: {op} {line}\n")
    return rows


def _ratio(base: Timing, ours: Timing) -> float:
    """base / ours, or NaN where ratio_text would not print it (a spread past SPREAD_BOUND, a ratio past
    MAX_RATIO): the table and the plot leave it out, and the warnings say why."""
    r = base.median / ours.median
    ok = base.reliable and ours.reliable and 1 / MAX_RATIO <= r <= MAX_RATIO
    return r if ok else math.nan


def _noisy(timed: dict[str, Timing], what: str) -> list[str]:
    out = [f"{what}: {name} timings spread {t.spread:.3g}x (quartiles {t.q1 * 1e6:.4g}-{t.q3 * 1e6:.4g} us over "
           f"{t.samples} samples) even after more rounds: its ratios are left out (nan); close other work and re-run"
           for name, t in timed.items() if not t.reliable]
    op = timed["op"]
    out += [f"{what}: {name} / op = {t.median / op.median:.3g}x is past {MAX_RATIO:.0f}x: left out (nan): one "
            "side's time is then not the op's work (page faults on fresh memory, a busy CPU)" for name, t in timed.items() if name != "op" and t.reliable and op.reliable
            and not 1 / MAX_RATIO <= t.median / op.median <= MAX_RATIO]
    return out


def _default_inputs(op, n: int, dtype: torch.dtype) -> tuple:
    from .testing import schema_args

    return schema_args(op, lambda i: (torch.rand(n, dtype=torch.float64) + 0.01).to(dtype))


def write_results(stem: str, rows: list[dict], notes: list[str] | None = None, out_dir: str = RESULTS,
                  timed: bool = True) -> str:
    """Writes <stem>.csv and <stem>.md; returns the markdown table. timed=False: a table read from
    plans, not timings (its header says nothing of medians)."""
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
    header = [f"# {stem}", "", environment(timed), ""] + [f"- {n}" for n in notes or []] + [""]
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write("\n".join(header) + table + "\n")
    return table


def environment(timed: bool = True) -> str:
    from . import __version__, _runtime, cpu_features, get_isa, get_pages

    feats = cpu_features()
    cpu = f"{feats['model'] or 'unknown CPU'} (family {feats['family']} model {feats['model_number']})"
    pages = ""
    if timed:  # how large fresh outputs are paged in changes page-fault-bound timings
        theirs = "on" if os.environ.get("THP_MEM_ALLOC_ENABLE", "0") not in ("", "0") else "off"
        pages = (f" Fresh outputs: opforge's paged in by '{get_pages()}' (OPFORGE_PAGES), torch's huge pages {theirs} "
                 f"(THP_MEM_ALLOC_ENABLE); THP {_runtime.thp_mode()}.")
    return (f"torch {torch.__version__}, opforge {__version__}, {cpu}, ISA {get_isa()}, "
            f"{torch.get_num_threads()} threads." + (" Ratios are medians of interleaved runs in one process."
                                                     if timed else "") + pages)


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
