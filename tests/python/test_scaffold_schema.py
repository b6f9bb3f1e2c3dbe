"""`opforge new` from a schema: the argument kinds it unpacks, what it refuses, and the user report's
observations it answers (the scaffold did not fit a non-elementwise op; 16-bit inputs converted whole;
a bfloat16 x beside a float32 weight refused; no float64, no AVX-512 variant, no opf_parallel_for
example outside the elementwise driver). The generated projects' own tests run in the slow tier (and
the README's second walk-through, tests/python/test_walkthrough.py)."""

import os
import subprocess
import sys

import pytest
import torch

import opforge
from opforge import scaffold_schema as ss
from test_toolkit import cache  # noqa: F401  (a fixture: a build cache of the test's own)

CAUSAL = "causal_conv1d(Tensor x, Tensor weight, Tensor? bias=None, str activation='none') -> Tensor"
CAUSAL_OPTS = dict(enums=["activation=none,silu"], dims=["x=B,D,L", "weight=D,W", "bias=D"])


def _project(tmp_path, schema, **opts):
    sig = ss.SchemaSig.parse(schema, **opts)
    return sig, ss.new(sig, str(tmp_path))


def _load(tmp_path, schema, **opts):
    sig, dest = _project(tmp_path, schema, **opts)
    srcs = [os.path.join(dest, f) for f in (f"{sig.name}.c", f"{sig.name}_avx2.c", f"{sig.name}_avx512.c")]
    sys.path.insert(0, dest)
    try:
        import importlib

        reference = importlib.import_module("reference")
        ref = getattr(reference, sig.name)
        del sys.modules["reference"]
    finally:
        sys.path.remove(dest)
    return opforge.load(sig.name, srcs), ref


@pytest.mark.parametrize("schema, opts, why", [
    ("f(Tensor x, str mode) -> Tensor", {}, "str argument 'mode' needs its values: --enum mode="),
    ("f(Tensor x, str mode='c') -> Tensor", dict(enums=["mode=a,b"]), "the default of 'mode' .* is not one of"),
    ("f(Tensor x) -> Tensor", dict(enums=["mode=a,b"]), "--enum names no str argument of the schema: mode"),
    ("f(Tensor? x) -> Tensor", {}, "needs a Tensor argument \\(not Tensor\\?\\) before any Tensor\\?"),
    ("f(Tensor x, Tensor[] more) -> Tensor", {}, "argument 'more': the scaffold handles .*got List\\[Tensor\\]"),
    ("f(Tensor x) -> (Tensor, Tensor)", {}, "return one Tensor"),
    ("f(Tensor x) -> Tensor", dict(shape="[x[0]]"), "--shape takes like:x .* or \\[x\\[:-1\\]\\]"),
    ("f(Tensor x, Tensor w) -> Tensor", dict(backward="w"), "--backward must include the main input 'x'"),
    ("f(Tensor x, Tensor w) -> Tensor", dict(backward="x,v"), "--backward names 'v', which is not a tensor"),
    ("f(Tensor x) -> Tensor", dict(dims=["y=A"]), "--dims names 'y', which is not a tensor argument"),
    ("f(Tensor x, float alpha) -> Tensor", dict(dims=["x=alpha"]), "--dims name 'alpha' clashes"),
    ("f(Tensor w, Tensor dw) -> Tensor", {}, "names 'w''s gradient 'dw'"),
    ("f(Tensor x, int N) -> Tensor", {}, "'N' cannot name an argument here"),
    ("f(Tensor x, int n) -> Tensor", {}, "'n' cannot name an argument here: the generated C uses it \\(reserved: "),
    ("f(Tensor(a!) x) -> Tensor", {}, "argument 'x': .*read-only and positional, got an alias annotation"),
    ("f(Tensor x, *, float alpha) -> Tensor", {}, "argument 'alpha': .*got a keyword-only one"),
    ("f(Tensor x -> Tensor", {}, "cannot parse the schema"),
])
def test_bad_schemas_are_refused_with_a_reason(schema, opts, why):
    with pytest.raises(SystemExit, match=why):
        ss.SchemaSig.parse(schema, **opts)


@pytest.mark.usefixtures("cache")
def test_every_argument_kind_reaches_c(tmp_path):
    # tensors, optional tensors, float, float?, int, int?, int[], bool and an enum: the placeholder multiplies
    # x by each numeric scalar, (1 + length) per list, -1 per true bool and (1 + index) per enum value, and
    # adds the parameters' elements
    schema = ("kinds(Tensor x, Tensor w, Tensor? b=None, float alpha=0.5, float? beta=None, int reps=2, "
              "int? extra=None, int[] dims=[1, 2], bool neg=False, str mode='a') -> Tensor")
    lib, ref = _load(tmp_path, schema, enums=["mode=a,b,c"])
    x, w, b = torch.randn(4, 9), torch.randn(3), torch.randn(5)
    for args in [(x, w, b, 0.5, None, 2, None, [1, 2], False, "a"), (x, w, None, 1.5, 2.0, 3, 5, [], True, "c")]:
        torch.testing.assert_close(torch.ops.kinds.kinds(*args), ref(*args))
    s = 1.5 * 2.0 * 3 * 5 * 4 * -1.0 * 3  # alpha, beta, reps, extra, dims (3 values), neg, mode 'c'
    torch.testing.assert_close(torch.ops.kinds.kinds(x, w, None, 1.5, 2.0, 3, 5, [7, 8, 9], True, "c"),
                               s * x + w[torch.arange(4) % 3][:, None])
    with pytest.raises(RuntimeError, match=r"\[kinds::kinds\] argument 'mode' must be one of 'a', 'b', 'c', got 'd'"):
        torch.ops.kinds.kinds(x, w, None, 0.5, None, 2, None, [], False, "d")
    with pytest.raises(RuntimeError, match=r"\[kinds::kinds\] argument 'dims' takes at most 16 values, got 17"):
        torch.ops.kinds.kinds(x, w, None, 0.5, None, 2, None, list(range(17)), False, "a")


@pytest.mark.usefixtures("cache")
def test_16bit_rows_are_converted_in_per_task_buffers_not_whole(tmp_path):
    # the report: whole-tensor float32 copies gave 2.5x eager's peak memory in bfloat16. Now the op
    # allocates its output and per-task row buffers: far less than a float32 copy of x
    lib, _ = _load(tmp_path, CAUSAL.replace("causal_conv1d", "rows16"), **CAUSAL_OPTS)
    x, w = torch.randn(16, 64, 1024, dtype=torch.bfloat16), torch.randn(64, 4, dtype=torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        y = torch.ops.rows16.rows16(x, w, None, "silu")
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    output = y.numel() * y.element_size()
    assert allocated - output < x.numel() * 4 // 8, (allocated, output)  # a float32 copy of x would be 4 * numel


@pytest.mark.usefixtures("cache")
def test_a_bfloat16_x_takes_a_float32_weight(tmp_path):
    lib, ref = _load(tmp_path, CAUSAL.replace("causal_conv1d", "mixed"), **CAUSAL_OPTS)
    x = torch.randn(2, 8, 33, dtype=torch.bfloat16, requires_grad=True)
    w, b = torch.randn(8, 4, requires_grad=True), torch.randn(8, dtype=torch.float64, requires_grad=True)
    y = torch.ops.mixed.mixed(x, w, b, "none")
    assert y.dtype == torch.bfloat16
    want = ref(x.detach().double(), w.detach().double(), b.detach(), "none")
    torch.testing.assert_close(y.double(), want, atol=2e-2, rtol=1.6e-2)
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32 and b.grad.dtype == torch.float64


@pytest.mark.usefixtures("cache")
def test_float64_runs_in_double_and_passes_gradcheck(tmp_path):
    lib, ref = _load(tmp_path, CAUSAL.replace("causal_conv1d", "dbl"), **CAUSAL_OPTS)
    x, w, b = (torch.randn(s, dtype=torch.float64, requires_grad=True) for s in [(2, 3, 7), (3, 2), (3,)])
    assert torch.autograd.gradcheck(lambda *t: torch.ops.dbl.dbl(*t, "silu"), (x, w, b))
    torch.testing.assert_close(torch.ops.dbl.dbl(x, w, None, "silu"), ref(x, w, None, "silu"), rtol=1e-12, atol=1e-12)


def test_generated_c_has_every_piece_the_report_missed(tmp_path):
    sig, dest = _project(tmp_path, CAUSAL, **CAUSAL_OPTS)
    c = open(os.path.join(dest, "causal_conv1d.c")).read()
    assert 'opf_arg_enum(OP, "activation", stack[3], ACTIVATION_VALUES)' in c
    assert 'opf_arg_optional_tensor(stack[2])' in c
    assert 'opf_check_dims(op, "x", x, 3, "(B, D, L)")' in c
    assert 'opf_check_size(op, "weight", weight, 0, "x", x, 1)' in c
    assert "opf_parallel_for(0, tasks, 1, fwd_tasks, &j)" in c and "causal_conv1d_fwd64" in c
    assert '.shape = "like:x;[weight[:]] dtype=weight;[bias[:]] dtype=bias if bias"' in c
    assert '.enums = "activation: " ACTIVATION_VALUES ""' in c
    assert os.path.exists(os.path.join(dest, "causal_conv1d_avx512.c"))
    assert "opf_variant_fallback(&causal_conv1d_variants" in open(os.path.join(dest, "causal_conv1d_avx2.c")).read()
    h = open(os.path.join(dest, "causal_conv1d.h")).read()
    assert "x[b, d, :] (length L) is row b * D + d" in h and "int64_t B, D, L, W;" in h


def test_cli_takes_a_schema_and_refuses_flags_of_the_other_kind(tmp_path):
    cli = [sys.executable, "-m", "opforge_cli", "new"]
    r = subprocess.run(cli + [CAUSAL, "--enum", "activation=none,silu", "--dims", "x=B,D,L", "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "gradients of x, weight, bias" in r.stdout and (tmp_path / "causal_conv1d" / "test_causal_conv1d.py").exists()
    r = subprocess.run(cli + [CAUSAL, "--inputs", "a,b", "--dir", str(tmp_path / "other")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "--inputs go with a NAME, not a schema" in r.stderr
    r = subprocess.run(cli + ["plain", "--enum", "a=b", "--dir", str(tmp_path / "other")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "--enum go with a schema" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("schema, opts", [
    ("rowsum(Tensor x, Tensor w, bool neg) -> Tensor", dict(shape="[x[:-1]]")),
    ("scaled(Tensor x, Tensor? w=None, float alpha=0.5, bool neg=False, float? beta=None, int reps=2) -> Tensor", {}),
    ("partial(Tensor x, Tensor w, Tensor? b=None) -> Tensor", dict(backward="x,b")),
    ("nograd(Tensor x, Tensor? w=None, float alpha=2.0) -> Tensor", dict(backward="none")),
], ids=["reduce", "scalars", "some-grads", "no-backward"])
def test_generated_projects_pass_their_own_tests(tmp_path, schema, opts):
    sig, dest = _project(tmp_path, schema, **opts)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "python"), os.environ.get("PYTHONPATH", "")]),
               OPFORGE_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=dest, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.mark.parametrize("name", ["torch", "ops", "reference", "n", "pytest"])
def test_a_name_the_project_uses_is_refused(tmp_path, name):
    """NAME may not be a name the generated project uses itself (the op's name would shadow a module the
    tests import, or a local of the kernels): refused before anything is written, by both scaffolds."""
    from opforge import scaffold

    for make in (lambda: ss.new(ss.SchemaSig.parse(f"{name}(Tensor x) -> Tensor"), str(tmp_path)),
                 lambda: scaffold.new(scaffold.Signature.parse(name, None, None, None), str(tmp_path))):
        with pytest.raises(SystemExit, match=f"NAME '{name}' is a name the generated project uses itself"):
            make()
    assert not os.listdir(tmp_path)
