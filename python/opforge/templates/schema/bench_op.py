"""{name} against its eager reference and torch.compile of it: speed and peak memory ratios
(>1: {name} is better), float32 and bfloat16. Writes results/bench_{name}.{csv,md}.
Run: python bench_{name}.py   (--smoke: one small size, a few short samples)"""

import argparse
import os

import torch

import opforge.benchmark as ob
import test_{name} as spec
from ops import {name}
from reference import {name} as reference

HERE = os.path.dirname(os.path.abspath(__file__))
ROW = 1024  # the main input's row (its last dim)


def make_inputs(n, dtype):
    """About n elements of the main input, rows of ROW; the other sizes as the tests' first case."""
    shape = list(spec.CASES[0][spec.MAIN])
    lead = max(n // ROW, 1)
    if len(shape) == 1:
        shape = [ROW]
    else:
        inner = 1
        for s in shape[1:-1]:
            inner *= max(s, 1)
        shape = [max(lead // inner, 1), *shape[1:-1], ROW]
    case = dict(spec.CASES[0], **{spec.MAIN: tuple(shape)})
    return spec.call_args(spec.make(case, dtype))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--smoke", action="store_true", help="one small size, a few short samples: checks the script runs")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    a = p.parse_args()
    sizes, timing = ([1 << 14], dict(reps=2, target_s=0.002)) if a.smoke else ([1 << 16, 1 << 20, 1 << 22], {})
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else {}
        for r in ob.bench({name}, reference, sizes=sizes, dtype=dtype, make_inputs=make_inputs, **tol, **timing):
            rows.append(dict(r, dtype=str(dtype).replace("torch.", "")))
    print(ob.write_results("bench_{name}", rows, out_dir=a.out))
