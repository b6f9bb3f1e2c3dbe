"""torch.export and AOTInductor with opforge ops.

One small model uses every forward op (FORWARD_OPS; a test keeps the list
complete as ops land). It is
exported once, compiled once with opforge's C shims and once without (two
AOTInductor compiles, about a minute each on a 2-core machine), and each
package is loaded and run in a fresh Python process.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import opforge
import opforge.functional as F
from opforge.aoti import c_parameters

pytestmark = pytest.mark.slow  # the full tier: AOTInductor compiles C++ (tens of seconds)

H, D, HIDDEN, VOCAB = 2, 8, 16, 16
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Model(torch.nn.Module):
    def __init__(self, max_len: int = 64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.norm = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN, generator=g))
        self.up = torch.nn.Parameter(torch.randn(2 * HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5)
        self.qkv = torch.nn.Parameter(torch.randn(3 * HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5)
        self.head = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5)
        self.mix = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN)
        self.ln_w = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN, generator=g))
        self.ln_b = torch.nn.Parameter(0.1 * torch.randn(HIDDEN, generator=g))
        pos = torch.arange(max_len, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, D, 2) / D)
        self.register_buffer("cos", torch.cat([pos.cos(), pos.cos()], -1))
        self.register_buffer("sin", torch.cat([pos.sin(), pos.sin()], -1))

    def forward(self, x, target):
        b, n, _ = x.shape
        h = F.rms_norm(x, self.norm)
        q, k, v = F.linear(h, self.qkv).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
        q, k = F.rope(q, k, self.cos[:n], self.sin[:n])
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, HIDDEN)
        # the last query again, as a decoding step sees it: k and v as a cache of n keys per row
        last = F.attention_decode(q[:, :, -1:], k, v, (target >= 0).sum(1))
        m, s = F.add_rms_norm(a + last.transpose(1, 2).reshape(b, 1, HIDDEN), h, self.norm)
        h = F.layer_norm(s + F.swiglu(F.linear(m, self.up, None, activation="gelu")), self.ln_w, self.ln_b)
        p = F.softmax(h)
        h = h + F.dispersion_correction(p, 0.5)  # sqrt inside: fed probabilities, not raw values
        h = h + F.matmul(h.reshape(b * n, HIDDEN), self.mix).view(b, n, HIDDEN)
        logits = F.linear(h, self.head)
        flat, t = h.reshape(-1, HIDDEN), target.reshape(-1)
        safe = t.clamp(0, VOCAB - 1)  # an out-of-range target is cross_entropy's to refuse (tests below)
        return (logits, F.log_softmax(logits), F.cross_entropy(logits.reshape(-1, VOCAB), t),
                F.linear_cross_entropy(flat, self.head, safe),
                F.linear_cross_entropy(flat, self.head, safe, reduction="none"))


FORWARD_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "linear", "matmul", "rope", "attention", "attention_decode",
               "glu", "softmax", "log_softmax", "dispersion_correction", "cross_entropy", "linear_cross_entropy",
               "linear_cross_entropy_none")


def test_the_model_covers_every_forward_op():
    backward = {n for d in opforge.library.ops if d.backward for n in (d.backward, d.backward + "_")}
    assert set(FORWARD_OPS) == {d.name for d in opforge.library.ops if d.name not in backward}


def inputs(b=2, n=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, n, HIDDEN, generator=g), torch.randint(0, VOCAB, (b, n), generator=g)


def dynamic_shapes():
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=64)
    return {"x": {0: batch, 1: seq}, "target": {0: batch, 1: seq}}


@pytest.fixture(scope="module")
def model():
    return Model().eval()


@pytest.fixture(scope="module")
def exported(model):
    with torch.no_grad():
        return torch.export.export(model, inputs(), dynamic_shapes=dynamic_shapes())


# float32 through different kernels and summation orders than eager's (inductor fuses the aten parts)
TOL = dict(rtol=1e-4, atol=1e-5)


def assert_close_all(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_export_graph_holds_the_opforge_ops(exported):
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    ns = opforge.namespace
    for op in FORWARD_OPS:
        assert f"{ns}.{op}.default" in targets, (op, sorted(targets))


@pytest.mark.parametrize("shape", [(2, 5), (1, 2), (3, 17)])
def test_exported_program_matches_eager(model, exported, shape):
    args = inputs(*shape, seed=shape[1])
    with torch.no_grad():
        assert_close_all(exported.module()(*args), model(*args))


def test_export_refuses_what_eager_refuses(model):
    """The fake kernels run the C checks on meta tensors: a bad shape fails at export, with the op's message."""
    bad = torch.nn.Module()
    bad.forward = lambda x: F.rms_norm(x, torch.ones(HIDDEN + 1))
    with pytest.raises(Exception, match=r"rms_norm\] argument 'weight' must have shape \[16\]"):
        torch.export.export(bad, (torch.randn(2, HIDDEN),))


def test_exported_program_saved_and_loaded(model, exported, tmp_path):
    path = tmp_path / "model.pt2"
    torch.export.save(exported, path)
    args = inputs(2, 7)
    with torch.no_grad():
        assert_close_all(torch.export.load(path).module()(*args), model(*args))


def test_torch_is_pointed_at_opforges_python_module():
    """torch_library_set_python_module: torch knows which module registers the fake kernels."""
    stub = torch._C._dispatch_pystub(f"{opforge.namespace}::rms_norm", "")
    assert stub is not None and stub[0] == "opforge._lib", stub


def test_loading_a_saved_program_without_opforge_says_what_to_import(exported, tmp_path):
    """An ExportedProgram names its ops; nothing loads libopforge.so in a process that only calls
    torch.export.load, so the ops are unknown there: the program cannot load without `import opforge`
    (the library registers the ops; the AOTInductor package with shims needs neither, see below)."""
    path = tmp_path / "model.pt2"
    torch.export.save(exported, path)
    code = f"import torch\ntorch.export.load({str(path)!r})\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    # torch's message names the op, hence the module: "failed to resolve torch.ops.opforge.rms_norm.default
    # ... Please import the custom op to register it before deserializing"
    assert f"failed to resolve torch.ops.{opforge.namespace}.rms_norm.default" in proc.stderr, proc.stderr[-2000:]
    assert "import the custom op" in proc.stderr, proc.stderr[-2000:]


# ---- C shim declarations --------------------------------------------------------------------------


def test_every_op_has_a_shim_matching_its_schema():
    decls = opforge.aoti_config()["aot_inductor.custom_ops_to_c_shims"]
    for desc in opforge.library.ops:
        op = getattr(getattr(torch.ops, desc.namespace), desc.name).default
        assert op in decls, f"{desc.name} has no C shim: add it to OPF_AOTI_OPS in csrc/torch/aoti.c"
        (decl,) = decls[op]
        params = c_parameters(op._schema)
        assert decl.startswith(f"AOTITorchError aoti_torch_cpu_{desc.name}("), decl
        assert decl.endswith(f'__asm__("{desc.namespace}_aoti_cpu_{desc.name}")'), decl
        assert params.replace(" ", "") in decl.replace(" ", ""), (params, decl)
        assert decl.count("AtenTensorHandle *ret") == len(op._schema.returns), decl


def test_shim_parameters_follow_inductors_types():
    schema = torch._C.parse_schema(
        "f(Tensor x, Tensor? w, float a, float? b, int c, int? d, bool e, bool? f, Tensor(a!) g) -> Tensor")
    assert c_parameters(schema).replace(" ", "") == (
        "AtenTensorHandlex,AtenTensorHandle*w,doublea,double*b,int64_tc,int64_t*d,int32_te,int32_t*f,"
        "AtenTensorHandleg")
    assert c_parameters(torch._C.parse_schema("f(Tensor x, int[] s) -> Tensor")) is None


def test_shim_drift_is_refused(monkeypatch):
    import opforge.aoti as aoti

    real = aoti._shims
    monkeypatch.setattr(aoti, "_shims", lambda lib: {**real(lib), "softmax": ("AtenTensorHandle x, double dim", 1)})
    with pytest.raises(RuntimeError, match=r"softmax\] its C shim takes .*update OPF_AOTI_OPS"):
        aoti.aoti_config()


# ---- AOTInductor ----------------------------------------------------------------------------------

RUN = r"""
import json, sys, torch
package, data, out, import_opforge = sys.argv[1:5]
if import_opforge == "1":
    import opforge
runner = torch._inductor.aoti_load_package(package)
cases, bad = torch.load(data)
torch.save([list(runner(*args)) for args in cases], out)
error = None
try:
    runner(*bad)
except RuntimeError as e:
    error = str(e)
print(json.dumps({"opforge_imported": "opforge" in sys.modules, "error": error}))
"""


def run_fresh(package, cases, tmp_path, import_opforge):
    """Loads the package in a new Python process and runs it on each case, then on the first case
    with a target out of range: (outputs per case, report with the error message)."""
    data, out = tmp_path / "in.pt", tmp_path / "out.pt"
    x, target = cases[0]
    bad = target.clone()
    bad[0, 0] = VOCAB + 3
    torch.save([cases, (x, bad)], data)
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run([sys.executable, "-c", RUN, str(package), str(data), str(out), str(int(import_opforge))],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out), json.loads(proc.stdout.strip().splitlines()[-1])


def compile_package(exported, directory, configs):
    # the wrapper unoptimised: what is timed here is not the wrapper, and it compiles faster
    configs = {**configs, "aot_inductor.compile_wrapper_opt_level": "O0"}
    return torch._inductor.aoti_compile_and_package(exported, package_path=str(directory / "model.pt2"),
                                                    inductor_configs=configs)


@pytest.fixture(scope="module")
def shim_package(exported, tmp_path_factory):
    return compile_package(exported, tmp_path_factory.mktemp("aoti_shim"), opforge.aoti_config())


@pytest.fixture(scope="module")
def proxy_package(exported, tmp_path_factory):
    return compile_package(exported, tmp_path_factory.mktemp("aoti_proxy"), {})


def wrapper_source(package) -> str:
    import zipfile

    with zipfile.ZipFile(package) as z:
        names = [n for n in z.namelist() if n.endswith(".wrapper.cpp")]
        assert names, z.namelist()
        return z.read(names[0]).decode()


def test_compiled_code_calls_the_c_shims(shim_package):
    src = wrapper_source(shim_package)
    for op in FORWARD_OPS:
        assert f"AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_{op}(" in src, op
        assert f'__asm__("{opforge.namespace}_aoti_cpu_{op}")' in src, op
    assert "aoti_torch_proxy_executor_call_function(" not in src


def test_compiled_code_without_shims_uses_the_proxy_executor(proxy_package):
    src = wrapper_source(proxy_package)
    assert "aoti_torch_cpu_rms_norm(" not in src
    assert "aoti_torch_proxy_executor_call_function(" in src


def test_shim_package_runs_in_a_fresh_process_without_opforge(model, shim_package, tmp_path):
    """The compiled model calls the C directly: the fresh process never imports opforge."""
    cases = [inputs(2, 5, seed=7), inputs(3, 9, seed=8), inputs(1, 2, seed=9)]
    got, report = run_fresh(shim_package, cases, tmp_path, import_opforge=False)
    assert report["opforge_imported"] is False
    with torch.no_grad():
        for outs, args in zip(got, cases):
            assert_close_all(outs, model(*args))
    # an op error inside the compiled model: a RuntimeError carrying the op's message, not a crash
    assert report["error"] and "cross_entropy] argument 'target' must hold class indices" in report["error"]


def test_proxy_package_runs_in_a_fresh_process_with_opforge(model, proxy_package, tmp_path):
    """Without the shims the package calls the ops through the dispatcher: the process imports opforge."""
    cases = [inputs(2, 6, seed=10), inputs(4, 3, seed=11)]
    got, report = run_fresh(proxy_package, cases, tmp_path, import_opforge=True)
    with torch.no_grad():
        for outs, args in zip(got, cases):
            assert_close_all(outs, model(*args))
    assert report["error"] and "argument 'target' must hold class indices" in report["error"]


def test_shim_and_proxy_packages_agree_in_process(shim_package, proxy_package):
    args = inputs(2, 11, seed=9)
    shim, proxy = torch._inductor.aoti_load_package(shim_package), torch._inductor.aoti_load_package(proxy_package)
    for a, b in zip(shim(*args), proxy(*args)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
