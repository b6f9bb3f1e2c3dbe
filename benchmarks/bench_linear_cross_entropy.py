"""Fused LM head + cross-entropy (opforge.functional.linear_cross_entropy) against eager
F.cross_entropy(F.linear(h, w), y) and torch.compile of it: forward+backward time ratios and the
peak memory of one forward+backward, float32 and bfloat16, hidden 2048, vocab 32000 and 128256; and
forward+backward under torch.autocast (bfloat16) on float32 operands, 2048 tokens x 512 -> vocab 8192
(<stem>_autocast.*).

    python benchmarks/bench_linear_cross_entropy.py [--smoke] [--out DIR] [--time-tokens N] [--mem-tokens N]
    python benchmarks/bench_linear_cross_entropy.py --dtypes '' --autocast-shape 2048,512,8192  # autocast only

Peak memory is measured at the full size (4096 tokens) in a fresh subprocess per variant, the same way
for each: the torch allocator's high-water mark during one forward+backward above what it held before
(torch's profiler memory events), and the process's resident-set high-water mark above its resident set
before the call (/proc/self/clear_refs, VmHWM). The inputs (hidden, weight, target) exist before and are
excluded; the gradients the call makes (hidden.grad, weight.grad) are included, and reported apart.
Timing runs at fewer tokens on a small machine (--time-tokens), all variants interleaved in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import opforge
from opforge.benchmark import RESULTS, compare, measure, peak_memory, plot, ratio_text, write_results

HERE = os.path.dirname(os.path.abspath(__file__))


def eager(h, w, y):
    return F.cross_entropy(F.linear(h, w), y)


def fused(h, w, y):
    return opforge.functional.linear_cross_entropy(h, w, y)


def fused_fwd_grads(h, w, y):
    """The raw op with compute_grad=True at any size: the gradients made in the forward, held until the
    backward, which scales them into new tensors."""
    return torch.ops.opforge.linear_cross_entropy(h, w, y, None, -100, 0.0, 1, None, True)[0]


def inputs(tokens, hidden, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5 * 2).to(dtype)
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[::50] = -100
    return h, w, y


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child(variant, dtype, tokens, hidden, vocab):
    """One variant's forward+backward at full size in this fresh process: its peak memory as JSON."""
    dtype = getattr(torch, dtype)
    h, w, y = inputs(tokens, hidden, vocab, dtype)
    h.requires_grad_(), w.requires_grad_()
    fn = {"opforge": fused, "opforge_fwd_grads": fused_fwd_grads, "eager": eager}.get(variant)
    if variant == "compile":
        fn = torch.compile(eager, dynamic=True)  # compiled and warmed on a few tokens, not at full cost
        hs, ws, ys = h.detach()[:64].clone(), w.detach()[:64].clone(), y[:64].clamp(min=0) % min(64, vocab)
        fn(hs.requires_grad_(), ws.requires_grad_(), ys).backward()

    def step():
        fn(h, w, y).backward()

    # a first call on a few tokens, under the profiler: what the first call of a process loads (libraries,
    # the profiler's own state, thread pools) is not the variant's memory
    hs, ys = h.detach()[:8].clone().requires_grad_(), y[:8]
    peak_memory(lambda: fn(hs, w, ys).backward())
    w.grad = None
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident set
        f.write("5")
    rss0 = _vm("VmRSS")
    peak = peak_memory(step)
    rss_peak = _vm("VmHWM") - rss0
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (h, w))
    print(json.dumps({"alloc_peak": peak, "rss_peak": rss_peak, "grads": grads}), flush=True)


def measure_memory(variant, dtype, tokens, hidden, vocab):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, str(dtype).split(".")[1], str(tokens),
           str(hidden), str(vocab)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if out.returncode != 0:
        raise RuntimeError(f"memory child {variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check(dtype, hidden, vocab):
    """Loss and gradients against float64 on a few tokens, before anything is timed."""
    h, w, y = inputs(24, hidden, vocab, dtype, seed=1)
    leaves = [t.clone().requires_grad_() for t in (h, w)]
    refs = [t.double().requires_grad_() for t in (h, w)]
    got, want = fused(*leaves, y), eager(*refs, y)
    got.backward(), want.backward()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want.detach(), rtol=tol, atol=tol)
    for a, r in zip(leaves, refs):
        torch.testing.assert_close(a.grad.double(), r.grad, rtol=tol, atol=tol * float(r.grad.abs().max()))


def time_step(variants, tokens, hidden, vocab, dtype, reps):
    """Median seconds of one forward+backward of each variant, interleaved."""
    h, w, y = inputs(tokens, hidden, vocab, dtype)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()

    def step(f):
        f(hg, wg, y).backward()
        hg.grad = wg.grad = None

    return compare({k: (lambda f=f: step(f)) for k, f in variants.items()}, reps=reps, target_s=0.01)


def under_autocast(f, amp=torch.bfloat16):
    """f under torch.autocast("cpu", amp): what a mixed-precision training step runs on float32 parameters."""

    def run(h, w, y):
        with torch.autocast("cpu", dtype=amp):
            return f(h, w, y)

    return run


def fused_fp32(h, w, y):
    """The op on float32 operands with autocast off: what the op ran under autocast while its policy was
    float32 (before its GEMMs followed the autocast dtype as eager's F.linear does)."""
    with torch.autocast("cpu", enabled=False):
        return fused(h.float(), w.float(), y)


def time_autocast(shape, reps, out, stem):
    """forward+backward under bfloat16 autocast on float32 hidden and weight, interleaved; loss and gradients
    checked against eager's under the same autocast first."""
    tokens, hidden, vocab = shape
    variants = {"opforge": under_autocast(fused), "eager": under_autocast(eager),
                "compile": torch.compile(under_autocast(eager), dynamic=False), "opforge_fp32": fused_fp32}
    h, w, y = inputs(min(tokens, 64), hidden, vocab, torch.float32, seed=1)
    results = {}
    for name in ("opforge", "eager"):
        leaves = [t.clone().requires_grad_() for t in (h, w)]
        loss = variants[name](*leaves, y)
        loss.backward()
        results[name] = [loss.detach()] + [t.grad for t in leaves]
    assert results["opforge"][0].dtype == torch.float32 and results["opforge"][2].dtype == torch.float32
    for got, want in zip(results["opforge"], results["eager"]):
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))
    h, w, y = inputs(tokens, hidden, vocab, torch.float32)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()

    def step(f):
        f(hg, wg, y).backward()
        hg.grad = wg.grad = None

    t = measure({k: (lambda f=f: step(f)) for k, f in variants.items()}, reps=reps, target_s=0.01)
    row = {"tokens": tokens, "hidden": hidden, "vocab": vocab, **{f"fwdbwd_s_{k}": v.median for k, v in t.items()},
           "fwdbwd_vs_eager": t["eager"].median / t["opforge"].median,
           "fwdbwd_vs_compile": t["compile"].median / t["opforge"].median,
           "fp32_policy_vs_eager": t["eager"].median / t["opforge_fp32"].median}
    notes = [f"ISA {opforge.get_isa()}; forward+backward under torch.autocast('cpu', bfloat16) on float32 hidden and "
             "weight (leaves), medians of interleaved samples; fwdbwd_vs_*: baseline time / opforge time (>1: "
             "opforge faster)",
             "eager: F.cross_entropy(F.linear(h, w), y) (its logits bfloat16, the loss float32); compile: "
             "torch.compile of it; opforge_fp32 (fp32_policy_vs_eager): the op on float32 operands, what the op ran "
             "under autocast with its former float32 policy"]
    write_results(stem, [row], notes, out)
    print(f"autocast bf16 {tokens} x {hidden} -> {vocab}: fwd+bwd {ratio_text(t['eager'], t['opforge'])} eager, "
          f"{ratio_text(t['compile'], t['opforge'])} compile; the float32 policy ran at "
          f"{ratio_text(t['eager'], t['opforge_fp32'])} eager", flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--time-tokens", type=int, default=256, help="tokens of the float32 timing (bfloat16: a quarter)")
    p.add_argument("--mem-tokens", type=int, default=4096, help="tokens of the float32 memory runs")
    p.add_argument("--bf16-mem-tokens", type=int, default=256,
                   help="tokens of the bfloat16 memory runs (eager bfloat16 GEMMs are slow without AVX512-BF16)")
    p.add_argument("--vocabs", default="32000,128256")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--autocast-shape", default="2048,512,8192",
                   help="tokens,hidden,vocab of the bfloat16 autocast timing ('': none)")
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--stem", default="linear_cross_entropy", help="results file names")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        variant, dtype, tokens, hidden, vocab = a.child
        child(variant, dtype, int(tokens), int(hidden), int(vocab))
        return
    hidden = 2048
    vocabs = [int(v) for v in a.vocabs.split(",")]
    if a.smoke:
        hidden, vocabs, a.time_tokens, a.mem_tokens, a.bf16_mem_tokens = 64, [500], 32, 64, 32
        a.autocast_shape = "32,64,500" if a.autocast_shape else ""
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    compiled = torch.compile(eager, dynamic=False)
    variants = {"opforge": fused, "eager": eager, "compile": compiled}
    rows = []
    notes = [
        f"ISA {opforge.get_isa()}; hidden {hidden}; fwdbwd_vs_*: baseline time / opforge time of one "
        "forward+backward (>1: opforge faster), medians of interleaved samples at time_tokens tokens",
        "peak_MiB_*: torch allocator high-water mark during one forward+backward above what it held before, "
        "in a fresh process per variant, at mem_tokens tokens; inputs and parameters excluded, the gradients "
        "made (hidden.grad + weight.grad = grads_MiB) included; *_no_grads: the same less the gradients (the "
        "temporaries alone); rss_MiB_*: the resident-set high-water mark above the resident set before the call",
        "opforge: opforge.functional.linear_cross_entropy (tokens <= hidden: the logits' gradient kept for the "
        "backward's two GEMMs; else float32 makes the gradients in the forward in chunks up to the weight's size, "
        "and bfloat16 keeps lse and recomputes the blocks in the backward); opforge_fwd_grads: the raw op with "
        "compute_grad=True (gradients made in the forward, held, and scaled into new tensors by the backward)",
        "compile: torch.compile of the eager code (the memory child compiles with dynamic=True, warmed on 64 "
        "tokens)",
    ]
    if a.autocast_shape and not a.skip_time:
        time_autocast([int(n) for n in a.autocast_shape.split(",")], 2 if a.smoke else 7, a.out,
                      f"{a.stem}_autocast")
    for dname in filter(None, a.dtypes.split(",")):
        dtype = getattr(torch, dname)
        for vocab in vocabs:
            check(dtype, hidden, vocab)
            tokens = a.time_tokens if dtype == torch.float32 else max(a.time_tokens // 4, 8)
            both = dict.fromkeys(variants, float("nan"))
            if not a.skip_time:
                both = time_step(variants, tokens, hidden, vocab, dtype, 2 if a.smoke else 3)
            mem_tokens = a.mem_tokens if dtype == torch.float32 else a.bf16_mem_tokens
            print(f"{dname} vocab {vocab}: timed; peak memory at {mem_tokens} tokens ...", flush=True)
            nan = float("nan")
            none = {"alloc_peak": nan, "rss_peak": nan, "grads": nan}
            mem = {k: none if a.skip_memory else measure_memory(k, dtype, mem_tokens, hidden, vocab)
                   for k in ("opforge", "opforge_fwd_grads", "eager", "compile")}
            mib = 2.0**20
            row = {"dtype": dname, "hidden": hidden, "vocab": vocab, "time_tokens": tokens,
                   "fwdbwd_s_opforge": both["opforge"], "fwdbwd_s_eager": both["eager"],
                   "fwdbwd_s_compile": both["compile"],
                   "fwdbwd_vs_eager": both["eager"] / both["opforge"],
                   "fwdbwd_vs_compile": both["compile"] / both["opforge"], "mem_tokens": mem_tokens,
                   "grads_MiB": mem["opforge"]["grads"] / mib}
            for k, m in mem.items():
                row[f"peak_MiB_{k}"] = m["alloc_peak"] / mib
                row[f"rss_MiB_{k}"] = m["rss_peak"] / mib
            for base in ("eager", "compile"):
                row[f"mem_x_less_vs_{base}"] = mem[base]["alloc_peak"] / mem["opforge"]["alloc_peak"]
                row[f"mem_x_less_vs_{base}_no_grads"] = ((mem[base]["alloc_peak"] - mem[base]["grads"])
                                                         / (mem["opforge"]["alloc_peak"] - mem["opforge"]["grads"]))
                row[f"rss_x_less_vs_{base}"] = mem[base]["rss_peak"] / mem["opforge"]["rss_peak"]
            rows.append(row)
            print(f"{dname} vocab {vocab}: fwd+bwd ({tokens} tokens) {row['fwdbwd_vs_eager']:.2f}x eager, "
                  f"{row['fwdbwd_vs_compile']:.2f}x compile; peak memory ({mem_tokens} tokens) "
                  f"{row['peak_MiB_opforge']:.0f} MiB vs eager {row['peak_MiB_eager']:.0f} "
                  f"({row['mem_x_less_vs_eager']:.1f}x less), compile {row['peak_MiB_compile']:.0f} "
                  f"({row['mem_x_less_vs_compile']:.1f}x less); gradients in the forward: "
                  f"{row['peak_MiB_opforge_fwd_grads']:.0f} MiB", flush=True)
            write_results(a.stem, rows, notes, a.out)  # what is measured so far
    if not rows:
        return
    table = write_results(a.stem, rows, notes, a.out)
    fp32 = [r for r in rows if r["dtype"] == "float32"] or rows
    plot(a.stem, [r["vocab"] for r in fp32],
         {k: [r[k] for r in fp32] for k in ("mem_x_less_vs_eager", "mem_x_less_vs_compile", "fwdbwd_vs_eager")},
         "vocab (float32)", "x (memory less / speed-up)", a.out)
    print(table)


if __name__ == "__main__":
    main()
