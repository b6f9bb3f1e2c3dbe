"""The first op, tried as a new user would: what broke on the way from
`opforge new` to `opforge bench`, each pinned by a test. The observations, and
the tests that would have caught them:

(1) torch.compile failing when lib.<op> is first used inside the compiled
    function: test_op_function_first_used_inside_compile (and the walk-through)
(2) the scaffold's bench script failing as generated: test_scaffold_bench_script_runs
(3) no way to declare a non-elementwise output shape: test_walkthrough_covers_what_a_first_op_needs,
    test_reduce_scaffold_declares_its_shape_rule, test_a_shape_rule_naming_no_argument_fails_at_load
(4) typos in called C functions building: test_misspelled_c_function_fails_the_build_with_file_and_line,
    test_declared_but_undefined_function_fails_the_link, test_compiler_warnings_are_shown
(5) `opforge check` FAIL without a reason; a dtype message naming dtypes the op refuses:
    test_check_report_says_why_a_row_fails, test_check_report_shows_the_whole_refusal,
    test_dtype_message_names_exactly_the_accepted_dtypes
(6) bench tolerance and shapes: test_tolerance_is_overridable, test_tolerance_options_only_loosen,
    test_check_and_bench_take_shapes_and_inputs
(7) the scaffold's fixed alpha, silent backward, wrong ISA in the log, no layout lines, no `info`
    for a user library, float32-only autocast: test_scaffold_has_exactly_the_signature_asked_for,
    test_log_names_the_variant_that_ran_not_the_best_isa, test_info_load_lists_a_user_library,
    test_scaffold_runs_bfloat16_and_autocast (and each project's own generated tests)
(8) README venv step, bench noise, RUNPATH: test_readme_says_to_activate_the_venv_first,
    test_noisy_timings_are_flagged, test_runtime_library_carries_no_build_path
(9) lib.<op>(x, w) of a schema with defaults failing with an IndexError, keywords refused, None for a
    tensor an "internal error": test_op_functions_take_keywords_and_defaults, test_none_for_a_tensor_is_named
"""

import math
import os
import re
import subprocess
import sys
import time
import zlib

import pytest
import torch

import opforge
import opforge.testing as ot
from opforge import scaffold
from test_toolkit import ROOT, TUTORIAL_OP, _cli, cache  # noqa: F401  (cache: a fixture)


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


@pytest.mark.slow
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
    assert rows[0]["op_fwd_us"] > 0 and rows[0]["op_fwd_spread"] >= 1


def test_noisy_timings_are_flagged():
    import opforge.benchmark as ob

    noisy, calm = ob.Timing(11e-6, 10.8e-6, 7958e-6, 21), ob.Timing(5.1e-6, 5e-6, 5.2e-6, 21)
    warned = ob._noisy({"op": noisy, "eager": calm}, "size 4096 forward")
    assert len(warned) == 1 and "op timings spread 737" in warned[0] and "quartiles 10.8-7958 us" in warned[0]
    assert math.isnan(ob._ratio(calm, noisy))


def test_a_ratio_from_noisy_timings_is_not_printed():
    """The first screen a user sees (make demo, opforge bench) prints no ratio from timings that spread
    (the 813.99x seen once on a busy machine): measure() takes more rounds while a side's middle half is
    wide, and ratio_text() says "unreliable" when it stays wide, and "not shown" past 100x."""
    import itertools

    import opforge.benchmark as ob

    delays = itertools.cycle([0.0, 0.004, 0.0, 0.0, 0.003, 0.0, 0.0005])  # a busy machine, for one side

    def jittery():
        time.sleep(next(delays))

    t = ob.measure({"steady": lambda: sum(range(200)), "jittery": jittery}, reps=5, target_s=1e-4, budget_s=0.2)
    assert t["steady"].samples == t["jittery"].samples > 5  # more rounds were taken, for both, interleaved
    assert not t["jittery"].reliable and ob.ratio_text(t["jittery"], t["steady"]).startswith("unreliable")
    fast, slow = ob.Timing(1e-6, 0.99e-6, 1.01e-6, 9), ob.Timing(2e-4, 1.98e-4, 2.02e-4, 9)
    assert ob.ratio_text(slow, fast).startswith("not shown (200x")
    assert ob.ratio_text(ob.Timing(3e-6, 2.9e-6, 3.1e-6, 9), fast) == "3.00x (2.87-3.13)"
    demo = open(os.path.join(os.path.dirname(TUTORIAL_OP), "..", "dispersion_correction.py")).read()
    assert "ratio_text(" in demo and "/ m['opforge']" not in demo  # the demo's table prints through it


MATMUL_FILES = """
import torch

def matmul(a, b):
    return a @ b

def inputs():
    return torch.rand(8, 16), torch.rand(16, 4)
"""


@pytest.mark.slow
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


# ---- (3), (5), (6), (7): the scaffold's signature, shapes, dtypes, log and info ----------------------------


def _project(tmp_path, name, inputs=None, scalars=None, reduce=None, edit=None):
    """A scaffolded project (as `opforge new` writes it), NAME.c optionally edited; its sources."""
    project = scaffold.new(scaffold.Signature.parse(name, inputs, scalars, reduce), str(tmp_path))
    src = os.path.join(project, f"{name}.c")
    if edit:
        with open(src) as f:
            text = f.read()
        with open(src, "w") as f:
            f.write(edit(text))
    return [src, os.path.join(project, f"{name}_avx2.c")]


def test_scaffold_has_exactly_the_signature_asked_for():
    def c_file(*args):
        sig = scaffold.Signature.parse(*args)
        return scaffold.files(sig)[f"{sig.name}.c"], sig

    text, _ = c_file("plain", None, None, None)
    assert '"plain(Tensor x) -> Tensor"' in text and "alpha" not in text  # no scalar unless asked for
    text, _ = c_file("two", "a,b", "alpha:float,reps:int,flag:bool", None)
    assert '"two(Tensor a, Tensor b, float alpha, int reps, bool flag) -> Tensor"' in text
    assert '"two_backward(Tensor grad, Tensor a, Tensor b, float alpha, int reps, bool flag) -> (Tensor, Tensor)"' in text
    assert '.backward_args = "grad0,a,b,alpha,reps,flag"' in text and '.backward_grads = "a,b"' in text
    text, _ = c_file("rowsum", "a,b", None, "last")
    assert '.shape = "[a[:-1]]"' in text and "float (*fwd)" in scaffold.files(
        scaffold.Signature.parse("rowsum", "a,b", None, "last"))["rowsum.h"]
    for args, message in [
        (("bad", "a,a", None, None), "argument names must differ"),
        (("bad", "a,b,c,e", None, None), "at most 3 tensors"),
        (("bad", "y", None, None), "'y' cannot name an argument"),
        (("bad", "a,da", None, None), "clashes with the names the generated C derives"),
        (("bad", "x", "alpha:double", None), "type must be one of float, int, bool"),
        (("bad", "x", None, "first"), "--reduce takes 'last'"),
        (("not-a-name", None, None, None), "NAME must be a C and Python identifier"),
    ]:
        with pytest.raises(SystemExit, match=message):
            scaffold.Signature.parse(*args)


def test_reduce_scaffold_declares_its_shape_rule(tmp_path, cache):
    lib = opforge.load("rowsum_fu", _project(tmp_path, "rowsum_fu", "a,b", None, "last"))
    assert str(lib.ops[0].shape[0]) == "[a[:-1]]"
    a, b = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    y = lib.rowsum_fu(a, b)
    assert y.shape == (2, 3)
    torch.testing.assert_close(y, (a * a + b * b).sum(-1))
    f = torch.compile(lambda a, b: lib.rowsum_fu(a, b) + 1, fullgraph=True, dynamic=True)
    torch.testing.assert_close(f(a[:1], b[:1]), (a[:1] * a[:1] + b[:1] * b[:1]).sum(-1) + 1)


def test_a_shape_rule_naming_no_argument_fails_at_load(tmp_path, cache):
    sources = _project(tmp_path, "badshape", "a,b", None, "last", edit=lambda t: t.replace('"[a[:-1]]"', '"[c[:-1]]"'))
    with pytest.raises(RuntimeError, match=r"badshape::badshape.*no argument 'c' in the schema \(it has a, b\)"):
        opforge.load("badshape", sources)


def test_walkthrough_covers_what_a_first_op_needs():
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index("## Your first op")
    section = text[start:text.index("\n## ", start + 1)]
    for part in ("--inputs a,b --reduce last", "[a[:-1]]", "like:x", "csrc/include/opforge/op.h", "bfloat16",
                 "--shape a=64,512", "--rtol 1e-5", "torch.compile", "fullgraph=True", "torch.autocast",
                 "OPFORGE_LOG_LEVEL=info", "opforge info --load", "--smoke", "bwd"):
        assert part in section, part


def test_dtype_message_names_exactly_the_accepted_dtypes(tmp_path, cache):
    lib = opforge.load("dtypes_fu", _project(tmp_path, "dtypes_fu"))
    with pytest.raises(RuntimeError, match=r"\[dtypes_fu::dtypes_fu\] argument 'x' must be float32, bfloat16 or "
                                           r"float16, got float64$"):
        lib.dtypes_fu(torch.ones(3, dtype=torch.float64))
    # a float32-only op (the set narrowed where the scaffold states it) says float32 and nothing else
    only = _project(tmp_path, "f32_fu", edit=lambda t: t.replace(
        "#define ACCEPTED (OPF_DTYPE_BIT(OPF_F32) | OPF_DTYPE_BIT(OPF_BF16) | OPF_DTYPE_BIT(OPF_F16))",
        "#define ACCEPTED OPF_DTYPE_BIT(OPF_F32)"))
    lib = opforge.load("f32_fu", only)
    for dtype in (torch.bfloat16, torch.float64, torch.int32):
        with pytest.raises(RuntimeError, match=rf"argument 'x' must be float32, got {str(dtype)[6:]}$"):
            lib.f32_fu(torch.ones(3, dtype=dtype))
    assert torch.equal(lib.f32_fu(torch.full((3,), 3.0)), torch.full((3,), 9.0))


def test_tolerance_options_only_loosen():
    assert ot.tolerance(torch.float32, rtol=1e-5) == dict(atol=1e-6, rtol=1e-5)
    assert ot.tolerance(torch.bfloat16, atol=1e-4, rtol=1e-5) == ot.TOLERANCES[torch.bfloat16]  # not tightened


def _logged(tmp_path, sources, code, **env):
    script = ("import torch, opforge\n"
              f"lib = opforge.load('logged', {sources!r})\n" + code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OPFORGE_CACHE_DIR=str(tmp_path / "cache"), **env))


def test_log_names_the_variant_that_ran_not_the_best_isa(tmp_path):
    sources = _project(tmp_path, "logged")
    call = "x = torch.rand(4, 8, requires_grad=True)\nlib.logged(x).sum().backward()\n"
    # a library with the reference only: the machine's best ISA is not what ran
    r = _logged(tmp_path, sources[:1], call, OPFORGE_LOG_LEVEL="debug")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    for op in ("logged::logged ", "logged::logged_backward "):  # the backward logs too
        line = [s for s in lines if op in s and "[opforge info]" in s]
        assert len(line) == 1 and "isa=ref kernels=logged:ref threads=" in line[0], r.stderr
        assert any(op.strip() + " layout:" in s for s in lines), r.stderr  # debug: the user op's layout
    if "avx2" in opforge.supported_isas():
        r = _logged(tmp_path, sources, call, OPFORGE_LOG_LEVEL="info")
        assert "isa=avx2 kernels=logged:avx2 threads=" in r.stderr, r.stderr
        r = _logged(tmp_path, sources, call, OPFORGE_LOG_LEVEL="info", OPFORGE_ISA="ref")
        assert "isa=ref kernels=logged:ref threads=" in r.stderr and "avx2" not in r.stderr, r.stderr


def test_info_load_lists_a_user_library(tmp_path):
    sources = _project(tmp_path, "listed", "a,b", "alpha:float", "last")
    r = _cli("info", "--load", *sources, OPFORGE_CACHE_DIR=str(tmp_path / "cache"))
    assert r.returncode == 0, r.stdout + r.stderr
    best = "avx2" if "avx2" in opforge.supported_isas() else "ref"
    for part in ("namespace   listed", "listed(Tensor a, Tensor b, float alpha) -> Tensor", "shape [a[:-1]]",
                 "autograd: listed_backward(grad0, a, b, alpha) -> grads of a, b",
                 "autocast lower (runs in the autocast dtype)",
                 "listed_backward(Tensor grad, Tensor a, Tensor b, float alpha) -> (Tensor, Tensor)",
                 f"*{best} ({best})", "ref (ref)"):
        assert part in r.stdout, r.stdout
    bad = _cli("info", "--load", str(tmp_path / "missing.c"))
    assert bad.returncode != 0 and "does not exist" in bad.stderr


def test_scaffold_runs_bfloat16_and_autocast(tmp_path, cache):
    lib = opforge.load("halves_fu", _project(tmp_path, "halves_fu", "a,b", "alpha:float", None))
    a, b = torch.randn(5, 7), torch.randn(5, 7)
    for dtype in (torch.bfloat16, torch.float16):
        y = lib.halves_fu(a.to(dtype), b.to(dtype), 0.5)
        want = 0.5 * (a.to(dtype).double() ** 2 + b.to(dtype).double() ** 2)
        assert y.dtype == dtype
        torch.testing.assert_close(y.double(), want, rtol=8e-3, atol=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lib.halves_fu(a, b, 0.5).dtype == torch.bfloat16  # lower policy: runs in the autocast dtype


def test_op_functions_take_keywords_and_defaults(tmp_path, cache):
    """lib.<op> and opforge's own op functions take arguments as torch.ops.<ns>.<op> does: by keyword, and
    the schema's defaults where left out; inspect shows the schema's names and defaults."""
    import inspect

    lib = opforge.load("kwargs_op", [_tutorial(tmp_path, "kwargs_op")])
    x = torch.rand(33) + 0.1
    want = ot.dispersion_correction(x, 0.8)
    for got in (lib.dispersion(x, alpha=0.8), lib.dispersion(alpha=0.8, x=x), opforge.dispersion_correction(x, alpha=0.8)):
        torch.testing.assert_close(got, want)
    assert str(inspect.signature(lib.dispersion)) == "(x, alpha)"
    from opforge.functional.linear import _linear

    assert str(inspect.signature(_linear)) == "(x, weight, bias, activation, save_preact=True)"
    w = torch.randn(5, 33)
    torch.testing.assert_close(_linear(x[None], w, None, activation="gelu")[0], torch.nn.functional.gelu(x[None] @ w.t()))
    for call, msg in ((lambda: lib.dispersion(x), r"\[kwargs_op::dispersion\] missing argument 'alpha' \(its arguments are \(x, alpha\)\)"),
                      (lambda: lib.dispersion(x, beta=1.0), r"unexpected keyword argument 'beta'; its arguments are \(x, alpha\)"),
                      (lambda: lib.dispersion(x, 0.5, alpha=1.0), "two values for argument 'alpha'"),
                      (lambda: lib.dispersion(x, 0.5, 1.0), r"takes 2 arguments \(x, alpha\), got 3")):
        with pytest.raises(RuntimeError, match=msg):
            call()


@pytest.mark.parametrize("call, op, arg", [
    (lambda x: torch.ops.opforge.linear(x, None, None, "none"), "linear", "weight"),
    (lambda x: opforge.linear(x, None), "linear", "weight"),
    (lambda x: opforge.rms_norm(None), "rms_norm", "x"),
    (lambda x: opforge.softmax(None), "softmax", "x"),
    (lambda x: opforge.add_rms_norm(x, None), "add_rms_norm", "residual"),
    (lambda x: opforge.swiglu(None), "swiglu", "gate"),
    (lambda x: opforge.scaled_dot_product_attention(x, None, x), "scaled_dot_product_attention", "key"),
    (lambda x: opforge.rope(x, x, None, x), "rope", "cos"),
    (lambda x: opforge.linear_cross_entropy(x, x, None), "linear_cross_entropy", "target"),
])
def test_none_for_a_tensor_is_named(call, op, arg):
    """None where a tensor belongs: the op and the argument named, from the C glue (an undefined tensor) or
    from the Python function that reads it first; never an internal error or an AttributeError."""
    with pytest.raises(RuntimeError, match=rf"\[opforge::{op}\] argument '{arg}' must be a tensor, got None"):
        call(torch.randn(2, 4, 8))


@pytest.mark.parametrize("old, new, message", [
    ('.backward_grads = "x"', '.backward_grads = "c"', r"\.backward_grads names 'c', which is not a tensor argument of the op \(its tensor arguments: x\)"),
    ('.backward_args = "grad0,x,alpha"', '.backward_args = "grad0,x,zz"', r"\.backward_args: 'zz' is none of gradI, outI"),
    ('.backward_args = "grad0,x,alpha"', '.backward_args = "grad0,out0!alpha,alpha"', r"\.backward_args: 'out0!alpha' is none of gradI, outI, outI!, outI!ARG \(I < 1, the op's results; ARG one of \.backward_grads\)"),
    ('.backward_args = "grad0,x,alpha"', '.backward_args = "grad0,x"', r"\.backward_args lists 2 values \(grad0, x\), but \w+::dispersion_backward takes 3"),
    ('.backward = "dispersion_backward"', '.backward = "dispersion_bwd"', r"\.backward names 'dispersion_bwd', which this library's op table does not declare"),
    ('.flops = "3*numel(x)"', '.flops = "3*numel(q)"', r"\.flops names 'q', which is not a tensor argument"),
    ('.autocast = OPF_AUTOCAST_FP32', '.autocast = 42', r"\.autocast must be one of the OPF_AUTOCAST_\* policies"),
])
def test_descriptor_mistakes_fail_at_load_and_leave_the_namespace_free(tmp_path, cache, old, new, message):
    """A descriptor field naming something the schemas do not have fails at load, naming the op and the field;
    nothing is registered, so the corrected file loads under the same namespace in the same process."""
    ns = f"desc_{zlib.crc32(new.encode())}"
    with pytest.raises(RuntimeError, match=rf"\[{ns}::dispersion\] {message}"):
        opforge.load(ns, [_tutorial(tmp_path, ns, lambda s: s.replace(old, new, 1))])
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    lib = opforge.load(ns, [_tutorial(fixed, ns)])
    x = torch.rand(9) + 0.1
    torch.testing.assert_close(lib.dispersion(x, 0.8), ot.dispersion_correction(x, 0.8))


def test_cli_mistakes_are_one_line_each(tmp_path, cache, capsys):
    """check / bench / new given a user's mistake: one line naming it (and, for an error in the user's own
    reference or inputs function, where in it), never a traceback."""
    import opforge_cli

    src = _tutorial(tmp_path, "cli_mistakes")
    ref = tmp_path / "ref.py"
    ref.write_text("def none(x, alpha):\n    return None\n\n\ndef wide(x, alpha):\n    return x[:, None].expand(-1, 2)\n"
                   "\n\ndef typo(x, alpha):\n    return x * alphaa\n\n\ndef good(x, alpha):\n    return x\n")
    (tmp_path / "taken").write_text("")
    op = ["cli_mistakes::dispersion", "--load", src]
    for argv, message in [
        (["check", "cli_mistakes::dispersion", "--load", str(tmp_path / "missing.c")], r"^opforge: --load: .*missing\.c does not exist$"),
        (["check", *op, "--reference", f"{ref}:good", "--dtypes", "float33"], r"^opforge: --dtypes float33: expected float64, float32, bfloat16 or float16$"),
        (["check", *op, "--reference", f"{ref}:good", "--dtypes", "int32"], "--dtypes int32: expected"),
        (["check", *op, "--reference", f"{ref}:none"], r"^opforge check: ValueError: the reference returned None"),
        (["check", *op, "--reference", f"{ref}:wide"], r"the reference's result 0 has shape \(\d+, 2\), the op's \(\d+,\)"),
        (["check", *op, "--reference", f"{ref}:typo"], rf"^opforge check: NameError: name 'alphaa' is not defined \({ref}:10, in typo\)"),
        (["check", *op, "--reference", f"{ref}:good", "--shape", "x=-1,8"], "--shape x=-1,8: sizes must be 0 or more"),
        (["check", "swiglu"], r"^opforge: no op \w+::swiglu \(opforge's ops: .*\bglu\b"),
        (["bench", "dispersion_correction", "--sizes", "abc"], "--sizes takes element counts above 0"),
        (["bench", "dispersion_correction", "--sizes", "0"], "--sizes takes element counts above 0"),
        (["bench", "dispersion_correction", "--shape", "x=64", "--sizes", "100"], "not with --shape or --inputs"),
        (["bench", "dispersion_correction", "--smoke", "--out", str(tmp_path / "taken" / "sub")], "--out .*cannot write"),
        (["new", "taken", "--dir", str(tmp_path)], "exists and is not a folder"),
    ]:
        with pytest.raises(SystemExit) as e:
            opforge_cli.main(argv)
        assert isinstance(e.value.code, str) and re.search(message, e.value.code.splitlines()[0]), (argv, e.value.code)


def test_api_mistakes_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"\[opforge.load_library\] .*nope\.so does not exist"):
        opforge.load_library(str(tmp_path / "libnope.so"), "nope")
    with pytest.raises(TypeError, match="opforge.patch: expected a torch.nn.Module, got int"):
        opforge.patch(42)
