"""Per-call time of an opforge op inside an AOTInductor-compiled model:
through opforge's C shim (opforge.aoti_config()) against the same model
compiled without it (inductor's proxy executor, which calls the op through the
dispatcher and its Python autograd kernel), and the op called from Python
eagerly for reference.

The model chains CHAIN calls of rms_norm (x = rms_norm(x, w)); it is exported
once with a dynamic row count and compiled twice (one compile per variant,
about a minute each on a 2-core machine), so every row size runs the same two
packages. Per-call time = model time / CHAIN.

    python benchmarks/bench_aoti.py [--smoke] [--threads N] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

import opforge
from opforge.benchmark import RESULTS, compare, write_results

CHAIN = 8


class Chain(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.w = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden))

    def forward(self, x):
        for _ in range(CHAIN):
            x = opforge.rms_norm(x, self.w)
        return x


def compile_package(ep, directory: str, configs: dict) -> str:
    return torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(directory, "model.pt2"),
                                                    inductor_configs=configs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (on a loaded machine, 1 keeps the large rows out of thread stalls)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    hidden, rows_list = (64, [1, 8]) if a.smoke else (1024, [1, 16, 256, 4096])
    reps, target = (3, 0.01) if a.smoke else (9, 0.2)
    torch.manual_seed(0)
    model = Chain(hidden).eval()
    rows_dim = torch.export.Dim("rows", min=1, max=max(rows_list) * 2)
    with torch.no_grad():
        ep = torch.export.export(model, (torch.randn(2, hidden),), dynamic_shapes={"x": {0: rows_dim}})
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "shim"))
        os.makedirs(os.path.join(tmp, "proxy"))
        shim = torch._inductor.aoti_load_package(compile_package(ep, os.path.join(tmp, "shim"), opforge.aoti_config()))
        proxy = torch._inductor.aoti_load_package(compile_package(ep, os.path.join(tmp, "proxy"), {}))
        results = []
        for rows in rows_list:
            x = torch.randn(rows, hidden)
            with torch.no_grad():
                want = model(x)
                for name, runner in (("shim", shim), ("proxy", proxy)):
                    torch.testing.assert_close(runner(x), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
                t = compare({"shim": lambda: shim(x), "proxy": lambda: proxy(x), "eager": lambda: model(x)},
                            reps=reps, target_s=target)
            row = {"rows": rows, "hidden": hidden, "shim_us_per_call": 1e6 * t["shim"] / CHAIN,
                   "proxy_us_per_call": 1e6 * t["proxy"] / CHAIN, "eager_us_per_call": 1e6 * t["eager"] / CHAIN,
                   "proxy_over_shim": t["proxy"] / t["shim"], "eager_over_shim": t["eager"] / t["shim"]}
            results.append(row)
            print(f"rms_norm {rows}x{hidden}: {row['shim_us_per_call']:.1f} us per call through the C shim, "
                  f"{row['proxy_us_per_call']:.1f} us through the proxy executor ({row['proxy_over_shim']:.2f}x), "
                  f"{row['eager_us_per_call']:.1f} us eager from Python", flush=True)
    table = write_results("aoti", results, [
        f"ISA {opforge.get_isa()}, {torch.get_num_threads()} threads; float32; the model is {CHAIN} chained "
        "opforge.rms_norm calls, per-call times are model time / " + str(CHAIN),
        "shim: AOTInductor package compiled with opforge.aoti_config() (the generated C++ calls "
        "opforge_aoti_cpu_rms_norm); proxy: the same exported program compiled without it (inductor's proxy "
        "executor calls the op through the dispatcher); eager: the nn.Module called from Python",
        "medians over interleaved samples in one process; ratios >1: the shim is faster",
    ], a.out)
    print(table)


if __name__ == "__main__":
    main()
