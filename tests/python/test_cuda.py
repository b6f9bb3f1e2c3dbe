"""The CUDA backend: libopforge_cuda.so, its symbols and registrations (on every machine), and every op
with a CUDA kernel run on the GPU (where there is one; elsewhere those tests skip, saying why).

On the GPU the ops meet the same cases as on the CPU: each op's own fuzz draws and float64 references
(tests/python/test_<stem>.py's FUZZ), run through device_mirror.py, which sends the op calls to the GPU
with the inputs' exact layouts, forward and backward. The calls a fuzz case makes are then replayed for
what a GPU user expects of an op: torch.library.opcheck, torch.compile(fullgraph=True), capture in a
CUDA graph, a non-default stream, mixed-device arguments refused by name, autocast's policy for CUDA.
No op is named here: the library's tables say which ops there are, the CUDA library which have kernels.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import device_mirror
import fuzz
import opforge
from opforge import _build

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STATUS = opforge.cuda_status()
GPU = pytest.mark.skipif(not STATUS["loaded"], reason=f"no CUDA kernels in this process: {STATUS['reason']}")
PY = sys.executable


def _lib_path() -> str:
    path = opforge.cuda_library_path()
    if path is None:
        if _build.nvcc() is not None:
            pytest.fail("nvcc is here but python/opforge/libopforge_cuda.so was not built: `make cuda`")
        pytest.skip("no nvcc on this machine: the CUDA library is not built")
    return path


# ---- on every machine: the library itself ----------------------------------------------------------


def _shim_names(macro: str) -> set[str]:
    with open(os.path.join(ROOT, "csrc", "include", "opforge", "shim.h")) as f:
        text = f.read()
    body = re.search(rf"#define {macro}\(X\)(.*?)\n\n", text, re.S).group(1)
    return set(re.findall(r"X\([^,]+,\s*(\w+)\s*,", body))


def test_cuda_library_links_only_stable_abi_symbols():
    """Every torch symbol the CUDA library needs is in the stable ABI subset shim.h declares (the torch
    2.10 functions, checked against torch's headers by make abi-check); no libcudart, libstdc++ or
    libtorch_cuda is needed at load (the runtime is linked in; libtorch_cuda is looked up by name);
    every opf_ symbol comes from libopforge.so."""
    path = _lib_path()
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) on this machine")
    undefined = subprocess.run([nm, "-D", "--undefined-only", path], capture_output=True, text=True,
                               check=True).stdout.split()
    names = {s.split("@")[0] for s in undefined if s not in ("U", "w")}
    allowed = _shim_names("OPF_SHIM_FUNCTIONS") | _shim_names("OPF_SHIM_CUDA_FUNCTIONS")
    torch_syms = {n for n in names if n.startswith(("aoti_torch_", "torch_"))}
    assert torch_syms <= allowed, f"torch symbols outside opforge/shim.h's stable subset: {sorted(torch_syms - allowed)}"
    assert "aoti_torch_get_current_cuda_stream" not in names, "libtorch_cuda's symbol must be looked up, not linked"
    runtime = subprocess.run([nm, "-D", "--defined-only", opforge.library_path()], capture_output=True, text=True,
                             check=True).stdout.split()
    ours = {n for n in names if n.startswith("opf")}
    assert ours <= set(runtime), f"opf symbols libopforge.so does not define: {sorted(ours - set(runtime))}"
    needed = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
    for lib in ("libcudart", "libstdc++", "libtorch_cuda", "libc10_cuda"):
        assert lib not in needed, f"{path} needs {lib} at load:\n{needed}"


_REGISTRATION_SCRIPT = r"""
import ctypes, json, torch, opforge
dll = ctypes.CDLL(opforge.cuda_library_path())   # on a CPU build of torch too: registration needs no GPU
err = ctypes.create_string_buffer(1024)
rc = dll.opforge_cuda_registered(err, 1024)
dll.opforge_cuda_kernel_at.restype = ctypes.c_char_p
kernels, i = [], 0
while (n := dll.opforge_cuda_kernel_at(i)) is not None:
    kernels.append(n.decode()); i += 1
keys = {k: torch._C._dispatch_has_kernel_for_dispatch_key(f"{opforge.namespace}::{k}", "CUDA") for k in kernels}
print(json.dumps({"rc": rc, "err": err.value.decode(), "kernels": kernels, "keys": keys,
                  "ops": [d.name for d in opforge.library.ops],
                  "backward": {d.name: d.backward for d in opforge.library.ops if d.backward}}))
"""


@pytest.fixture(scope="module")
def registration():
    _lib_path()
    out = subprocess.run([PY, "-c", _REGISTRATION_SCRIPT], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cuda_library_registers_its_kernels(registration):
    """Loaded after opforge (as opforge does where there is a GPU), the library registers a CUDA kernel
    for each op it has, under the ops' own schemas; an op's backward (and its in-place variant) has one
    wherever the forward has, but for the in-place backwards kept to the CPU (CPU_ONLY_INPLACE)."""
    r = registration
    assert r["rc"] == 0, r["err"]
    assert r["kernels"], "the CUDA library registers no kernel"
    assert all(r["keys"].values()), f"CUDA kernels missing from the dispatcher: {r['keys']}"
    assert set(r["kernels"]) <= set(r["ops"])
    for fwd, bwd in r["backward"].items():
        if fwd in r["kernels"]:
            assert bwd in r["kernels"], f"{fwd} has a CUDA kernel but its backward {bwd} has none"
            if bwd + "_" in r["ops"] and bwd + "_" not in CPU_ONLY_INPLACE:
                assert bwd + "_" in r["kernels"], f"{bwd}_ (in-place backward of {fwd}) has no CUDA kernel"
    assert not set(CPU_ONLY_INPLACE) & set(r["kernels"]), "a CPU-only in-place backward has a CUDA kernel now"


# In-place backwards without a CUDA kernel: the autograd wiring calls them for CPU tensors alone (CUDA
# tensors keep the out-of-place backward: test_glu's test_backward_keeps_out_of_place_where_the_device_
# lacks_the_in_place_kernel). glu_backward_ writes the gradients over gate and up, which spares a CPU
# backward its page faults; its CUDA kernel is left until it can be run on a GPU.
CPU_ONLY_INPLACE = ("glu_backward_",)


# the list: the memory-bound ops of the first CUDA wave
FIRST_WAVE = ("dispersion_correction", "rms_norm", "add_rms_norm", "layer_norm", "glu", "rope", "softmax",
              "log_softmax", "cross_entropy")


def test_cuda_library_covers_the_first_wave(registration):
    missing = [op for op in FIRST_WAVE if op not in registration["kernels"]]
    assert not missing, f"no CUDA kernel for {missing}"


def test_device_mirror_keeps_layouts():
    """What the GPU tests rely on, checked here with the CPU as the other device: the copy keeps sizes,
    strides and storage offset, and gradients come back through it."""
    base = torch.randn(5, 8, requires_grad=True)
    views = [base[1:, ::2].t(), base[:1].expand(3, 8), base[2:4], base.new_empty(0, 3)]
    for v in views:
        w = device_mirror._ToDevice.apply(v, "cpu")
        assert (w.shape, w.stride(), w.storage_offset()) == (v.shape, v.stride(), v.storage_offset())
        assert torch.equal(w, v)
    (device_mirror._ToDevice.apply(views[0], "cpu").sum() * 2).backward()
    assert torch.equal(base.grad[1:, ::2], torch.full((4, 4), 2.0)) and float(base.grad[:, 1::2].abs().sum()) == 0


def test_fuzz_device_selection_reproduces():
    sel = fuzz.Selection(ops=("norm",), device="cuda")
    assert sel.args()[-2:] == ["--device", "cuda"]
    assert "device" not in fuzz.draw(3, 0, fuzz.Selection(ops=("norm",)))  # CPU cases are as they were
    assert fuzz.draw(3, 0, sel)["device"] == "cuda"


# ---- on the GPU ------------------------------------------------------------------------------------


def _cuda_cases() -> list[str]:
    """The fuzz case names whose ops all have CUDA kernels."""
    have = set(STATUS["ops"])
    return [name for name, op in fuzz.descriptions().items() if set(op.covers) <= have]


CASES = _cuda_cases() if STATUS["loaded"] else ["(no GPU)"]
GPU_CASES_PER_OP = int(os.environ.get("OPFORGE_GPU_CASES", "40"))


@GPU
@pytest.mark.parametrize("case", CASES)
def test_fuzz_on_cuda(case):
    """The op's own fuzz cases (shapes, layouts, options, every dtype) on the GPU, against the float64
    references and bounds the CPU kernels meet."""
    failures = []
    for i in range(GPU_CASES_PER_OP):
        c = fuzz.draw(20261204, i, fuzz.Selection(ops=(case,), isa="ref", device="cuda"))
        res = fuzz.run_case(c)
        failures += [f"case {i} ({fuzz.describe(c)}): {f}" for f in res.failures]
    assert not failures, "\n".join(failures[:10])


class _Recorder(torch.overrides.TorchFunctionMode):
    """The first call of each op of opforge's namespace with its (GPU) arguments, as the mirror made them."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.OpOverload) and func.namespace == opforge.namespace:
            self.calls.setdefault(func, (args, kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def gpu_calls():
    """{op: (args, kwargs)} on the GPU, one call per op with a CUDA kernel, from small fuzz cases."""
    calls = {}
    for case in _cuda_cases():
        for i in range(6):
            c = fuzz.draw(7, i, fuzz.Selection(ops=(case,), isa="ref", dtypes=("float32",), device="cuda"))
            gen = torch.Generator().manual_seed(c["data_seed"])
            # the recorder outside the mirror: it sees the calls the mirror makes, with GPU arguments
            with _Recorder() as rec, device_mirror.on_device("cuda"):
                fuzz.descriptions()[case].check(c, gen, fuzz.DTYPES["float32"], "float32", lambda fn: fn())
            for op, (args, kwargs) in rec.calls.items():
                detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
                if any(isinstance(a, torch.Tensor) and a.numel() for a in detached):
                    calls.setdefault(op, (detached, kwargs))
    return calls


def _ids(calls):
    return sorted(str(op) for op in calls)


@GPU
def test_gpu_calls_cover_every_cuda_op(gpu_calls):
    forward = {d.name for d in opforge.library.ops if d.name in STATUS["ops"]}
    seen = {op._opname for op in gpu_calls}
    backward = {d.backward for d in opforge.library.ops if d.backward}
    assert (forward - backward) <= seen, f"no GPU call recorded for {sorted((forward - backward) - seen)}"


def _outputs(out):
    return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]


@GPU
def test_opcheck_on_cuda(gpu_calls):
    failures = []
    for op, (args, kwargs) in gpu_calls.items():
        try:
            torch.library.opcheck(op, args, kwargs, test_utils=("test_schema", "test_faketensor",
                                                                 "test_aot_dispatch_dynamic"))
        except Exception as e:  # noqa: BLE001
            failures.append(f"{op}: {str(e).splitlines()[0]}")
    assert not failures, "\n".join(failures)


@GPU
def test_compile_fullgraph_on_cuda(gpu_calls):
    failures = []
    for op, (args, kwargs) in gpu_calls.items():
        torch._dynamo.reset()
        compiled = torch.compile(lambda *a, op=op: op(*a, **kwargs), fullgraph=True)
        got, want = _outputs(compiled(*args)), _outputs(op(*args, **kwargs))
        for g, w in zip(got, want):
            if g.shape != w.shape or g.dtype != w.dtype or not torch.allclose(g.float(), w.float(), equal_nan=True):
                failures.append(f"{op}: compiled output differs ({g.shape} {g.dtype} vs {w.shape} {w.dtype})")
    assert not failures, "\n".join(failures)


@GPU
def test_cuda_graph_capture(gpu_calls):
    """Each op captured in a CUDA graph (no synchronisation, no allocation outside torch's allocator),
    replayed after its inputs changed in place, gives what an eager call on the new inputs gives."""
    failures = []
    for op, (args, kwargs) in gpu_calls.items():
        static = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            op(*static, **kwargs)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = op(*static, **kwargs)
        except Exception as e:  # noqa: BLE001
            failures.append(f"{op}: capture failed: {str(e).splitlines()[0]}")
            continue
        for a in static:
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                a.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        want = op(*static, **kwargs)
        for g, w in zip(_outputs(out), _outputs(want)):
            if not torch.equal(g, w) and not torch.allclose(g.float(), w.float(), equal_nan=True):
                failures.append(f"{op}: replay differs from an eager call")
    assert not failures, "\n".join(failures)


@GPU
def test_mixed_devices_are_refused_by_name(gpu_calls):
    for op, (args, kwargs) in gpu_calls.items():
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        if len(tensors) < 2:
            continue
        moved = list(args)
        moved[tensors[-1]] = args[tensors[-1]].cpu()
        with pytest.raises(RuntimeError, match=rf"{op._opname}.*(device|cuda|cpu)"):
            op(*moved, **kwargs)


@GPU
def test_autocast_policy_on_cuda(gpu_calls):
    """Under torch.autocast("cuda", bfloat16), an op whose CUDA policy is float32 returns float32 outputs,
    one whose policy is the autocast dtype returns bfloat16 ones."""
    from opforge._lib import AUTOCAST_FP32, AUTOCAST_LOWER

    descs = {d.name: d for d in opforge.library.ops}
    for op, (args, kwargs) in gpu_calls.items():
        policy = descs[op._opname].autocast_on("cuda")
        if policy not in (AUTOCAST_FP32, AUTOCAST_LOWER):
            continue
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs = _outputs(op(*args, **kwargs))
        floating = [o for o in outs if o.is_floating_point() and o.numel()]
        want = torch.float32 if policy == AUTOCAST_FP32 else torch.bfloat16
        assert all(o.dtype == want for o in floating[:1]), f"{op}: {[o.dtype for o in floating]}, want {want}"


@GPU
def test_non_default_stream_is_honoured():
    """The op runs on torch's current stream: on a side stream it sees a fill queued there behind a
    long sleep (on any other stream it would read the old values)."""
    x = torch.ones(1 << 22, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        x.fill_(4.0)
        y = opforge.dispersion_correction(x, 0.5)
    side.synchronize()
    assert float(y.min()) == float(y.max()) == 4.0


@GPU
def test_other_gpu_is_refused():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU: no tensor can be on another")
    g, u = torch.randn(8, 16, device="cuda:0"), torch.randn(8, 16, device="cuda:1")
    with pytest.raises(RuntimeError, match="cuda:0"):
        opforge.swiglu(g, u)


@GPU
def test_log_names_kernel_grid_and_time():
    script = ("import torch, opforge; x = torch.rand(1000, device='cuda'); "
              "opforge.dispersion_correction(x, 0.5); torch.cuda.synchronize()")
    env = {**os.environ, "OPFORGE_LOG_LEVEL": "info"}
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    line = next((ln for ln in out.stderr.splitlines() if "dispersion_correction" in ln and "kernel=" in ln), None)
    assert line and "device=cuda:0" in line and "grid=" in line and "us (gpu)" in line, out.stderr


@GPU
def test_out_of_memory_is_a_runtime_error():
    """An output too large for the GPU's memory: a RuntimeError (torch's OutOfMemoryError) from the
    op's allocation through torch, nothing written; an empty input launches nothing."""
    x = torch.empty(0, device="cuda")
    assert opforge.dispersion_correction(x, 0.5).shape == (0,)
    free, _ = torch.cuda.mem_get_info()
    n = free // 4 + (1 << 30)
    big = torch.empty(n // 2 + 1, device="cuda").expand(2, n // 2 + 1)  # no memory of its own
    with pytest.raises((RuntimeError, torch.OutOfMemoryError), match="dispersion_correction|out of memory"):
        opforge.dispersion_correction(big, 0.5)


@GPU
def test_cuda_status_reports_the_library():
    assert STATUS["loaded"] and STATUS["ops"] and STATUS["runtime"] >= 12000
    assert ctypes.CDLL(opforge.cuda_library_path()).opforge_cuda_driver_version() > 0
