"""The first op, tried as a new user would: what broke on the way from
`opforge new` to `opforge bench`, each pinned by a test."""

import os
import subprocess
import sys

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


def _tutorial(tmp_path, namespace: str, edit=lambda text: text) -> str:
    """The tutorial op under another namespace (a namespace loads once per process)."""
    src = tmp_path / f"{namespace}.c"
    src.write_text(edit(open(TUTORIAL_OP).read().replace('"tutorial::', f'"{namespace}::')))
    return str(src)


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "opforge_cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_op_function_first_used_inside_compile(tmp_path, cache):
    lib = opforge.load("first_compiled", [_tutorial(tmp_path, "first_compiled")])
    assert "dispersion" in vars(lib)  # built at load, not on first lookup
    x = torch.rand(64) + 0.1
    f = torch.compile(lambda t: lib.dispersion(t, 0.8).tanh(), fullgraph=True)
    torch.testing.assert_close(f(x), ot.dispersion_correction(x, 0.8).tanh())
    with pytest.raises(AttributeError, match="has no op 'nope'"):
        lib.nope


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
