"""{name} against its eager reference and torch.compile of it: speed and peak
memory ratios (>1: {name} is better). Writes results/bench_{name}.{csv,md,png}.
Run: python bench_{name}.py"""

import os

import torch

import opforge.benchmark as ob
from ops import {name}
from reference import {name} as reference

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

if __name__ == "__main__":
    rows = ob.bench({name}, reference, sizes=[1 << 12, 1 << 16, 1 << 20, 1 << 22], dtype=torch.float32)
    print(ob.write_results("bench_{name}", rows, out_dir=OUT))
    ob.plot("bench_{name}", [r["size"] for r in rows],
            {k: [r[k] for r in rows] for k in ("fwd_vs_eager", "fwd_vs_compile", "fwdbwd_vs_eager")},
            "elements", "speed-up (x)", out_dir=OUT)
