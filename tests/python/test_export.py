"""torch.export and AOTInductor with opforge ops.

One small model runs every forward op: each op's test module gives its part in its EXPORT table
(tests/python/discover.py), op -> make(g, hidden, vocab, max_len) -> (tensors, fn): the part's tensors
(a dict, the model's buffers, made from the generator g) and fn(x, target, **tensors) -> a tuple of
outputs, for x (B, N, hidden) float32 and target (B, N) int64 class indices in [0, vocab), B <= 8,
2 <= N <= max_len. A test fails when the library has an op no part covers. The model is
exported once, compiled once with opforge's C shims and once without (two
AOTInductor compiles, about a minute each on a 2-core machine), and each
package is loaded and run in a fresh Python process.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import discover
import opforge
from opforge.aoti import c_parameters

pytestmark = pytest.mark.slow  # the full tier: AOTInductor compiles C++ (tens of seconds)

HIDDEN, VOCAB, MAX_LEN = 16, 16, 64
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Part(torch.nn.Module):
    """One op's part of the model (EXPORT[op] in its test module): its tensors as buffers, and its call."""

    def __init__(self, make, g: torch.Generator):
        super().__init__()
        tensors, self.fn = make(g, HIDDEN, VOCAB, MAX_LEN)
        for name, t in tensors.items():
            self.register_buffer(name, t)

    def forward(self, x, target):
        return tuple(self.fn(x, target, **dict(self.named_buffers())))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.parts = torch.nn.ModuleDict({op: Part(make, g) for op, make in discover.entries("EXPORT").items()})

    def forward(self, x, target):
        return tuple(out for part in self.parts.values() for out in part(x, target))


def test_the_model_covers_every_forward_op():
    msg = discover.coverage("EXPORT", discover.entries("EXPORT"))
    assert msg is None, msg


def inputs(b=2, n=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, n, HIDDEN, generator=g), torch.randint(0, VOCAB, (b, n), generator=g)


def dynamic_shapes():
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=MAX_LEN)
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
    for op in discover.forward_ops():
        assert f"{ns}.{op}.default" in targets, (op, sorted(targets))


@pytest.mark.parametrize("shape", [(2, 5), (1, 2), (3, 17)])
def test_exported_program_matches_eager(model, exported, shape):
    args = inputs(*shape, seed=shape[1])
    with torch.no_grad():
        assert_close_all(exported.module()(*args), model(*args))


def test_export_refuses_what_eager_refuses(model):
    """The fake kernels run the C checks on meta tensors: a bad shape fails at export, with the op's message.
    x is one feature wider than the parts' parameters: each part whose op refuses that in eager (with its own
    message, not torch's) is refused so at export too."""
    x, target = inputs()
    x = torch.cat([x, x[..., :1]], -1)
    refused = []
    for op, part in model.parts.items():
        try:
            with torch.no_grad():
                part(x, target)
            continue
        except Exception as e:  # noqa: BLE001
            message = str(e).splitlines()[0] if str(e) else ""
            if not message.startswith(f"[{opforge.namespace}::{op}] argument"):
                continue  # torch's own check came first (a projection, a reshape)
        with pytest.raises(Exception, match=re.escape(message)):
            torch.export.export(part, (x, target))
        refused.append(op)
    assert refused, "no part's op refused x one feature wider than its parameters"


def test_exported_program_saved_and_loaded(model, exported, tmp_path):
    path = tmp_path / "model.pt2"
    torch.export.save(exported, path)
    args = inputs(2, 7)
    with torch.no_grad():
        assert_close_all(torch.export.load(path).module()(*args), model(*args))


def test_torch_is_pointed_at_opforges_python_module():
    """torch_library_set_python_module: torch knows which module registers the fake kernels."""
    for op in discover.forward_ops():
        stub = torch._C._dispatch_pystub(f"{opforge.namespace}::{op}", "")
        assert stub is not None and stub[0] == "opforge._lib", (op, stub)


LOAD_SAVED = r"""
import json, sys, torch
path, data, out, library = sys.argv[1:5]
torch.ops.load_library(library)
program = torch.export.load(path).module()
with torch.no_grad():
    torch.save([list(program(*args)) for args in torch.load(data)], out)
print(json.dumps({"opforge_imported": "opforge" in sys.modules}))
"""


def test_saved_program_runs_in_a_process_that_only_loads_the_library(model, exported, tmp_path):
    """torch.export.load needs the ops registered, not opforge's Python: loading libopforge.so does it."""
    path, data, out = tmp_path / "model.pt2", tmp_path / "in.pt", tmp_path / "out.pt"
    torch.export.save(exported, path)
    cases = [inputs(2, 7, seed=3), inputs(3, 4, seed=4)]
    torch.save(cases, data)
    proc = subprocess.run([sys.executable, "-c", LOAD_SAVED, str(path), str(data), str(out), opforge.library_path()],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"opforge_imported": False}
    with torch.no_grad():
        for outs, args in zip(torch.load(out), cases):
            assert_close_all(outs, model(*args))


def test_loading_a_saved_program_without_opforge_says_what_to_import(exported, tmp_path):
    """An ExportedProgram names its ops; nothing loads libopforge.so in a process that only calls
    torch.export.load, so the ops are unknown there: the program cannot load without `import opforge`
    or torch.ops.load_library on the library (the AOTInductor package with shims needs neither, see
    below)."""
    path = tmp_path / "model.pt2"
    torch.export.save(exported, path)
    code = f"import torch\ntorch.export.load({str(path)!r})\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    # torch's message names an op, hence the module: "failed to resolve torch.ops.opforge.rms_norm.default
    # ... Please import the custom op to register it before deserializing"
    named = re.search(rf"failed to resolve torch\.ops\.{opforge.namespace}\.(\w+)\.default", proc.stderr)
    assert named and named[1] in discover.forward_ops(), proc.stderr[-2000:]
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
    op = discover.forward_ops()[0]
    monkeypatch.setattr(aoti, "_shims", lambda lib: {**real(lib), op: ("AtenTensorHandle x, double nonsense", 1)})
    with pytest.raises(RuntimeError, match=rf"{op}\] its C shim takes .*update OPF_AOTI_OPS"):
        aoti.aoti_config()


# ---- AOTInductor ----------------------------------------------------------------------------------

# how the fresh process gets the ops: "import" (import opforge), "load" (torch.ops.load_library on
# libopforge.so alone, which registers the schemas and CPU kernels as the library loads) or "none"
RUN = r"""
import json, sys, torch
package, data, out, how, library = sys.argv[1:6]
if how == "import":
    import opforge
elif how == "load":
    torch.ops.load_library(library)
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


def run_fresh(package, cases, tmp_path, how):
    """Loads the package in a new Python process and runs it on each case, then on the first case
    with a target out of range: (outputs per case, report with the error message)."""
    data, out = tmp_path / "in.pt", tmp_path / "out.pt"
    x, target = cases[0]
    bad = target.clone()
    bad[0, 0] = VOCAB + 3
    torch.save([cases, (x, bad)], data)
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run([sys.executable, "-c", RUN, str(package), str(data), str(out), how, opforge.library_path()],
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
    for op in discover.forward_ops():
        assert f"AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_{op}(" in src, op
        assert f'__asm__("{opforge.namespace}_aoti_cpu_{op}")' in src, op
    assert "aoti_torch_proxy_executor_call_function(" not in src


def test_compiled_code_without_shims_uses_the_proxy_executor(proxy_package):
    src = wrapper_source(proxy_package)
    for op in discover.forward_ops():
        assert f"aoti_torch_cpu_{op}(" not in src, op
    assert "aoti_torch_proxy_executor_call_function(" in src


def test_shim_package_runs_in_a_fresh_process_without_opforge(model, shim_package, tmp_path):
    """The compiled model calls the C directly: the fresh process never imports opforge."""
    cases = [inputs(2, 5, seed=7), inputs(3, 9, seed=8), inputs(1, 2, seed=9)]
    got, report = run_fresh(shim_package, cases, tmp_path, "none")
    assert report["opforge_imported"] is False
    with torch.no_grad():
        for outs, args in zip(got, cases):
            assert_close_all(outs, model(*args))
    # an op error inside the compiled model: a RuntimeError carrying the op's message, not a crash
    assert report["error"] and re.search(rf"{opforge.namespace}::\w+\] argument 'target' must hold class indices",
                                         report["error"]), report["error"]


@pytest.mark.parametrize("how", ["load", "import"])
def test_proxy_package_runs_in_a_fresh_process_that_loads_the_library(model, proxy_package, tmp_path, how):
    """Without the shims the package calls the ops through the dispatcher: torch.ops.load_library on
    libopforge.so is enough (it registers the ops as it loads, as a C++ extension does), and so is
    import opforge."""
    cases = [inputs(2, 6, seed=10), inputs(4, 3, seed=11)]
    got, report = run_fresh(proxy_package, cases, tmp_path, how)
    assert report["opforge_imported"] is (how == "import")
    with torch.no_grad():
        for outs, args in zip(got, cases):
            assert_close_all(outs, model(*args))
    assert report["error"] and "argument 'target' must hold class indices" in report["error"]


def test_shim_and_proxy_packages_agree_in_process(shim_package, proxy_package):
    args = inputs(2, 11, seed=9)
    shim, proxy = torch._inductor.aoti_load_package(shim_package), torch._inductor.aoti_load_package(proxy_package)
    for a, b in zip(shim(*args), proxy(*args)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
