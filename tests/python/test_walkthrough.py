"""The README's "Your first op", replayed from an empty folder: its shell blocks
run as written (opforge, pytest and python are the ones under test), its C and
Python blocks must be the prepared files under examples/first_op/, which are
written into the scaffolded project where the README says. The elementwise
twin (squared_relu) takes the same steps. Slow (each project's own tests
compile its op several times): minutes, not seconds."""

import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

from opforge import scaffold

pytestmark = pytest.mark.slow  # the full tier: replays the README walk-throughs in a shell

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "first_op")


def _section(heading: str = "## Your first op") -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index(heading)
    return text[start:text.index("\n## ", start + 1)]


def _blocks(section: str) -> list[tuple[str, str]]:
    """(language, text) of each fenced block, in order."""
    return [(lang, body) for lang, body in re.findall(r"```(\w*)\n(.*?)```", section, re.S)]


@pytest.fixture
def shell(tmp_path):
    """Runs a README shell block with bash: `opforge`, `pytest` and `python` are this checkout's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python_path = os.pathsep.join(p for p in [os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH")] if p)
    shims = {"opforge": f'exec "{sys.executable}" -m opforge_cli "$@"',
             "pytest": f'exec "{sys.executable}" -m pytest -p no:cacheprovider "$@"',
             "python": f'exec "{sys.executable}" "$@"'}
    for name, line in shims.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{line}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=python_path,
               OPFORGE_CACHE_DIR=str(tmp_path / "cache"))

    def run(script: str, cwd, **extra):
        r = subprocess.run(["bash", "-e", "-x", "-c", script], cwd=cwd, env=dict(env, **extra), capture_output=True,
                           text=True, timeout=1800)
        assert r.returncode == 0, f"{script}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"
        return r

    run.env = env
    return run


def _implement(project, name: str) -> None:
    """What the walk-through's step 1 asks: the prepared kernels between the markers, the reference."""
    src = os.path.join(EXAMPLES, name)
    for prepared, target in (("kernels.c", f"{name}.c"), ("kernels_avx2.c", f"{name}_avx2.c")):
        path = project / target
        path.write_text(scaffold.splice(path.read_text(), open(os.path.join(src, prepared)).read()))
    shutil.copy(os.path.join(src, "reference.py"), project / "reference.py")


def test_readme_blocks_are_the_prepared_files():
    blocks = _blocks(_section())
    c_blocks = [body for lang, body in blocks if lang == "c"]
    src = os.path.join(EXAMPLES, "rowwise_dot")
    assert [b.strip() for b in c_blocks] == [open(os.path.join(src, f)).read().strip()
                                             for f in ("kernels.c", "kernels_avx2.c")]
    python_blocks = [body for lang, body in blocks if lang == "python"]
    assert python_blocks[0].strip() == open(os.path.join(src, "reference.py")).read().strip()


def test_readme_walkthrough_rowwise_dot(tmp_path, shell):
    blocks = _blocks(_section())
    sh = [body for lang, body in blocks if lang == "sh"]
    usage = [body for lang, body in blocks if lang == "python"][1]
    assert sh[0].startswith("opforge new rowwise_dot --inputs a,b --reduce last\ncd rowwise_dot\n")
    shell(sh[0], cwd=tmp_path)  # scaffold, and its generated tests pass as generated
    project = tmp_path / "rowwise_dot"
    _implement(project, "rowwise_dot")
    out = shell(sh[1], cwd=project)  # the implemented op's tests
    assert " passed" in out.stdout and "failed" not in out.stdout
    out = shell(sh[2], cwd=project)  # check, bench --smoke, the bench script, info --load
    assert "opforge check rowwise_dot::rowwise_dot: PASS" in out.stdout
    assert "must be float32, bfloat16 or float16, got float64" in out.stdout  # the float64 row: unsupported, named
    assert "fwdbwd_vs_compile" in out.stdout
    assert "rowwise_dot(Tensor a, Tensor b) -> Tensor" in out.stdout and "shape [a[:-1]]" in out.stdout
    assert (project / "results" / "bench_rowwise_dot.md").exists()
    (project / "use.py").write_text(usage)
    out = shell("python use.py", cwd=project, OPFORGE_LOG_LEVEL="info")
    variant = "avx2" if "avx2" in __import__("opforge").supported_isas() else "ref"
    for op in ("rowwise_dot::rowwise_dot ", "rowwise_dot::rowwise_dot_backward "):
        assert re.search(re.escape(op) + rf".* isa={variant} kernels=rowwise_dot:{variant} threads=", out.stderr), \
            out.stderr


def test_elementwise_walkthrough_squared_relu(tmp_path, shell):
    shell("opforge new squared_relu", cwd=tmp_path)  # its tests as generated: test_toolkit
    project = tmp_path / "squared_relu"
    _implement(project, "squared_relu")
    load = "--load squared_relu.c squared_relu_avx2.c --reference reference.py:squared_relu"
    out = shell(f"pytest -q && opforge check squared_relu::squared_relu {load} && "
                f"opforge bench squared_relu::squared_relu {load} --smoke --sizes 4096", cwd=project)
    assert "opforge check squared_relu::squared_relu: PASS" in out.stdout and "fwd_vs_eager" in out.stdout
    (project / "use.py").write_text(
        "import torch\n"
        "import ops\n"
        "x = torch.randn(33, 17, requires_grad=True)\n"
        "f = torch.compile(lambda t: ops.squared_relu(t) * 3, fullgraph=True)  # first use inside compile\n"
        "f(x).sum().backward()\n"
        "torch.testing.assert_close(x.grad, 6 * torch.relu(x.detach()))\n"
        "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "    y = ops.squared_relu(x)\n"
        "assert y.dtype == torch.bfloat16\n"
        "torch.testing.assert_close(y.float(), torch.relu(x.detach().bfloat16().float()) ** 2, rtol=8e-3, atol=1e-3)\n")
    shell("python use.py", cwd=project)


# ---- "Your second op": a schema's op (causal_conv1d) -------------------------------------------------------

CAUSAL = os.path.join(ROOT, "examples", "causal_conv1d")


def test_second_walkthrough_blocks_are_the_prepared_files():
    blocks = _blocks(_section("## Your second op"))
    c_blocks = [body for lang, body in blocks if lang == "c"]
    assert c_blocks[0].strip() in open(os.path.join(CAUSAL, "kernels.c")).read()  # the float pair, verbatim
    python_blocks = [body for lang, body in blocks if lang == "python"]
    assert python_blocks[0].strip() == open(os.path.join(CAUSAL, "reference.py")).read().strip()


def test_readme_walkthrough_causal_conv1d(tmp_path, shell):
    sh = [body for lang, body in _blocks(_section("## Your second op")) if lang == "sh"]
    assert sh[0].startswith('opforge new "causal_conv1d(Tensor x, Tensor weight, Tensor? bias=None, str activation=')
    shell(sh[0], cwd=tmp_path)  # scaffold from the schema, and its generated tests pass as generated
    project = tmp_path / "causal_conv1d"
    for prepared, target in (("kernels.c", "causal_conv1d.c"), ("kernels_avx2.c", "causal_conv1d_avx2.c"),
                             ("kernels_avx512.c", "causal_conv1d_avx512.c")):
        path = project / target
        path.write_text(scaffold.splice(path.read_text(), open(os.path.join(CAUSAL, prepared)).read()))
    shutil.copy(os.path.join(CAUSAL, "reference.py"), project / "reference.py")
    out = shell(sh[1], cwd=project)  # the op's tests, check, the bench script
    assert " passed" in out.stdout and "failed" not in out.stdout
    assert "opforge check causal_conv1d::causal_conv1d: PASS" in out.stdout
    assert "activation=silu: PASS" in out.stdout and "activation=none: PASS" in out.stdout
    assert "fwdbwd_vs_compile" in out.stdout
    # the stride-0 gradient of y.sum().backward(): copied to stride 1, the vector variant runs it (the log says so)
    (project / "use.py").write_text(
        "import torch, ops\n"
        "x = torch.randn(2, 8, 64, requires_grad=True)\n"
        "ops.causal_conv1d(x, torch.randn(8, 4), torch.randn(8), 'silu').sum().backward()\n")
    out = shell("python use.py", cwd=project, OPFORGE_LOG_LEVEL="info")
    isas = __import__("opforge").supported_isas()  # the op's widest variant the CPU runs (amx runs avx512's)
    variant = "avx512" if "avx512" in isas else "avx2" if "avx2" in isas else None
    if variant:
        assert re.search(rf"causal_conv1d::causal_conv1d_backward .* isa={variant} kernels=causal_conv1d:{variant} ",
                         out.stderr), out.stderr
