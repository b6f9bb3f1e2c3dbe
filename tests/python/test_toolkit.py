"""The op author's toolkit: the README tutorial from an empty folder
(opforge new, its tests; a one-file op through opforge.load), the build cache,
compiler errors, ahead-of-time builds, and the check / bench / info commands."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import opforge
import opforge.testing as ot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TUTORIAL_OP = os.path.join(ROOT, "examples", "tutorial", "dispersion.c")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(d))
    return d


def _cli(*args, cwd=None, **env):
    return subprocess.run(
        [sys.executable, "-m", "opforge_cli", *args], cwd=cwd, env=dict(os.environ, **env),
        capture_output=True, text=True, timeout=600,
    )


@pytest.mark.slow
def test_new_project_passes_its_own_tests(tmp_path):
    r = _cli("new", "scaled_square", "--dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    project = tmp_path / "scaled_square"
    assert {"scaled_square.c", "scaled_square_avx2.c", "reference.py", "test_scaled_square.py",
            "bench_scaled_square.py"} <= set(os.listdir(project))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project,
        env=dict(os.environ, OPFORGE_CACHE_DIR=str(tmp_path / "cache")), capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout
    assert _cli("new", "scaled_square", "--dir", str(tmp_path)).returncode != 0  # never overwrites


def test_one_file_op_through_load(tmp_path, cache):
    src = tmp_path / "dispersion.c"
    shutil.copy(TUTORIAL_OP, src)
    lib = opforge.load("tutorial", [str(src)])
    assert {d.name for d in lib.ops} == {"dispersion", "dispersion_backward"}
    x = torch.rand(33, 17, dtype=torch.float64) + 0.1
    torch.testing.assert_close(torch.ops.tutorial.dispersion(x, 0.8), ot.dispersion_correction(x, 0.8))
    torch.testing.assert_close(lib.dispersion(x.t(), 0.8), ot.dispersion_correction(x.t(), 0.8))
    assert torch.autograd.gradcheck(lambda t: torch.ops.tutorial.dispersion(t, 0.8), (x[:5, :4].clone().requires_grad_(),))
    f = torch.compile(lambda t: torch.ops.tutorial.dispersion(t, 0.8).tanh(), fullgraph=True)
    torch.testing.assert_close(f(x.float()), ot.dispersion_correction(x.float(), 0.8).tanh())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the FP32 policy: bf16 inputs run in float32
        assert torch.ops.tutorial.dispersion(x.bfloat16(), 0.8).dtype == torch.float32
    assert ot.check(torch.ops.tutorial.dispersion, ot.dispersion_correction, dtypes=[torch.float32, torch.float64]).passed
    with pytest.raises(RuntimeError, match=r"\[tutorial::dispersion\] argument 'x' must be float32 or float64, got bfloat16"):
        torch.ops.tutorial.dispersion(x.bfloat16(), 0.8)
    # the same sources again: the same library, nothing rebuilt
    assert opforge.load("tutorial", [str(src)]) is lib


def test_second_process_loads_from_the_cache(tmp_path, cache):
    src = tmp_path / "dispersion.c"
    shutil.copy(TUTORIAL_OP, src)
    code = f"import opforge; opforge.load('tutorial2', [{str(src)!r}], verbose=True)"
    env = dict(os.environ, OPFORGE_CACHE_DIR=str(cache))
    src.write_text(src.read_text().replace('"tutorial::', '"tutorial2::'))
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert "gcc" in first.stdout or "cc" in first.stdout  # compiled (verbose prints the commands)
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert second.returncode == 0 and "cached" in second.stdout and " -c " not in second.stdout


def test_compiler_errors_carry_file_and_line(tmp_path, cache):
    bad = tmp_path / "broken.c"
    bad.write_text("#include <opforge/op.h>\n\nint f(void) { return undefined_name; }\n")
    with pytest.raises(opforge.BuildError, match=r"broken\.c:3:.*undefined_name"):
        opforge.load("broken", [str(bad)])


def test_load_rejects_bad_arguments(tmp_path, cache):
    with pytest.raises(ValueError, match="must be a Python identifier"):
        opforge.load("not-a-name", [TUTORIAL_OP])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        opforge.load("missing", [str(tmp_path / "nope.c")])
    other = tmp_path / "dispersion.c"
    other.write_text(open(TUTORIAL_OP).read() + "\n/* changed */\n")
    opforge.load("tutorial", [TUTORIAL_OP])
    with pytest.raises(RuntimeError, match="already loaded from other sources"):
        opforge.load("tutorial", [str(other)])


def test_ahead_of_time_build_with_cextension(tmp_path):
    pkg = tmp_path / "aotpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    src = tmp_path / "dispersion.c"
    src.write_text(open(TUTORIAL_OP).read().replace('"tutorial::', '"aot::'))
    (tmp_path / "setup.py").write_text(textwrap.dedent("""
        from setuptools import setup
        from opforge.build import BuildExtension, CExtension
        setup(name="aotpkg", packages=["aotpkg"],
              ext_modules=[CExtension("aotpkg.aot", ["dispersion.c"])],
              cmdclass={"build_ext": BuildExtension})
    """))
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    lib = opforge.load_library(str(pkg / "libaot.so"), "aot")
    x = torch.rand(10) + 0.1
    torch.testing.assert_close(lib.dispersion(x, 0.5), ot.dispersion_correction(x, 0.5))


def test_check_reports_failures():
    def wrong(x, alpha):
        return x * alpha + torch.sqrt(x) * (1 + 1e-3)

    report = ot.check(torch.ops.opforge.dispersion_correction, wrong, dtypes=[torch.float32])
    assert not report.passed
    r = report.results[0]
    assert r.out_of_tolerance > 0 and r.max_rel > 5e-4 and r.grad_out_of_tolerance > 0
    assert "FAIL" in str(report)


def test_check_command():
    r = _cli("check", "dispersion_correction")
    assert r.returncode == 0, r.stdout + r.stderr
    for col in ("max abs", "max rel", "max ulp", "cosine", ">1e-3 rel", ">5e-3 rel", "grad max rel"):
        assert col in r.stdout
    assert r.stdout.count("PASS") == 5  # the title and four dtypes


def test_every_op_has_a_reference():
    # the in-place twins (linear_backward_) overwrite an input: a check would compare against a clobbered one
    assert set(ot.REFERENCES) == {d.name for d in opforge.library.ops if not d.name.endswith("_")}


@pytest.mark.parametrize("op", sorted(ot.REFERENCES))
def test_check_command_knows_every_op(op, capsys):
    # in this process (test_check_command runs the command itself): a fresh interpreter per op is ~3 s of imports
    import opforge_cli

    rc = opforge_cli.main(["check", op])
    out, err = capsys.readouterr()
    assert rc == 0 and "no reference" not in err, out + err
    assert out.count("PASS") == 5, out  # the title and four dtypes
    if op.endswith("_backward"):  # a backward op has no derivative of its own to compare
        assert all(line.split()[7] == "-" for line in out.splitlines()[2:]), out


@pytest.mark.slow
def test_bench_command(tmp_path):
    r = _cli("bench", "dispersion_correction", "--sizes", "4096", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    stem = tmp_path / "bench_dispersion_correction_float32"
    assert "fwd_vs_eager" in (tmp_path / f"{stem.name}.md").read_text()
    assert (tmp_path / f"{stem.name}.csv").exists() and (tmp_path / f"{stem.name}.png").exists()


def test_info_command():
    r = _cli("info")
    assert r.returncode == 0, r.stdout + r.stderr
    for part in ("torch", "stable ABI", "cpu", f"isa         {opforge.get_isa()}", "threads", "cuda",
                 "opforge::dispersion_correction", "kernels ", "  gemm ", "no problems found"):
        assert part in r.stdout
    bad = _cli("info", OPFORGE_ISA="sse9")
    assert bad.returncode == 1 and "OPFORGE_ISA=sse9 is not valid here" in bad.stdout


def test_cpu_signature_is_the_kernels():
    """cpu_features' family / model / stepping (the provider cache's key beside the brand string) are
    what Linux read from cpuid; the features stay booleans (`opforge info` lists the true ones)."""
    feats = opforge.cpu_features()
    assert all(type(v) is bool for k, v in feats.items() if k not in ("model", "family", "model_number", "stepping"))
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if fields.get("vendor_id") not in ("GenuineIntel", "AuthenticAMD"):
        pytest.skip("not an x86 CPU that Linux describes with family / model / stepping")
    assert (feats["family"], feats["model_number"], feats["stepping"]) == (
        int(fields["cpu family"]), int(fields["model"]), int(fields["stepping"]))
    assert f"family {feats['family']} model {feats['model_number']}" in _cli("info").stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, outputs",
    [
        ("bench_dispersion_correction.py", ["dispersion_correction_float32.md", "dispersion_correction_overhead.csv"]),
        ("bench_gemm.py", ["gemm.md", "gemm.csv"]),
        ("bench_linear.py", ["linear_gelu.md", "linear_gelu.csv"]),
        ("bench_linear_cross_entropy.py", ["linear_cross_entropy.md", "linear_cross_entropy.csv"]),
        ("bench_cuda.py", ["cuda.md", "cuda.csv"]),  # without a GPU: the script's own smoke test on the CPU
    ],
)
def test_benchmark_scripts_smoke(tmp_path, script, outputs):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in outputs:
        assert (tmp_path / name).exists()


_FAULTS = """
import sys, torch, opforge.benchmark as ob
ob.set_malloc(sys.argv[1])
def step():  # a 64 MiB tensor made and dropped, as eager's logits are every step
    t = torch.empty(1 << 24)
    t.fill_(1.0)
    return float(t[-1])
step()
print(ob.page_faults(step, reps=5))
"""


def _plain_glibc_env():
    # without a preloaded allocator or malloc settings of the caller's, which would change the default's faults
    return {k: v for k, v in os.environ.items()
            if k not in ("LD_PRELOAD", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")}


@pytest.mark.skipif(not __import__("opforge.benchmark").benchmark.glibc(), reason="glibc's mallopt")
def test_page_faults_and_malloc_keep():
    # glibc maps a 64 MiB block fresh on each allocation (16384 4-KiB pages paged in per step, or 32
    # huge ones where transparent huge pages back it); kept, it is reused
    def faults(mode):
        r = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120,
                           env=_plain_glibc_env())
        assert r.returncode == 0, r.stderr[-2000:]
        return float(r.stdout.split()[-1])

    default, keep = faults("default"), faults("keep")
    assert default >= 32 and keep <= default / 8, (default, keep)
    import opforge.benchmark as ob

    with pytest.raises(ValueError, match="malloc mode 'jemalloc': expected one of default, keep"):
        ob.set_malloc("jemalloc")


@pytest.mark.parametrize("os_amx, granted, expect", [
    (True, True, "bfloat16 GEMMs on AMX-BF16 tiles"),
    (True, False, "Linux refused this process the tile state"),
    (False, False, "the OS does not enable the tile state"),
])
@pytest.mark.parametrize("machine_amx", [False, True], ids=["machine-without-amx", "machine-with-amx"])
def test_info_reports_amx(monkeypatch, capsys, os_amx, granted, expect, machine_amx):
    # what this CPU lacks is reported as an AMX one would be: the line says whether the tiles run and why not
    import opforge_cli

    # The CPU is faked whole: the machine's own AMX (tiles granted or not) must not reach the line.
    # machine_amx stands in for running on a CPU whose tiles the OS granted, on any machine.
    real = opforge.supported_isas() + (["amx"] if machine_amx and "amx" not in opforge.supported_isas() else [])
    feats = dict(opforge.cpu_features(), amx_tile=True, amx_bf16=True, os_amx=os_amx)
    isas = [i for i in real if i != "amx"] + (["amx"] if granted else [])
    monkeypatch.setattr(opforge, "cpu_features", lambda: dict(feats))
    monkeypatch.setattr(opforge, "supported_isas", lambda: isas)
    opforge_cli.info(None)
    amx = [line for line in capsys.readouterr().out.splitlines() if line.startswith("amx ")]
    assert len(amx) == 1 and expect in amx[0], amx
