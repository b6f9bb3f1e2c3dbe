"""Building a one-file op: opforge.load (C, stable ABI) against
torch.utils.cpp_extension.load (C++, torch's full headers) with the same
kernel, side by side, each cold (empty build folder) in a fresh process.

    python benchmarks/bench_build.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

from opforge.benchmark import RESULTS, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIAL_OP = os.path.join(ROOT, "examples", "tutorial", "dispersion.c")

# The same kernel as examples/tutorial/dispersion.c (forward and backward, float32
# and float64; strided inputs made contiguous), as a C++ extension registered
# with TORCH_LIBRARY: the usual way to write one.
CPP_OP = textwrap.dedent(r"""
    #include <torch/extension.h>
    #include <cmath>

    template <typename T>
    static void fwd(T *y, const T *x, int64_t n, T alpha) {
        for (int64_t i = 0; i < n; i++) y[i] = x[i] * alpha + std::sqrt(x[i]);
    }
    template <typename T>
    static void bwd(T *dx, const T *dy, const T *x, int64_t n, T alpha) {
        for (int64_t i = 0; i < n; i++) dx[i] = dy[i] * alpha + dy[i] / (T(2) * std::sqrt(x[i]));
    }

    at::Tensor dispersion(const at::Tensor &x_, double alpha) {
        TORCH_CHECK(x_.device().is_cpu(), "x must be on the CPU");
        auto x = x_.contiguous();
        auto y = at::empty_like(x);
        AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dispersion", [&] {
            fwd<scalar_t>(y.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.numel(), (scalar_t)alpha);
        });
        return y;
    }

    at::Tensor dispersion_backward(const at::Tensor &g_, const at::Tensor &x_, double alpha) {
        auto g = g_.contiguous(), x = x_.contiguous();
        auto dx = at::empty_like(x);
        AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dispersion_backward", [&] {
            bwd<scalar_t>(dx.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.numel(),
                          (scalar_t)alpha);
        });
        return dx;
    }

    TORCH_LIBRARY(cppbaseline, m) {
        m.def("dispersion(Tensor x, float alpha) -> Tensor");
        m.def("dispersion_backward(Tensor grad, Tensor x, float alpha) -> Tensor");
    }
    TORCH_LIBRARY_IMPL(cppbaseline, CPU, m) {
        m.impl("dispersion", &dispersion);
        m.impl("dispersion_backward", &dispersion_backward);
    }
""")

TIMER = textwrap.dedent("""
    import sys, time, torch
    {setup}
    t0 = time.perf_counter()
    {call}
    t1 = time.perf_counter()
    x = torch.rand(1000, dtype=torch.float64) + 0.1
    torch.testing.assert_close({check}(x, 0.8), x * 0.8 + x.sqrt())
    print(t1 - t0)
""")


def _time(setup: str, call: str, check: str, env: dict) -> float:
    code = TIMER.format(setup=setup, call=call, check=check)
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return float(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cpp = os.path.join(tmp, "dispersion_ext.cpp")
        with open(cpp, "w") as f:
            f.write(CPP_OP)
        rows = []
        for attempt in range(2):  # cold builds, twice each, interleaved
            cache = os.path.join(tmp, f"opforge-cache-{attempt}")
            t_c = _time("import opforge", f"opforge.load('tutorial', [{TUTORIAL_OP!r}])",
                        "torch.ops.tutorial.dispersion", {"OPFORGE_CACHE_DIR": cache})
            t_warm = _time("import opforge", f"opforge.load('tutorial', [{TUTORIAL_OP!r}])",
                           "torch.ops.tutorial.dispersion", {"OPFORGE_CACHE_DIR": cache})
            build = os.path.join(tmp, f"cpp-build-{attempt}")
            os.makedirs(build)
            t_cpp = _time("import torch.utils.cpp_extension as ce",
                          f"ce.load('dispersion_ext', [{cpp!r}], build_directory={build!r}, is_python_module=False)",
                          "torch.ops.cppbaseline.dispersion", {})
            rows.append({"attempt": attempt, "opforge_load_cold_s": t_c, "opforge_load_cached_s": t_warm,
                         "cpp_extension_load_cold_s": t_cpp, "cold_speedup": t_cpp / t_c})
            print(f"cold opforge.load {t_c:.2f} s (cached {t_warm:.3f} s), cpp_extension.load {t_cpp:.1f} s: "
                  f"{t_cpp / t_c:.0f}x", flush=True)
    table = write_results("build", rows, [
        "one-file op (examples/tutorial/dispersion.c) vs the same kernel as a C++ extension (torch/extension.h, "
        "TORCH_LIBRARY), each built cold in a fresh process; times exclude importing torch",
    ], a.out)
    print(table)


if __name__ == "__main__":
    main()
