"""opforge's CUDA kernels against torch on the same GPU: the issue's targets, one table.

    python benchmarks/bench_cuda.py [--out DIR] [--quick]

Each row times an op (forward, or forward + backward) with CUDA events around the call alone, after
warm-up, as the median of --reps runs, with the L2 cache flushed before each run (a write of 512 MiB:
no run finds its inputs in the cache the previous one left). Baselines run interleaved with opforge's
call in the same process: torch's eager code, its fused kernel where it has one, and torch.compile of
the eager code where the target names it. Memory-bound rows give the bandwidth reached (bytes the op
must move / time) and its share of a clone's bandwidth measured the same way. Peak memory is measured
alike for both sides (torch.cuda.max_memory_allocated above the inputs). Results: a markdown table on
stdout, and cuda.csv / cuda.md under --out (default benchmarks/results/ named after the GPU).
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import opforge  # noqa: E402
import opforge.benchmark as ob  # noqa: E402

_flush = None
DEVICE = "cuda"


def flush_l2():
    global _flush
    if DEVICE != "cuda":
        return
    if _flush is None:
        _flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    _flush.zero_()


def gpu_ms(fn, reps: int) -> float:
    """Median milliseconds of fn() between CUDA events, the L2 flushed before each run."""
    for _ in range(3):
        fn()
    return statistics.median(_one(fn) for _ in range(reps))


def interleaved(fns: dict, reps: int) -> dict:
    """Median ms of each fn, sampled round-robin (drift in clocks hits every side alike)."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    samples = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            samples[k].append(_one(fn))
    return {k: statistics.median(v) for k, v in samples.items()}


def _one(fn) -> float:
    flush_l2()
    if DEVICE != "cuda":  # the script's own smoke test on a CPU (--device cpu): wall time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def peak_mib(fn) -> float:
    """Memory fn allocates above what is allocated before it (MiB)."""
    if DEVICE != "cuda":
        fn()
        return float("nan")
    return ob.cuda_peak_memory(fn) / 2**20


def fwd_bwd(f, *inputs):
    """A callable running f forward and backward: every output that requires grad gets a gradient of ones
    (made alike for both sides of a comparison)."""

    def run():
        outs = f(*inputs)
        outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,)) if o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        for t in inputs:
            if isinstance(t, torch.Tensor):
                t.grad = None

    return run


class Table:
    def __init__(self, clone_gbs: float):
        self.rows = []
        self.clone_gbs = clone_gbs

    def add(self, case: str, shape: str, dtype, times: dict, ours: str = "opforge", bytes_moved: float | None = None,
            mem: dict | None = None, target: str = ""):
        t = times[ours]
        for name, ms in times.items():
            if name == ours:
                continue
            row = {"case": case, "shape": shape, "dtype": str(dtype).replace("torch.", ""),
                   "opforge_ms": round(t, 4), "baseline": name, "baseline_ms": round(ms, 4),
                   "speedup": round(ms / t, 3) if t > 0 else float("nan"), "target": target}
            if bytes_moved:
                gbs = bytes_moved / (t * 1e-3) / 1e9
                row["opforge_GB/s"] = round(gbs, 1)
                row["of_clone"] = round(gbs / self.clone_gbs, 3)
            if mem:
                row["opforge_peak_MiB"] = round(mem[ours], 1)
                row["baseline_peak_MiB"] = round(mem.get(name, float("nan")), 1)
            self.rows.append(row)
            print(f"{case:28s} {shape:22s} {row['dtype']:9s} opforge {t:8.4f} ms  {name:28s} {ms:8.4f} ms  "
                  f"{row['speedup']:6.2f}x" + (f"  {row['opforge_GB/s']:7.1f} GB/s ({row['of_clone']:.0%} of clone)"
                                                if bytes_moved else "")
                  + (f"  peak {row['opforge_peak_MiB']:.0f} vs {row['baseline_peak_MiB']:.0f} MiB" if mem else ""),
                  flush=True)

    def write(self, out_dir: str, gpu: str):
        os.makedirs(out_dir, exist_ok=True)
        keys = []
        for r in self.rows:
            keys += [k for k in r if k not in keys]
        with open(os.path.join(out_dir, "cuda.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)
        with open(os.path.join(out_dir, "cuda.md"), "w") as f:
            f.write(f"# opforge CUDA kernels vs torch {torch.__version__} on {gpu}\n\n")
            f.write(f"Clone bandwidth (the memory-bound ceiling used below): {self.clone_gbs:.0f} GB/s.\n\n")
            f.write("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n")
            for r in self.rows:
                f.write("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |\n")


def hf_rms_norm(x, w, eps=1e-6):
    """Hugging Face's LlamaRMSNorm.forward."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def eager_rope(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="where cuda.csv and cuda.md go (default benchmarks/results/<gpu>/)")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--quick", action="store_true", help="smaller shapes, fewer runs, no torch.compile")
    p.add_argument("--device", default="cuda", help="cpu: the script's own smoke test (tiny shapes, wall time)")
    p.add_argument("--smoke", action="store_true",
                   help="a quick run: --quick on a GPU; without one, the CPU smoke test of the script itself")
    a = p.parse_args(argv)
    global DEVICE
    if a.smoke:
        a.quick = True
        if not opforge.cuda_status()["loaded"]:
            a.device = "cpu"
    DEVICE = dev = a.device
    if dev == "cuda" and not opforge.cuda_status()["loaded"]:  # make bench on a machine without a GPU
        print(f"bench_cuda: skipped: no CUDA kernels in this process ({opforge.cuda_status()['reason']})")
        return
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke test)"
    tiny = dev != "cuda"
    reps = 2 if tiny else 5 if a.quick else a.reps
    compile_ = (lambda f: f) if a.quick or tiny else (lambda f: torch.compile(f))
    bf16 = torch.bfloat16
    print(f"bench_cuda: {gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"opforge CUDA runtime {opforge.cuda_status()['runtime']}")

    # the ceiling: a clone's bandwidth (read + write) at 1 GiB
    n = (1 << 16) if tiny else (1 << 26) if a.quick else (1 << 28)
    big = torch.rand(n, device=dev)
    clone_ms = gpu_ms(lambda: big.clone(), reps)
    clone_gbs = 2 * big.numel() * 4 / (clone_ms * 1e-3) / 1e9
    print(f"clone of {big.numel() * 4 >> 20} MiB: {clone_ms:.3f} ms, {clone_gbs:.0f} GB/s")
    table = Table(clone_gbs)

    # dispersion_correction: >= 90% of clone at >= 16M, >= 3x eager, >= 1.0x compile
    mid = (1 << 14) if tiny else (1 << 24)
    for numel, dtype in ((mid, torch.float32), (mid, bf16), (n, torch.float32)):
        x = torch.rand(numel, device=dev, dtype=dtype) + 0.01
        eager = lambda x=x: x * 0.8 + torch.sqrt(x)  # noqa: E731
        fns = {"opforge": lambda x=x: opforge.dispersion_correction(x, 0.8), "eager x*a+sqrt(x)": eager}
        if numel <= mid:
            compiled = compile_(lambda x: x * 0.8 + torch.sqrt(x))
            fns["compile(eager)"] = lambda f=compiled, x=x: f(x)
        fns["clone"] = lambda x=x: x.clone()
        times = interleaved(fns, reps)
        table.add("dispersion_correction fwd", f"{numel}", dtype, times, bytes_moved=2 * x.numel() * x.element_size(),
                  target=">=0.9 of clone, >=3x eager, >=1x compile")

    rows, hidden = (16, 256) if tiny else (2048, 4096) if a.quick else (8192, 4096)
    # rms_norm: fwd+bwd >= 1.0x F.rms_norm; HF composite eager and compiled for reference
    x = torch.randn(rows, hidden, device=dev, dtype=bf16, requires_grad=True)
    w = (1 + 0.1 * torch.randn(hidden, device=dev, dtype=bf16)).requires_grad_()
    times = interleaved({"opforge": lambda: opforge.rms_norm(x.detach(), w.detach()),
                         "F.rms_norm": lambda: F.rms_norm(x.detach(), (hidden,), w.detach(), 1e-6)}, reps)
    table.add("rms_norm fwd", f"{rows}x{hidden}", bf16, times, bytes_moved=2 * x.numel() * 2, target=">=1x F.rms_norm")
    hf_c = compile_(hf_rms_norm)
    times = interleaved({"opforge": fwd_bwd(lambda x, w: opforge.rms_norm(x, w), x, w),
                         "F.rms_norm": fwd_bwd(lambda x, w: F.rms_norm(x, (hidden,), w, 1e-6), x, w),
                         "HF LlamaRMSNorm eager": fwd_bwd(hf_rms_norm, x, w),
                         "compile(HF LlamaRMSNorm)": fwd_bwd(hf_c, x, w)}, reps)
    table.add("rms_norm fwd+bwd", f"{rows}x{hidden}", bf16, times, bytes_moved=5 * x.numel() * 2,
              target=">=1x F.rms_norm")

    # add_rms_norm: >= 1.2x compile
    r = torch.randn(rows, hidden, device=dev, dtype=bf16, requires_grad=True)

    def eager_add(x, r, w):
        s = x + r
        return hf_rms_norm(s, w), s

    add_c = compile_(eager_add)
    times = interleaved({"opforge": fwd_bwd(lambda x, r, w: opforge.add_rms_norm(x, r, w), x, r, w),
                         "eager (x+r, HF norm)": fwd_bwd(eager_add, x, r, w),
                         "compile(eager)": fwd_bwd(add_c, x, r, w)}, reps)
    table.add("add_rms_norm fwd+bwd", f"{rows}x{hidden}", bf16, times, target=">=1.2x compile")

    # layer_norm: >= 1.0x F.layer_norm
    b = torch.zeros(hidden, device=dev, dtype=bf16, requires_grad=True)
    times = interleaved({"opforge": fwd_bwd(lambda x, w, b: opforge.layer_norm(x, w, b), x, w, b),
                         "F.layer_norm": fwd_bwd(lambda x, w, b: F.layer_norm(x, (hidden,), w, b), x, w, b)}, reps)
    table.add("layer_norm fwd+bwd", f"{rows}x{hidden}", bf16, times, target=">=1x F.layer_norm")

    # swiglu: fwd+bwd >= 1.4x eager
    inter = 512 if tiny else 11008
    g = torch.randn(rows, inter, device=dev, dtype=bf16, requires_grad=True)
    u = torch.randn(rows, inter, device=dev, dtype=bf16, requires_grad=True)
    times = interleaved({"opforge": fwd_bwd(opforge.swiglu, g, u),
                         "eager silu(g)*u": fwd_bwd(lambda g, u: F.silu(g) * u, g, u)}, reps)
    table.add("swiglu fwd+bwd", f"{rows}x{inter}", bf16, times, bytes_moved=7 * g.numel() * 2, target=">=1.4x eager")

    # rope: fwd+bwd >= 2x eager (Llama layout: (B, N, H, D) viewed as (B, H, N, D))
    B, N, H, D = (1, 16, 4, 32) if tiny else (2, 1024, 32, 128) if a.quick else (8, 2048, 32, 128)
    q = torch.randn(B, N, H, D, device=dev, dtype=bf16).transpose(1, 2).requires_grad_()
    k = torch.randn(B, N, max(H // 4, 1), D, device=dev, dtype=bf16).transpose(1, 2).requires_grad_()
    pos = torch.arange(N, device=dev, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
    emb = torch.cat([torch.outer(pos, inv)] * 2, dim=-1)
    cos, sin = emb.cos().to(bf16)[None, None], emb.sin().to(bf16)[None, None]
    times = interleaved({"opforge": fwd_bwd(lambda q, k: opforge.rope(q, k, cos, sin), q, k),
                         "eager rotate_half": fwd_bwd(lambda q, k: eager_rope(q, k, cos, sin), q, k)}, reps)
    table.add("rope fwd+bwd", f"B{B} N{N} H{H}/{k.shape[1]} D{D}", bf16, times, target=">=2x eager")

    # softmax: fwd+bwd against torch.softmax
    classes = 1000 if tiny else 32000
    xs = torch.randn(rows, classes, device=dev, dtype=bf16, requires_grad=True)
    times = interleaved({"opforge": fwd_bwd(lambda x: opforge.softmax(x, -1), xs),
                         "torch.softmax": fwd_bwd(lambda x: torch.softmax(x, -1), xs)}, reps)
    table.add("softmax fwd+bwd", f"{rows}x{classes}", bf16, times, bytes_moved=5 * xs.numel() * 2)
    del xs

    # cross_entropy at vocab 128256: >= 2x F.cross_entropy fwd+bwd, >= 3x less peak memory
    tokens, vocab = (16, 1000) if tiny else (2048, 128256) if a.quick else (8192, 128256)
    logits = torch.randn(tokens, vocab, device=dev, dtype=bf16, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,), device=dev)
    ours = fwd_bwd(lambda lg: opforge.cross_entropy(lg, target), logits)
    theirs = fwd_bwd(lambda lg: F.cross_entropy(lg, target), logits)
    hf = fwd_bwd(lambda lg: F.cross_entropy(lg.float(), target), logits)
    times = interleaved({"opforge": ours, "F.cross_entropy": theirs, "HF upcast float32": hf}, reps)
    mem = {"opforge": peak_mib(ours), "F.cross_entropy": peak_mib(theirs), "HF upcast float32": peak_mib(hf)}
    table.add("cross_entropy fwd+bwd", f"{tokens}x{vocab}", bf16, times, bytes_moved=2 * logits.numel() * 2, mem=mem,
              target=">=2x F.cross_entropy, >=3x less peak")

    safe = re.sub(r"[^A-Za-z0-9]+", "_", gpu).strip("_").lower()
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"cuda_{safe}")
    table.write(out, gpu)
    print(f"bench_cuda: wrote {out}/cuda.csv and cuda.md")


if __name__ == "__main__":
    main()
