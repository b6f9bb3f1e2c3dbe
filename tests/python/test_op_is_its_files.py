"""An op is its files: a standard op added by copying one under a new name, and nothing else edited.

The tree is copied to a temporary folder, the files of dispersion_correction (CONTRIBUTING.md's
"Adding an op" list: its kernels, glue, C test, Python test, benchmark, Python function and
reference) are copied under the stem scaled_sqrt with every name in them renamed, and the copy is
built and tested as CI would: the library registers the new op, its shims, its kernel family; the
Python layer exports its function and reference; its C test, its Python test and the coverage tests of
the fuzzer, the export model, the training cases and the thread sweep all pass without a line
elsewhere. A generic file that lists ops would fail here.
"""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # builds the whole library in the copy (a minute or two on 2 cores)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OLD, NEW = "dispersion_correction", "scaled_sqrt"


def op_files(root: str, stem: str) -> list[str]:
    """The files of a standard op, relative to root: CONTRIBUTING.md's list."""
    kernels = sorted(f"csrc/kernels/{f}" for f in os.listdir(os.path.join(root, "csrc/kernels"))
                     if f.split(".")[0] == stem or f.startswith(stem + "_avx"))
    # the CPU glue's header: what it shares with the CUDA glue (the checks and the allocation), where it has one
    header = [f for f in (f"csrc/torch/{stem}.h",) if os.path.isfile(os.path.join(root, f))]
    cuda = [f for f in (f"csrc/cuda/{stem}.cu", f"csrc/cuda/{stem}.h", f"csrc/cuda/{stem}.c",
                        f"tests/cuda/test_{stem}.c") if os.path.isfile(os.path.join(root, f))]
    return kernels + [f"csrc/torch/{stem}.c", f"tests/c/test_{stem}.c", f"tests/python/test_{stem}.py",
                      f"benchmarks/bench_{stem}.py", f"python/opforge/functional/{stem}.py",
                      f"python/opforge/references/{stem}.py"] + header + cuda


def source_files(root: str) -> list[str]:
    """What a fresh clone has: the files git tracks, and the ones it does not ignore (a working tree's new files)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, text=True, check=True).stdout.split("\n")
    return [f for f in out if f and os.path.isfile(os.path.join(root, f))]


def rename(text: str) -> str:
    return text.replace(OLD, NEW).replace(OLD.upper(), NEW.upper())


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("needs a git checkout to copy")
    dest = str(tmp_path_factory.mktemp("tree"))
    for f in source_files(ROOT):
        os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(dest, f))
    old = op_files(ROOT, OLD)
    assert len(old) >= 9 and all(os.path.isfile(os.path.join(ROOT, f)) for f in old), old
    for f in old:
        with open(os.path.join(ROOT, f)) as src, open(os.path.join(dest, rename(f)), "w") as out:
            out.write(rename(src.read()))
    if os.path.isdir(os.path.join(ROOT, ".venv")):  # the Makefile's tools, as set up for this tree
        os.symlink(os.path.join(ROOT, ".venv"), os.path.join(dest, ".venv"))
    env = dict(os.environ, PYTHONPATH=os.path.join(dest, "python"), OPFORGE_NUM_THREADS="2")
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=dest, env=env,
                           capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    return dest, env


def run(tree, *args, timeout=900):
    dest, env = tree
    proc = subprocess.run([sys.executable, *args], cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_copy_adds_only_the_new_ops_files(tree):
    """Nothing but the new files differs from the tree: the rest of the test shows nothing else was needed."""
    dest, _ = tree
    new = set(op_files(dest, NEW))
    assert new == {rename(f) for f in op_files(ROOT, OLD)}
    for f in source_files(ROOT):
        with open(os.path.join(ROOT, f), "rb") as a, open(os.path.join(dest, f), "rb") as b:
            assert a.read() == b.read(), f


CHECK = f"""
import torch, opforge
from opforge import references
x = torch.rand(5, 7, dtype=torch.float64, requires_grad=True)
y, z = opforge.{NEW}(x, 0.3), opforge.{OLD}(x, 0.3)
assert torch.equal(y, z), (y, z)
assert torch.equal(torch.ops.opforge.{NEW}(x, 0.3), z)
gy, = torch.autograd.grad(y.sum(), x)
gz, = torch.autograd.grad(z.sum(), x)
assert torch.equal(gy, gz)
compiled = torch.compile(lambda t: opforge.{NEW}(t, 0.3), fullgraph=True, backend="aot_eager")
assert torch.equal(compiled(x), z)
assert "{NEW}" in opforge.kernel_variants(), opforge.kernel_variants()
shims = opforge.aoti_config()["aot_inductor.custom_ops_to_c_shims"]
decls = " ".join(d for v in shims.values() for d in v)
assert '__asm__("opforge_aoti_cpu_{NEW}")' in decls and '__asm__("opforge_aoti_cpu_{NEW}_backward")' in decls
assert "{NEW}" in references.REFERENCES and "{NEW}" in opforge.__all__
print("ok")
"""


def test_the_library_and_the_python_layer_find_the_new_op(tree):
    assert run(tree, "-c", CHECK).strip().endswith("ok")


def test_opforge_check_passes_on_the_new_op(tree):
    run(tree, "-m", "opforge", "check", NEW)


def test_the_new_ops_c_test_builds_and_passes(tree):
    dest, env = tree
    proc = subprocess.run(["make", f"build/ctest/test_{NEW}"], cwd=dest, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    test = subprocess.run([os.path.join(dest, "build", "ctest", f"test_{NEW}")], cwd=dest, env=env,
                          capture_output=True, text=True, timeout=600)
    assert test.returncode == 0 and " 0 failures" in test.stdout, test.stdout[-2000:] + test.stderr[-2000:]


def test_the_new_ops_cuda_kernels_are_built_tested_and_registered(tree):
    """Its CUDA kernels' C test (on the CPU, over the emulation) passes through the Makefile's wildcard, and,
    where nvcc built the CUDA library, that library registers the new op's CUDA kernels."""
    dest, env = tree
    proc = subprocess.run(["make", f"build/ctest-cuda/test_{NEW}"], cwd=dest, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    test = subprocess.run([os.path.join(dest, "build", "ctest-cuda", f"test_{NEW}")], capture_output=True, text=True,
                          timeout=600)
    assert test.returncode == 0 and " 0 failures" in test.stdout, test.stdout[-2000:] + test.stderr[-2000:]
    if not os.path.exists(os.path.join(dest, "python", "opforge", "libopforge_cuda.so")):
        pytest.skip("no nvcc here: the CUDA library was not built")
    code = ("import ctypes, torch, opforge; ctypes.CDLL(opforge.cuda_library_path()); "
            f"print(torch._C._dispatch_has_kernel_for_dispatch_key('opforge::{NEW}', 'CUDA'), "
            f"torch._C._dispatch_has_kernel_for_dispatch_key('opforge::{NEW}_backward', 'CUDA'))")
    assert run(tree, "-c", code).split() == ["True", "True"]


def test_the_new_ops_python_test_and_the_coverage_tests_pass(tree):
    """Its own test module, and the tests that fail when the library has an op no description covers."""
    run(tree, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow", f"tests/python/test_{NEW}.py")
    run(tree, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/python/test_fuzz.py",
        "tests/python/test_thread_sweep.py", "tests/python/test_export.py", "tests/python/test_training.py",
        "-k", f"every or {NEW} or matches_eager")


def test_the_fuzzer_draws_the_new_op(tree):
    out = run(tree, "tests/python/fuzz.py", "--seconds", "20", "--seed", "1", "--ops", NEW)
    assert NEW in out, out[-2000:]


def test_the_new_ops_benchmark_runs(tree):
    dest, _ = tree
    run(tree, f"benchmarks/bench_{NEW}.py", "--smoke", "--out", os.path.join(dest, "build", "bench-smoke"))
