"""{name} against its eager reference and torch.compile of it: speed and peak
memory ratios (>1: {name} is better), float32. Writes results/bench_{name}.{csv,md,png}.
Run: python bench_{name}.py   (--smoke: one small size, a few short samples)"""

import argparse
import os

import torch

import opforge.benchmark as ob
from ops import {name}
from reference import {name} as reference

HERE = os.path.dirname(os.path.abspath(__file__))
INPUTS = {INPUTS}
SCALARS = {SCALARS}
REDUCE = {REDUCE}  # the last dim is reduced: inputs are (n / COLS, COLS)
COLS = 512


def make_inputs(n, dtype):
    shape = (max(n // COLS, 1), COLS) if REDUCE else (n,)
    tensors = [torch.randn(shape, generator=torch.Generator().manual_seed(k), dtype=torch.float64).to(dtype)
               for k in range(len(INPUTS))]
    return (*tensors, *SCALARS.values())


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--smoke", action="store_true", help="one small size, a few short samples: checks the script runs")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: the op's CUDA kernel (opforge new --cuda) against eager and compile on the GPU")
    a = p.parse_args()
    sizes, timing = ([1 << 12], dict(reps=2, target_s=0.002)) if a.smoke else ([1 << 12, 1 << 16, 1 << 20, 1 << 22], {})
    # a float32 sum rounds differently from the float64 reference it is checked against
    tol = dict(atol=1e-4, rtol=1e-5) if REDUCE else {}
    rows = ob.bench({name}, reference, sizes=sizes, dtype=torch.float32, make_inputs=make_inputs,
                    device=None if a.device == "cpu" else a.device, **tol, **timing)
    print(ob.write_results("bench_{name}" + ("_cuda" if a.device == "cuda" else ""), rows, out_dir=a.out))
    ob.plot("bench_{name}", [r["size"] for r in rows],
            {k: [r[k] for r in rows] for k in ("fwd_vs_eager", "fwd_vs_compile", "fwdbwd_vs_eager")},
            "elements", "speed-up (x)", out_dir=a.out)
