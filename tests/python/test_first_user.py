"""The first op, tried as a new user would: what broke on the way from
`opforge new` to `opforge bench`, each pinned by a test."""

import os
import subprocess
import sys

import pytest
import torch

import opforge
import opforge.testing as ot
from test_toolkit import TUTORIAL_OP, _cli, cache  # noqa: F401  (cache: a fixture)


def _tutorial(tmp_path, namespace: str, edit=lambda text: text) -> str:
    """The tutorial op under another namespace (a namespace loads once per process)."""
    src = tmp_path / f"{namespace}.c"
    src.write_text(edit(open(TUTORIAL_OP).read().replace('"tutorial::', f'"{namespace}::')))
    return str(src)


def test_op_function_first_used_inside_compile(tmp_path, cache):
    lib = opforge.load("first_compiled", [_tutorial(tmp_path, "first_compiled")])
    assert "dispersion" in vars(lib)  # built at load, not on first lookup
    x = torch.rand(64) + 0.1
    f = torch.compile(lambda t: lib.dispersion(t, 0.8).tanh(), fullgraph=True)
    torch.testing.assert_close(f(x), ot.dispersion_correction(x, 0.8).tanh())
    with pytest.raises(AttributeError, match="has no op 'nope'"):
        lib.nope  # noqa: B018  (the lookup is what raises)


def test_misspelled_c_function_fails_the_build_with_file_and_line(tmp_path, cache):
    src = _tutorial(tmp_path, "typo", lambda s: s.replace("+ sqrtf(x[i * xs]);", "+ sqaure(x[i * xs]);", 1))
    with pytest.raises(opforge.BuildError, match=r"typo\.c:15:\d+: error: implicit declaration of function .sqaure"):
        opforge.load("typo", [src])


def test_declared_but_undefined_function_fails_the_link(tmp_path, cache):
    src = _tutorial(tmp_path, "undefined", lambda s: s.replace(
        "#include <math.h>", "#include <math.h>\nfloat sqaure(float);", 1).replace(
        "+ sqrtf(x[i * xs]);", "+ sqaure(x[i * xs]);", 1))
    with pytest.raises(opforge.BuildError, match="undefined reference to .sqaure"):
        opforge.load("undefined", [src])


def test_compiler_warnings_are_shown(tmp_path, cache, capfd):
    src = _tutorial(tmp_path, "warned", lambda s: s.replace(
        "#include <opforge/op.h>", "#include <opforge/op.h>\nstatic int unused_helper(void) { return 1; }", 1))
    opforge.load("warned", [src])
    assert "unused_helper" in capfd.readouterr().err


def test_runtime_library_carries_no_build_path():
    lib = os.path.join(os.path.dirname(opforge.__file__), "libopforge.so")
    dynamic = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True).stdout
    paths = [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "RPATH" in line or "RUNPATH" in line]
    assert paths, dynamic
    for entry in ":".join(paths).split(":"):
        assert entry.startswith("$ORIGIN"), f"libopforge.so hard-codes {entry}"


def test_scaffold_bench_script_runs(tmp_path):
    r = _cli("new", "benched", "--dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    run = subprocess.run([sys.executable, "bench_benched.py", "--smoke", "--out", str(tmp_path / "results")],
                         cwd=tmp_path / "benched", env=dict(os.environ, OPFORGE_CACHE_DIR=str(tmp_path / "cache")),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert (tmp_path / "results" / "bench_benched.md").exists()
    assert "USDT" not in run.stderr  # the profiler's start/stop lines (peak memory) are not passed on


def test_check_and_bench_take_an_op_function(tmp_path, cache):
    lib = opforge.load("as_function", [_tutorial(tmp_path, "as_function")])
    assert lib.dispersion.op is torch.ops.as_function.dispersion.default
    assert ot._as_overload(lib.dispersion) is torch.ops.as_function.dispersion.default


def _nan_to_zero(x, alpha):
    return torch.nan_to_num(ot.dispersion_correction(x, alpha), nan=0.0)


def test_check_report_says_why_a_row_fails():
    report = ot.check(torch.ops.opforge.dispersion_correction, _nan_to_zero, dtypes=[torch.float32], grad=False)
    r = report.results[0]
    assert not r.passed and r.out_of_tolerance == 0 and r.special_mismatches > 0
    row = next(line for line in str(report).splitlines() if line.startswith("float32"))
    assert "FAIL" in row and f"{r.special_mismatches} NaN/inf values differ" in row


def test_check_report_shows_the_whole_refusal():
    report = ot.check(torch.ops.opforge.matmul, torch.matmul, dtypes=[torch.float32])
    message = report.results[0].error
    assert "got 1-d and 1-d" in message and message in str(report)


def _off_by_1e5(x, alpha):
    return ot.dispersion_correction(x, alpha) * (1 + 1e-5)


def test_tolerance_is_overridable():
    import opforge.benchmark as ob

    op = torch.ops.opforge.dispersion_correction
    assert not ot.check(op, _off_by_1e5, dtypes=[torch.float32], grad=False).passed
    report = ot.check(op, _off_by_1e5, dtypes=[torch.float32], grad=False, rtol=1e-4)
    assert report.passed and "rtol 0.0001" in str(report)
    with pytest.raises(AssertionError, match="out of tolerance.*atol=/rtol="):
        ob.bench(op, _off_by_1e5, sizes=[256], backward=False, reps=1, target_s=1e-3)
    rows = ob.bench(op, _off_by_1e5, sizes=[256], backward=False, reps=3, target_s=1e-3, rtol=1e-4)
    assert rows[0]["op_fwd_min_us"] <= rows[0]["op_fwd_us"] <= rows[0]["op_fwd_max_us"]


def test_noisy_timings_are_flagged():
    import opforge.benchmark as ob

    warned = ob._noisy({"op": (10.8e-6, 11e-6, 7958e-6), "eager": (5e-6, 5.1e-6, 5.2e-6)}, "size 4096 forward")
    assert len(warned) == 1 and "op timings spread 737" in warned[0] and "min 10.8 us" in warned[0]


MATMUL_FILES = """
import torch

def matmul(a, b):
    return a @ b

def inputs():
    return torch.rand(8, 16), torch.rand(16, 4)
"""


def test_check_and_bench_take_shapes_and_inputs(tmp_path):
    ref = tmp_path / "ref.py"
    ref.write_text(MATMUL_FILES)
    r = _cli("check", "matmul", "--reference", f"{ref}:matmul", "--shape", "a=8,16", "--shape", "b=16,4",
             "--dtypes", "float32")
    assert r.returncode == 0 and "float32" in r.stdout and "PASS" in r.stdout, r.stdout + r.stderr
    bad = _cli("check", "matmul", "--reference", f"{ref}:matmul", "--shape", "c=3")
    assert bad.returncode != 0 and "no Tensor argument 'c' (its Tensor arguments: a, b)" in bad.stderr
    r = _cli("bench", "matmul", "--reference", f"{ref}:matmul", "--no-backward", "--out", str(tmp_path))
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "must both be 2-d" in r.stderr and "--shape" in r.stderr
    r = _cli("bench", "matmul", "--reference", f"{ref}:matmul", "--inputs", f"{ref}:inputs", "--no-backward",
             "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| 192 | float32 |" in r.stdout  # one input set: 8*16 + 16*4 elements


def test_readme_says_to_activate_the_venv_first():
    head = "\n".join(open(os.path.join(os.path.dirname(TUTORIAL_OP), "..", "..", "README.md")).read().splitlines()[:30])
    assert "source .venv/bin/activate" in head
