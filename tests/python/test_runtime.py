"""The runtime seen from Python: the log sink under concurrent use, and the
messages that name a dtype or a log file."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import opforge


def _run_python(code, timeout=120, **env):
    full = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                          timeout=timeout)


# ---- log sink -------------------------------------------------------------------------

# Switching the file closed the FILE another thread was writing: a segfault,
# munmap_chunk() abort or hang within a second. In a child process, so that a
# crash fails this test instead of ending the run.
_LOG_SWITCH_STRESS = """
    import sys, threading, time, torch, opforge
    a, b, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    opforge.set_log_level("info")
    stop = threading.Event()
    x = torch.rand(64, 4096)  # large enough that torch's intra-op pool runs the kernel

    def work():
        while not stop.is_set():
            opforge.dispersion_correction(x, 0.5)
            opforge.dispersion_correction(x[:3, :5], 0.5)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for path in (a, b, None):
            opforge.set_log_file(path)
    stop.set()
    for t in threads:
        t.join()
    opforge.set_log_file(a)
    opforge.dispersion_correction(x, 0.5)
    opforge.set_log_file(None)
    print("survived")
"""


def test_log_file_switch_under_concurrent_ops(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    try:
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(_LOG_SWITCH_STRESS), str(a), str(b), "2"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("switching the log file while 4 threads log hung")
    assert r.returncode == 0, f"the process died switching log files (exit status {r.returncode})"
    assert r.stdout.strip() == "survived"
    for path in (a, b):
        lines = path.read_text().splitlines()
        assert lines, f"no log line reached {path.name}"
        torn = [line for line in lines if not (line.startswith("[opforge info] opforge::dispersion_correction ")
                                               and line.endswith("us"))]
        assert not torn, f"{len(torn)} of {len(lines)} lines in {path.name} are torn, e.g. {torn[0]!r}"


def test_set_log_file_unopenable_names_reason_and_caller(tmp_path):
    path = tmp_path / "missing" / "x.log"
    with pytest.raises(RuntimeError) as e:
        opforge.set_log_file(str(path))
    msg = str(e.value)
    assert "set_log_file()" in msg and str(path) in msg and "No such file or directory" in msg, msg
    assert "OPFORGE_LOG_FILE" not in msg, msg
    opforge.dispersion_correction(torch.rand(3), 0.5)  # the sink is still usable


def test_set_log_file_on_a_directory(tmp_path):
    with pytest.raises(RuntimeError, match="set_log_file.*Is a directory"):
        opforge.set_log_file(str(tmp_path))


def test_log_file_env_unopenable_names_variable_and_reason(tmp_path):
    path = tmp_path / "missing" / "x.log"
    r = _run_python("import opforge", OPFORGE_LOG_FILE=str(path))
    assert r.returncode != 0
    assert "OPFORGE_LOG_FILE" in r.stderr and str(path) in r.stderr and "No such file or directory" in r.stderr, \
        r.stderr[-2000:]


# ---- what the log says ran -----------------------------------------------------------------

_FALLBACK = """
    import torch, opforge
    x = torch.rand(64, 4096, requires_grad=True)  # large enough that torch's intra-op pool runs the kernel
    opforge.dispersion_correction(x, 0.5).sum().backward()  # the gradient of a sum: expanded, stride 0
    opforge.rms_norm(torch.rand(8, 4).t(), None)  # hidden stride 8
"""


def test_log_names_a_fallback_and_the_isa_that_ran():
    r = _run_python(_FALLBACK, OPFORGE_LOG_LEVEL="info")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = {op: [s for s in r.stderr.splitlines() if f"::{op} " in s]
             for op in ("dispersion_correction", "dispersion_correction_backward", "rms_norm")}
    assert all(len(found) == 1 for found in lines.values()), r.stderr[-2000:]
    picked = {family: next(n for n, _, now in opforge.kernel_variants()[family] if now)
              for family in ("dispersion_correction", "norm")}
    fwd, bwd, norm = (found[0] for found in lines.values())
    assert f"kernels=dispersion_correction:{picked['dispersion_correction']} " in fwd and "->" not in fwd, fwd
    if picked["dispersion_correction"] == "ref":  # nothing to fall back from
        assert "isa=ref kernels=dispersion_correction:ref " in bwd, bwd
    else:  # the backward's vector variant handed the broadcast gradient to the reference: the line says so
        assert (f"isa=ref kernels=dispersion_correction:{picked['dispersion_correction']}->ref (stride-0 gradient) "
                in bwd), bwd
    if picked["norm"] != "ref":
        assert f"isa=ref kernels=norm:{picked['norm']}->ref (hidden stride != 1) " in norm, norm


# ---- shape checks (opf_check_dims, opf_check_size, opf_check_size_is) ----------------------------


def test_dims_message_names_op_argument_dims_and_shape():
    q = torch.randn(4, 5, 8)
    with pytest.raises(RuntimeError) as e:
        opforge.ops.attention(q, q, q, None, False, None)
    assert str(e.value).splitlines()[0] == ("[opforge::attention] argument 'q' must have 4 dims "
                                            "(batch, heads, length, head_dim), got 3: [4, 5, 8]")


def test_size_message_names_both_arguments_dims_and_shapes():
    with pytest.raises(RuntimeError) as e:
        opforge.rms_norm(torch.randn(3, 5), torch.randn(6))
    assert str(e.value).splitlines()[0] == ("[opforge::rms_norm] argument 'weight' must have size(0) == x.size(-1) = 5, "
                                            "got 6 (weight: [6], x: [3, 5])")


# No built-in op checks a size against a fixed number, and none can be given a dim its checks lack (each
# checks the dims first): a tiny op does.
_SHAPED = r"""
#include <opforge/op.h>

static void shaped_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    static const char OP[] = "shaped::shaped";
    OPF_ARG_TENSOR(x, stack, 0);
    OPF_ARG_TENSOR(freqs, stack, 1);
    opf_tensor x = opf_tensor_info(OP, "x", x_h), f = opf_tensor_info(OP, "freqs", freqs_h);
    opf_check_size_is(OP, "freqs", &f, -1, 32);
    opf_check_size(OP, "freqs", &f, -2, "x", &x, 1);
    OPF_OWNED AtenTensorHandle y_h = opf_empty_like(OP, &x);
    OPF_RETURN(stack, 0, y_h);
}

OPF_OP_TABLE({.schema = "shaped(Tensor x, Tensor freqs) -> Tensor", .cpu = shaped_cpu, .shape = "like:x"})
"""


@pytest.mark.parametrize("x, freqs, message", [
    ((4, 8), (8, 16), "argument 'freqs' must have size(-1) == 32, got 16 ([8, 16])"),
    ((4, 8), (6, 32), "argument 'freqs' must have size(-2) == x.size(1) = 8, got 6 (freqs: [6, 32], x: [4, 8])"),
    ((4, 8), (), "argument 'freqs' must have at least 1 dim for size(-1), got 0: []"),
    ((4, 8), (32,), "argument 'freqs' must have at least 2 dims for size(-2), got 1: [32]"),
    ((4,), (8, 32), "argument 'x' must have at least 2 dims for size(1), got 1: [4]"),
])
def test_size_is_and_dims_a_tensor_lacks(tmp_path, monkeypatch, x, freqs, message):
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "shaped.c").write_text(_SHAPED)
    lib = opforge.load("shaped", [str(tmp_path / "shaped.c")])
    assert lib.shaped(torch.rand(4, 8), torch.rand(8, 32)).shape == (4, 8)
    with pytest.raises(RuntimeError) as e:
        lib.shaped(torch.rand(x), torch.rand(freqs))
    assert str(e.value).splitlines()[0] == "[shaped::shaped] " + message


# ---- dtype names in messages ------------------------------------------------------------

_NAMED = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.uint16,
          torch.uint32, torch.uint64, torch.complex32, torch.complex64, torch.int16, torch.bool]
if hasattr(torch, "float8_e8m0fnu"):
    _NAMED.append(torch.float8_e8m0fnu)


@pytest.mark.parametrize("dtype", _NAMED, ids=str)
def test_unsupported_dtype_is_named(dtype):
    x = torch.zeros(3, dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(RuntimeError, match=rf"\[opforge::dispersion_correction\] argument 'x' .* got {name}$"):
        opforge.dispersion_correction(x, 1.0)


@pytest.mark.parametrize("dtype", [torch.bits8, torch.bits16, torch.uint4], ids=str)
def test_dtype_without_a_name_gives_its_code(dtype):
    with pytest.raises(RuntimeError, match=r"argument 'x' .* got dtype code \d+$"):
        opforge.dispersion_correction(torch.empty(3, dtype=dtype), 1.0)


def _vm_flags(addr: int) -> list[str] | None:
    """The VmFlags of the mapping holding addr in /proc/self/smaps, or None where there is none."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or opforge._runtime.thp_mode() == "unknown",
                    reason="needs Linux's /proc/self/smaps and a kernel with transparent huge pages")
def test_fresh_large_outputs_are_paged_in_as_the_mode_says_and_the_values_do_not_change():
    """A fresh CPU output of 4 MiB or more: "huge" advises transparent huge pages before the op writes it
    ("hg" in its mapping's flags); "populate" (the default) and "touch" do not; the values are the same."""
    assert opforge.get_pages() == "populate"  # the default
    g, u = torch.randn(2048, 4608), torch.randn(2048, 4608)  # 36 MiB outputs: glibc maps each fresh
    outs, flags = {}, {}
    try:
        for mode in ("touch", "populate", "huge"):
            opforge.set_pages(mode)
            assert opforge.get_pages() == mode
            y = opforge.swiglu(g, u)
            flags[mode] = _vm_flags(y.data_ptr() + y.numel() * 2)
            outs[mode] = y
    finally:
        opforge.set_pages("populate")
    assert "hg" in flags["huge"] and "hg" not in flags["touch"] and "hg" not in flags["populate"], flags
    assert torch.equal(outs["touch"], outs["populate"]) and torch.equal(outs["touch"], outs["huge"])
    threads = torch.get_num_threads()
    try:  # the pages are populated by the threads in parallel, 2 MiB each: at odd and oversubscribed counts
        for n in (1, 3, 16, 64):
            torch.set_num_threads(n)
            assert torch.equal(opforge.swiglu(g, u), outs["touch"]), n
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="pages mode 'always': expected one of touch, populate, huge"):
        opforge.set_pages("always")


def test_pages_env_is_read_and_checked():
    r = _run_python("import opforge; print(opforge.get_pages())", OPFORGE_PAGES="touch")
    assert r.returncode == 0 and r.stdout.strip() == "touch", r.stderr[-2000:]
    r = _run_python("import opforge", OPFORGE_PAGES="yes")
    assert r.returncode != 0 and "OPFORGE_PAGES=yes is not a pages mode; expected one of touch, populate, huge" \
        in r.stderr, r.stderr[-2000:]
