"""The op namespace is a build parameter: the same C ops built as
torch.ops.<another namespace> register there, work, and are reached by the
Python layer through the namespace the library reports."""

import glob
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import opforge
from opforge import _build

pytestmark = pytest.mark.slow  # the full tier: rebuilds the library under another namespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMESPACE = "acme_ops_1a2b"

# run in a fresh interpreter: one process holds one library per namespace, and
# this one already holds the default build
PROBE = textwrap.dedent(f"""
    import torch
    import opforge

    assert opforge.namespace == {NAMESPACE!r}, opforge.namespace
    assert opforge.ops is torch.ops.{NAMESPACE}
    assert not hasattr(torch.ops.opforge, "linear"), "the default namespace was registered too"
    assert {{d.namespace for d in opforge.library.ops}} == {{{NAMESPACE!r}}}

    x = (torch.rand(5, 7, dtype=torch.float64) + 0.1).requires_grad_()
    y = torch.ops.{NAMESPACE}.dispersion_correction(x, 0.5)
    torch.testing.assert_close(y, x * 0.5 + x.sqrt())
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(dx, 0.5 + 0.5 / x.detach().sqrt())
    w = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    dx, dw = torch.autograd.grad(opforge.linear(x, w, None, "gelu").sum(), (x, w))
    want = torch.autograd.grad(torch.nn.functional.gelu(x @ w.t()).sum(), (x, w))
    torch.testing.assert_close((dx, dw), want)
    try:
        opforge.matmul(torch.randn(3, 5), torch.randn(6, 2))
    except RuntimeError as e:
        assert str(e).startswith("[{NAMESPACE}::matmul] argument 'b'"), str(e)
    else:
        raise AssertionError("a bad matmul passed")
    print("ok")
""")


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """The opforge package with its library built under NAMESPACE."""
    dest = tmp_path_factory.mktemp("ns") / "opforge"
    shutil.copytree(os.path.dirname(opforge.__file__), dest,
                    ignore=shutil.ignore_patterns("libopforge.so", "__pycache__"))
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", d, "*.c")) for d in ("runtime", "kernels", "torch"))
    _build.build_library([s for group in sources for s in group], str(dest / "libopforge.so"),
                         include_dirs=[os.path.join(ROOT, "csrc/include")],
                         # the checkout's object cache: only the files that read the namespace recompile
                         build_dir=os.path.join(ROOT, "build", "obj"),
                         extra_cflags=_build.namespace_flags(NAMESPACE))
    return dest.parent


def test_ops_register_and_work_under_the_namespace_built_in(package):
    env = dict(os.environ, PYTHONPATH=str(package))
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=package)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_default_namespace_is_opforge():
    assert opforge.namespace == "opforge" and _build.namespace_flags(None) == _build.namespace_flags("opforge") == []


@pytest.mark.parametrize("bad", ["acme-ops", "1ops", "ops::x", "ops ", "ɑcme"])
def test_namespace_must_be_an_identifier(bad):
    with pytest.raises(_build.BuildError, match=r"OPFORGE_NAMESPACE\) must be a Python identifier .* got"):
        _build.namespace_flags(bad)
