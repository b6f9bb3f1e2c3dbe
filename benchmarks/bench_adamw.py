"""opforge.optim.AdamW against torch.optim.AdamW(fused=True) and (foreach=True): steps per second on
the parameters of opforge.models.GPT's default config (38 tensors, 2.9M elements) and on one large
tensor, float32 and bfloat16 parameters.

Each optimizer steps its own copy of the parameters and gradients, so that the variants, interleaved
round-robin, find their data out of cache as a training step leaves it (the forward and backward
between two steps evict it). Correctness first: one step of each against a float64 torch.optim.AdamW.
Bandwidth: the bytes a step must move (read parameter, gradient and both moments, write parameter
and moments) over its time; torch keeps a bfloat16 parameter's moments in bfloat16 (14 bytes an
element), opforge in float32 (22 bytes). Beside it, the machine's copy bandwidth, sampled in the same
rounds: `buf.copy_(x)` of 64 MB into a buffer written before (read 64 MB, write 64 MB).

    python benchmarks/bench_adamw.py [--smoke] [--large-elements N]
"""

from __future__ import annotations

import argparse

import torch

import opforge
from opforge.benchmark import RESULTS, measure, ratio_text, write_results
from opforge.models import GPT, GPTConfig

HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
VARIANTS = {
    "opforge": lambda ps: opforge.optim.AdamW(ps, **HP),
    "torch_fused": lambda ps: torch.optim.AdamW(ps, fused=True, **HP),
    "torch_foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **HP),
}


def gpt_shapes(smoke: bool) -> list[torch.Size]:
    cfg = GPTConfig(dim=64, n_layers=1, vocab_size=64) if smoke else GPTConfig()
    return [p.shape for p in GPT(cfg).parameters()]


def make(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(dtype)
    return ps


def check(shapes, dtype):
    """One step of each variant against torch's AdamW in float64 on the same values."""
    ref = [p.detach().double().requires_grad_() for p in make(shapes, dtype, 0)]
    for p, q in zip(ref, make(shapes, dtype, 0)):
        p.grad = q.grad.double()
    torch.optim.AdamW(ref, foreach=False, **HP).step()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for name, new in VARIANTS.items():
        ps = make(shapes, dtype, 0)
        new(ps).step()
        err = max(((p.detach().double() - r.detach()).abs().max().item() for p, r in zip(ps, ref)), default=0.0)
        assert err <= tol, f"{name} {dtype}: max error {err:.3g} against float64 AdamW (tolerance {tol})"


def bench_case(label, shapes, dtype, reps, target_s, copy_elements):
    check(shapes, dtype)
    numel = sum(s.numel() for s in shapes)
    steps = {}
    for i, (name, new) in enumerate(VARIANTS.items()):
        ps = make(shapes, dtype, i + 1)
        steps[name] = new(ps).step
    src, buf = torch.randn(copy_elements), torch.zeros(copy_elements)
    t = measure({**steps, "copy_": lambda: buf.copy_(src)}, reps=reps, target_s=target_s)
    copy_gbps = 2 * 4 * copy_elements / t["copy_"].median / 1e9
    es = torch.finfo(dtype).bits // 8
    moved = {name: numel * (3 * es + (16 if name == "opforge" or dtype == torch.float32 else 4 * es))
             for name in VARIANTS}
    row = {
        "params": label,
        "tensors": len(shapes),
        "elements": numel,
        "dtype": str(dtype).split(".")[1],
        "opforge_ms": t["opforge"].median * 1e3,
        "fused_ms": t["torch_fused"].median * 1e3,
        "foreach_ms": t["torch_foreach"].median * 1e3,
        "vs_fused": t["torch_fused"].median / t["opforge"].median,
        "vs_foreach": t["torch_foreach"].median / t["opforge"].median,
        "opforge_GBps": moved["opforge"] / t["opforge"].median / 1e9,
        "fused_GBps": moved["torch_fused"] / t["torch_fused"].median / 1e9,
        "copy_GBps": copy_gbps,
    }
    print(f"{label:>10} {row['dtype']:>8}: opforge {row['opforge_ms']:.3f} ms, vs fused "
          f"{ratio_text(t['torch_fused'], t['opforge'])}, vs foreach {ratio_text(t['torch_foreach'], t['opforge'])}; "
          f"{row['opforge_GBps']:.1f} GB/s (fused {row['fused_GBps']:.1f}, copy {copy_gbps:.1f})", flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, few repeats (CI)")
    p.add_argument("--large-elements", type=int, default=1 << 24, help="the single tensor's elements (default 16M)")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    reps, target = (3, 0.005) if a.smoke else (11, 0.05)
    large = 1 << 14 if a.smoke else a.large_elements
    copy_elements = 1 << 14 if a.smoke else 1 << 24
    cases = [("gpt", gpt_shapes(a.smoke)), ("large", [torch.Size([large])])]
    rows = [bench_case(label, shapes, dtype, reps, target, copy_elements)
            for dtype in (torch.float32, torch.bfloat16) for label, shapes in cases]
    notes = [
        "a step = optimizer.step() on gradients already in place; each variant its own parameters, interleaved",
        "gpt: the parameters of opforge.models.GPT(GPTConfig()); large: one tensor",
        "vs_fused / vs_foreach: torch.optim.AdamW(fused=True / foreach=True) time over opforge's (>1: opforge faster)",
        "GBps: bytes a step moves over its time; bfloat16: opforge's moments are float32 (22 bytes an element), "
        "torch's bfloat16 (14); copy_GBps: buf.copy_(x) of 64 MB (read + write) in the same rounds",
    ]
    print("\n" + write_results("adamw", rows, notes, a.out))


if __name__ == "__main__":
    main()
