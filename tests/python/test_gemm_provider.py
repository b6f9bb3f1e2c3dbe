"""The GEMM provider: linear, matmul and linear_cross_entropy on torch's own GEMM (set_gemm("torch")),
the faster of the two per class of product (auto: measured once, kept on disk), or opforge's kernels
alone (own). The GEMM tests also run whole with OPFORGE_GEMM=torch (`make test`)."""

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import opforge
from opforge.functional.linear import _linear as _linear_op
from opforge.functional.linear import _mm_on_torch, _plain_on_torch


@contextlib.contextmanager
def _logged(path):
    """Op calls logged at info level to path."""
    opforge.set_log_file(str(path))
    opforge.set_log_level("info")
    try:
        yield
    finally:
        opforge.set_log_level("warning")
        opforge.set_log_file(None)


def _set_cache(path):
    opforge.library._call("opforge_set_gemm_cache", str(path).encode())


@pytest.fixture
def gemm_mode(tmp_path):
    """set_gemm, with auto mode's choices kept in this test's folder (not the user's cache) until the end"""
    saved = opforge.get_gemm()
    _set_cache(tmp_path / "gemm.tsv")
    yield opforge.set_gemm
    opforge.set_gemm(saved)
    _set_cache(opforge._runtime.gemm_cache_file())


def test_modes_and_their_errors(gemm_mode):
    for mode in ("own", "torch", "auto"):
        gemm_mode(mode)
        assert opforge.get_gemm() == mode
    with pytest.raises(RuntimeError, match="OPFORGE_GEMM=fast is not a GEMM provider mode; expected one of own, "
                                           "torch, auto"):
        gemm_mode("fast")
    r = subprocess.run([sys.executable, "-c", "import opforge"], env={**os.environ, "OPFORGE_GEMM": "mkl"},
                       capture_output=True, text=True)
    assert r.returncode != 0 and "OPFORGE_GEMM=mkl is not a GEMM provider mode" in r.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["none", "gelu", "relu"])
def test_linear_on_torchs_gemm_matches_own(gemm_mode, dtype, act, tmp_path):
    x = torch.randn(3, 70, 96, dtype=dtype, requires_grad=True)
    w = (torch.randn(130, 96) / 8).to(dtype).requires_grad_()
    b = torch.randn(130, dtype=dtype, requires_grad=True)
    g = torch.randn(3, 70, 130, dtype=dtype)
    runs = {}
    for mode in ("own", "torch"):
        gemm_mode(mode)
        with _logged(tmp_path / f"{mode}.log"):
            # the op itself: opforge.linear calls F.linear for a plain product all on torch's GEMM (below)
            y = _linear_op(x, w, b, act, True)[0]
            runs[mode] = (y, *torch.autograd.grad(y, (x, w, b), g))
    assert "gemm:torch_mm" in (tmp_path / "torch.log").read_text()
    assert "gemm:torch_mm" not in (tmp_path / "own.log").read_text()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(runs["torch"], runs["own"]):
        torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_linear_on_torchs_gemm_is_f_linear(gemm_mode, dtype, tmp_path):
    # activation "none" with every product (forward, dx, dweight) the provider's: opforge.linear is F.linear
    # itself in eager mode (no op call, no log line, the same bits), and the op again where opforge's kernels
    # run, where a product of it is not torch's, with an activation, and under torch.compile
    x = torch.randn(3, 70, 96, dtype=dtype, requires_grad=True)
    w = (torch.randn(130, 96) / 8).to(dtype).requires_grad_()
    b = torch.randn(130, dtype=dtype, requires_grad=True)
    for mode, routed in (("torch", True), ("own", False), ("torch", True)):  # set_gemm empties the cache
        gemm_mode(mode)
        for args in ((x, w, b), (x, w), (x.detach(), w.detach()), (x, torch.nn.Parameter(w.detach()))):
            log = tmp_path / f"{mode}-{len(args)}-{type(args[1]).__name__}.log"
            with _logged(log):
                y = opforge.linear(*args)
            assert ("opforge::linear" not in log.read_text()) == routed, (mode, len(args))
            if routed:
                assert torch.equal(y, F.linear(*args))
        with _logged(tmp_path / "act.log"):
            opforge.linear(x, w, b, "relu")
        assert "opforge::linear" in (tmp_path / "act.log").read_text()
    gemm_mode("auto")  # auto mode: the op until every class is settled (none yet in this fixture's cache),
    assert not _plain_on_torch(torch.randn(37, 96, dtype=dtype), w, None, True)
    assert not opforge._runtime.TORCH_LINEARS  # an answer that may change, so asked again on the next call
    gemm_mode("own")  # a final no is kept: the next call of the class asks nothing
    assert not _plain_on_torch(torch.randn(37, 96, dtype=dtype), w, None, True)
    assert list(opforge._runtime.TORCH_LINEARS.values()) == [False]
    torch._dynamo.reset()
    with _logged(tmp_path / "compiled.log"):
        gemm_mode("torch")
        torch.compile(lambda a, c: opforge.linear(a, c), fullgraph=True)(x, w)
    assert "opforge::linear" in (tmp_path / "compiled.log").read_text()


def test_routing_answers_are_bounded(gemm_mode, monkeypatch):
    # one key per shape: a shape that changes every call (a growing sequence) starts the table again
    L = sys.modules["opforge.functional.linear"]  # (the package's `linear` is the function)
    monkeypatch.setattr(L, "_KEYS_MAX", 3)
    gemm_mode("own")
    w = torch.randn(16, 8)
    for rows in range(1, 8):
        assert not L._plain_on_torch(torch.randn(rows, 8), w, None, False)
        assert 1 <= len(opforge._runtime.TORCH_LINEARS) <= 3


def test_plain_linear_routing_is_kept_once_auto_mode_settles(gemm_mode, tmp_path):
    # auto mode: the op (which measures the classes of its products) until the answer is final, then that
    # answer: F.linear where every product went to torch's GEMM (asked again at the re-checks only), the
    # op where one went to opforge's, without asking again
    gemm_mode("auto")
    x, w = torch.randn(64, 96, requires_grad=True), (torch.randn(130, 96) / 8).requires_grad_()
    for _ in range(100):
        opforge.linear(x, w).sum().backward()
        if opforge._runtime.TORCH_LINEARS:
            break
    (kept,) = opforge._runtime.TORCH_LINEARS.values()
    # False (the op), or F.linear's count of routed calls for auto mode's re-checks
    assert kept is False or isinstance(kept, list) and kept[:2] == [1, 32], kept
    routed = kept is not False
    with _logged(tmp_path / "settled.log"):
        opforge.linear(x, w).sum().backward()
    assert ("opforge::linear" not in (tmp_path / "settled.log").read_text()) == routed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_2d_matmul_on_torchs_gemm_is_torch_mm(gemm_mode, dtype, tmp_path):
    # a 2-d matmul whose products (forward, and the backward's the gradients need) are the provider's is
    # torch.mm itself in eager mode: no op call, the same bits; the op where opforge's kernels run, for
    # batched operands, under autocast into another dtype only as torch.mm is, and under torch.compile
    a = torch.randn(70, 96, dtype=dtype, requires_grad=True)
    b = (torch.randn(96, 130) / 8).to(dtype).requires_grad_()
    for mode, routed in (("torch", True), ("own", False), ("torch", True)):  # set_gemm empties the cache
        gemm_mode(mode)
        for args in ((a, b), (a.detach(), b), (a, b.detach()), (a.detach(), b.detach()), (b.t(), a.t()),
                     (a, torch.nn.Parameter(b.detach()))):
            log = tmp_path / f"{mode}.log"
            with _logged(log):
                c = opforge.matmul(*args)
                grads = [t.requires_grad for t in args]
                if c.requires_grad:
                    got = torch.autograd.grad(c, [t for t in args if t.requires_grad], torch.ones_like(c))
            assert ("opforge::matmul" not in log.read_text()) == routed, (mode, grads)
            if routed:
                assert torch.equal(c, torch.mm(*args))
            if c.requires_grad:  # both sides' gradients: the op's (on the same GEMM, mode torch) or mm's
                want = torch.autograd.grad(torch.mm(*args), [t for t in args if t.requires_grad], torch.ones_like(c))
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, **({} if mode == "torch" else dict(rtol=2e-2, atol=5e-2)))
        batched = tmp_path / f"{mode}-3d.log"
        with _logged(batched):
            opforge.matmul(a.detach().expand(2, 70, 96), b.detach().expand(2, 96, 130))
        assert "opforge::matmul" in batched.read_text()
    gemm_mode("auto")  # auto mode: the op until its classes are settled (none yet in this fixture's cache)
    assert not _mm_on_torch(torch.randn(37, 96, dtype=dtype), b, 0) and not opforge._runtime.TORCH_LINEARS
    gemm_mode("torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c = opforge.matmul(a.float(), b.float())
    assert c.dtype == torch.bfloat16 and torch.equal(c, torch.mm(a.detach().bfloat16(), b.detach().bfloat16()))
    with _logged(tmp_path / "mixed.log"), pytest.raises(RuntimeError, match="opforge::matmul"):
        opforge.matmul(a.detach().float(), b.detach().double())  # the op's error, not mm's
    torch._dynamo.reset()
    with _logged(tmp_path / "compiled.log"):
        torch.compile(lambda p, q: opforge.matmul(p, q), fullgraph=True)(a, b)
    assert "opforge::matmul" in (tmp_path / "compiled.log").read_text()


def test_matmul_and_linear_cross_entropy_on_torchs_gemm(gemm_mode):
    a, b = torch.randn(4, 65, 80, requires_grad=True), torch.randn(4, 80, 70, requires_grad=True)
    h = torch.randn(300, 64, requires_grad=True)
    w = (torch.randn(1000, 64) / 8).requires_grad_()
    t = torch.randint(0, 1000, (300,))
    runs = {}
    for mode in ("own", "torch"):
        gemm_mode(mode)
        c = opforge.matmul(a, b)
        loss = opforge.linear_cross_entropy(h, w, t)
        runs[mode] = (c, loss, *torch.autograd.grad(c.sum() + loss, (a, b, h, w)))
    for got, want in zip(runs["torch"], runs["own"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runs["torch"][1], F.cross_entropy(h @ w.T, t), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_torchs_gemm_runs_take_no_workspace(gemm_mode, dtype):
    # A product the provider has settled on running on torch's GEMM (mode torch, or a class auto decided for
    # torch) writes its result itself: the op allocates its outputs, not the float32 partial sums and
    # packing buffers opforge's GEMM would use (in bfloat16 twice the output's bytes, and more)
    import opforge.benchmark as ob

    x, w, b = torch.randn(512, 640, dtype=dtype), (torch.randn(384, 640) / 25).to(dtype), torch.randn(384, dtype=dtype)
    a, m = torch.randn(2, 320, 640, dtype=dtype), (torch.randn(2, 640, 384) / 25).to(dtype)
    out_bytes = 512 * 384 * x.element_size()
    peaks = {}
    for mode in ("own", "torch"):
        gemm_mode(mode)
        peaks[mode] = (ob.peak_memory(lambda: opforge.linear(x, w)), ob.peak_memory(lambda: opforge.matmul(a, m)),
                       ob.peak_memory(lambda: opforge.linear(x, w, b, "gelu")))  # torch's addmm has temporaries
    # what torch's GEMM itself allocates (oneDNN's bfloat16 path has temporaries), and the float32 bias row
    eager = ob.peak_memory(lambda: F.linear(x, w)), ob.peak_memory(lambda: torch.matmul(a, m))
    slack = out_bytes // 4  # less than any workspace of opforge's GEMM here (bf16: 2x the output's bytes)
    assert out_bytes <= peaks["torch"][0] <= eager[0] + slack, (peaks, eager)
    assert peaks["torch"][1] <= eager[1] + slack, (peaks, eager)
    assert all(own > torch for own, torch in zip(peaks["own"], peaks["torch"])), peaks
    # the backward (no activation: its two GEMMs read the gradient in place): its outputs and what torch's
    # GEMM allocates for the two products, one after the other
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = opforge.linear(xg, wg)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (xg, wg), g)
    backward = torch.ops.opforge.linear_backward.default
    no_preact = torch.empty(0, dtype=dtype)
    bwd = {}
    for mode in ("own", "torch"):
        gemm_mode(mode)
        bwd[mode] = ob.peak_memory(lambda: backward(g, x, w, None, no_preact, "none", 3))
    products = ob.peak_memory(lambda: torch.mm(g, w)) + ob.peak_memory(lambda: torch.mm(g.t(), x))
    assert bwd["torch"] <= products + 384 * 4 + 64 < bwd["own"], (bwd, products)
    gemm_mode("own")
    for got, want in zip(grads, torch.autograd.grad(opforge.linear(xg, wg), (xg, wg), g)):
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)


def _matmul_key(m, n, k, dtype=torch.float32):
    import ctypes

    dll = opforge.library.dll
    dll.opforge_gemm_matmul_key.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int64, ctypes.c_char_p,
                                                                   ctypes.c_size_t]
    key = ctypes.create_string_buffer(256)
    dll.opforge_gemm_matmul_key(m, n, k, int(dtype == torch.bfloat16), torch.get_num_threads(), key, 256)
    return key.value.decode()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_mode_claims_the_classes_it_gave_to_torch(gemm_mode, dtype):
    # once auto has measured a class, a product of it decided for torch runs without opforge's workspace
    # (peak memory: torch's own), one decided for opforge's kernels with it
    import opforge.benchmark as ob

    gemm_mode("auto")
    a, m = torch.randn(2, 320, 640, dtype=dtype), (torch.randn(2, 640, 384) / 25).to(dtype)
    for _ in range(20):  # past the class's measuring calls (6, or 16 on a near tie; 2 products a call)
        opforge.matmul(a, m)
    key = _matmul_key(320, 384, 640, dtype)
    choice = [c["provider"] for c in opforge.gemm_choices() if c["key"] == key]
    assert choice in (["own"], ["torch"]), (key, opforge.gemm_choices())
    peak, eager = ob.peak_memory(lambda: opforge.matmul(a, m)), ob.peak_memory(lambda: torch.matmul(a, m))
    assert (peak <= eager + 320 * 384 * a.element_size() // 2) == (choice == ["torch"]), (peak, eager, choice)


_AUTO = r"""
import json, torch, opforge
opforge.set_gemm("auto")
x, w = torch.randn(256, 128, requires_grad=True), torch.randn(192, 128, requires_grad=True)
for _ in range(17):  # a class's first 6 products (16 on a near tie) run on the two GEMMs in turn, then the faster
    opforge.linear(x, w, None, "gelu").sum().backward()
opforge.linear(x[:200], w, None, "gelu").sum().backward()   # the same classes
print(json.dumps({"choices": opforge.gemm_choices(), "file": opforge._runtime.gemm_cache_file()}))
"""


def test_auto_times_a_class_on_its_first_calls_and_keeps_the_choice_on_disk(tmp_path):
    env = {**os.environ, "OPFORGE_CACHE_DIR": str(tmp_path), "OPFORGE_GEMM": "auto"}

    def run():
        r = subprocess.run([sys.executable, "-c", _AUTO], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.splitlines()[-1])

    first = run()
    keys = [c["key"] for c in first["choices"]]
    assert len(keys) == 3 and len(set(keys)) == 3  # forward, dx and dweight: three classes
    for c in first["choices"]:  # each timed 3 times on each GEMM (up to 8 near the line), then decided
        # own's rate against the line it must clear: 3% behind with an epilogue (a near tie stays with the
        # kernel that fuses it), 5% ahead for a plain product (a near tie goes to torch's)
        own = c["own_gflops"] / (0.97 if c["key"].split()[2] == "e" else 1.05)
        near_tie = min(own, c["torch_gflops"]) >= 0.92 * max(own, c["torch_gflops"])
        assert c["here"] and 6 <= c["samples"] <= 16 and c["provider"] in ("own", "torch"), c
        assert c["samples"] == 16 or not near_tie, c  # decided before 8 each only once the two are apart
        assert c["own_gflops"] > 0 and c["torch_gflops"] > 0
        assert c["provider"] == ("torch" if c["torch_gflops"] > own else "own"), c
    cpu = opforge.cpu_features()  # the file is per CPU: brand string and cpuid signature
    assert f"-{cpu['family']}.{cpu['model_number']}.{cpu['stepping']}-torch-" in first["file"], first["file"]
    assert first["file"].startswith(str(tmp_path)) and "torch-" + torch.__version__.replace("+", "-") in first["file"]
    lines = open(first["file"]).read().splitlines()
    assert sorted(line.split("\t")[0] for line in lines) == sorted(keys)
    second = run()  # a later process reads the choices and times nothing
    assert {c["key"]: c["provider"] for c in second["choices"]} == {c["key"]: c["provider"] for c in first["choices"]}
    assert not any(c["here"] or c["samples"] for c in second["choices"])


def _choice(key):
    (c,) = [c for c in opforge.gemm_choices() if c["key"] == key]
    return c


def test_a_decided_class_is_checked_again_on_later_calls(gemm_mode, tmp_path):
    """A class auto mode decided (here from a cache file whose rates are far too low, as a busy moment's
    first samples could be) is sampled again. One on opforge's kernel: at its 32nd and 33rd calls on
    torch's GEMM, at the next two on opforge's, and it goes to torch's where torch's best then clears the
    margin. One on torch's, whose calls the Python layer sends to torch.mm: after 32 of them the layer
    asks again, the next four calls go to the op, which samples torch's GEMM twice, then opforge's kernel
    on a workspace of its own (the class runs claimed), and the best samples decide it again; torch.mm or
    the op from then on, as the class says."""
    a, b = torch.randn(96, 160), torch.randn(160, 128)
    c2, d2 = torch.randn(64, 96), torch.randn(96, 80)
    own_key, torch_key = _matmul_key(96, 128, 160), _matmul_key(64, 80, 96)
    path = tmp_path / "rechecked.tsv"
    path.write_text(f"{own_key}\town\t1e-06\t1e-06\n{torch_key}\ttorch\t1e-06\t1e-06\n")
    gemm_mode("auto")
    _set_cache(path)

    want, want2 = a @ b, c2 @ d2
    with torch.no_grad():
        for call in range(1, 36):  # (past 36 the torch class, if it stays, is re-checked again)
            torch.testing.assert_close(opforge.matmul(a, b), want, rtol=1e-5, atol=1e-5)
            routed = _mm_on_torch(c2, d2, 0)  # what the next call does (the answer the call gets)
            torch.testing.assert_close(opforge.matmul(c2, d2), want2, rtol=1e-5, atol=1e-5)
            c, t = _choice(own_key), _choice(torch_key)
            if call < 32:
                assert c["samples"] == 0 and c["provider"] == "own" and c["own_gflops"] < 1e-3, (call, c)
            elif call <= 33:  # torch's GEMM sampled
                assert c["samples"] == call - 31 and c["torch_gflops"] > 1e-3 and c["own_gflops"] < 1e-3, (call, c)
            elif call == 34:  # then opforge's
                assert c["samples"] == 3 and c["own_gflops"] > 1e-3 and c["provider"] == "own", (call, c)
            else:  # and the two best samples decide again (5% ahead to stay: a plain product)
                assert c["samples"] == 4, (call, c)
                assert c["provider"] == ("torch" if c["torch_gflops"] > c["own_gflops"] / 1.05 else "own"), c
            # the torch class: _mm_on_torch counts a routed call too, so its 33rd answer comes at call 17
            if call < 17:
                assert routed and t["samples"] == 0 and t["provider"] == "torch", (call, t)
            elif call <= 20:  # asked again: the op's calls sample torch's GEMM twice, then opforge's kernel
                assert not routed and t["samples"] == call - 16 and (call == 20 or t["provider"] == "torch"), (call, t)
                assert (t["own_gflops"] > 1e-3) == (call > 18) and t["torch_gflops"] > 1e-3, (call, t)
            if call >= 20:  # the fourth sample decides again: torch.mm, or the op for good
                assert t["samples"] == 4 and (call == 20 or routed == (t["provider"] == "torch")), (call, t)
                assert t["provider"] == ("torch" if t["torch_gflops"] > t["own_gflops"] / 1.05 else "own"), t
    lines = [line.split("\t")[:2] for line in path.read_text().splitlines()]
    for key in own_key, torch_key:  # a change is kept on disk, after the first lines
        if _choice(key)["provider"] != lines[[k for k, _ in lines].index(key)][1]:
            assert [key, _choice(key)["provider"]] in lines[2:], (key, lines)


def test_routed_calls_reach_every_re_check_and_a_re_check_without_samples_ends(gemm_mode, tmp_path):
    """The provider's answers for a routed matmul class on torch's GEMM, asked as the Python layer asks
    (the routed calls since it last asked): each report that reaches a re-check (32, 64, 128 calls) makes
    the class wait for the op's samples (-1); where they never come, it stands again (3) after
    RECHECK_WAITS questions, and the next re-check still comes."""
    key = _matmul_key(64, 80, 96)
    path = tmp_path / "routed.tsv"
    path.write_text(f"{key}\ttorch\t1e-06\t1e-06\n")
    gemm_mode("auto")
    _set_cache(path)
    threads = torch.get_num_threads()
    L = sys.modules["opforge.functional.linear"]

    def ask(routed):
        return L._matmul_on_torch(64, 80, 96, 96, 1, 80, 1, 0, 0, threads, routed)

    assert ask(0) == 3 and ask(31) == 3  # routed, re-checked later
    for routed in (1, 32, 64):  # calls 32, 64, 128
        assert ask(routed) == -1
        answers = [ask(0) for _ in range(70)]
        assert answers[:60] == [-1] * 60 and answers[-1] == 3, answers
    assert _choice(key)["samples"] == 0 and _choice(key)["provider"] == "torch"


def test_a_routed_linears_three_classes_are_checked_again(gemm_mode, tmp_path):
    """A plain linear with a gradient whose three products (forward, dx, dweight) are on torch's GEMM is
    F.linear itself; at its re-check each of the three classes takes its four samples on the op's calls."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 96, requires_grad=True), (torch.randn(130, 96) / 10).requires_grad_()
    gemm_mode("auto")
    for _ in range(20):  # the three classes' keys, from their first measuring calls
        opforge.linear(x, w).sum().backward()
    keys = [c["key"] for c in opforge.gemm_choices()]
    assert len(keys) == 3, keys
    path = tmp_path / "three.tsv"
    path.write_text("".join(f"{key}\ttorch\t1e-06\t1e-06\n" for key in keys))
    _set_cache(path)
    opforge._runtime.TORCH_LINEARS.clear()
    want = torch.autograd.grad(F.linear(x.double(), w.double()).sum(), (x, w))
    for call in range(1, 40):
        got = torch.autograd.grad(opforge.linear(x, w).sum(), (x, w))
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-4)
        samples = [_choice(key)["samples"] for key in keys]
        assert samples == [0, 0, 0] if call <= 32 else samples == [min(call - 32, 4)] * 3, (call, samples)
    for key in keys:
        c = _choice(key)
        assert c["provider"] == ("torch" if c["torch_gflops"] > c["own_gflops"] / 1.05 else "own"), c


@pytest.mark.parametrize("dtype,k", [(torch.float32, 96), (torch.bfloat16, 2100)])
def test_a_class_on_torchs_gemm_is_checked_again_on_its_claimed_calls(gemm_mode, tmp_path, dtype, k):
    """A class on torch's GEMM runs claimed (no workspace) in an op the Python layer does not route (a
    linear with an activation): its 32nd and 33rd calls sample torch's GEMM, the next two opforge's kernels
    on a workspace the sample brings (with float32 partial sums for a bfloat16 result whose K spans several
    slices), and the two best samples decide again; every call's result stays right."""
    torch.manual_seed(0)
    x, w, bias = torch.randn(48, k, dtype=dtype), (torch.randn(72, k) / k**0.5).to(dtype), torch.randn(72, dtype=dtype)
    want = F.gelu(F.linear(x.double(), w.double(), bias.double()))
    gemm_mode("auto")
    with torch.no_grad():
        for _ in range(20):  # the class's first measuring calls
            opforge.linear(x, w, bias, "gelu")
        (key,) = [c["key"] for c in opforge.gemm_choices()]
        path = tmp_path / "torch.tsv"
        path.write_text(f"{key}\ttorch\t1e-06\t1e-06\n")
        _set_cache(path)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for call in range(1, 36):
            got = opforge.linear(x, w, bias, "gelu")
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
            c = _choice(key)
            if call < 32:
                assert c["samples"] == 0 and c["provider"] == "torch", (call, c)
            elif call <= 33:
                assert c["samples"] == call - 31 and c["torch_gflops"] > 1e-3 and c["own_gflops"] < 1e-3, (call, c)
            elif call == 34:
                assert c["samples"] == 3 and c["own_gflops"] > 1e-3 and c["provider"] == "torch", (call, c)
            else:  # a fused epilogue: opforge's stays within 3% behind
                assert c["samples"] == 4, (call, c)
                assert c["provider"] == ("torch" if c["torch_gflops"] > c["own_gflops"] / 0.97 else "own"), c


def test_attention_classes_on_opforges_kernel_are_checked_again(gemm_mode):
    """Attention's classes take the same re-checks: a class auto mode kept on opforge's kernel is sampled on
    torch's kernel and on its own again from its 32nd call after the decision, two calls each (forward and
    backward each); one kept on torch's the same way, whether the op ran its calls or the Python layer
    sent them to F.scaled_dot_product_attention (which asks again after 32, and sends the next four to the
    op); every call's results stay those of either kernel."""
    gemm_mode("auto")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    g = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), g)

    def call():
        out = opforge.scaled_dot_product_attention(q, k, v, is_causal=True)
        got = torch.autograd.grad(out, (q, k, v), g.float())
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
        for x, y in zip(got, want):
            torch.testing.assert_close(x.double(), y.double(), rtol=1e-3, atol=1e-3)

    def sdpa():
        return {c["key"]: c for c in opforge.gemm_choices() if c["key"].startswith("sdpa")}

    for _ in range(16):  # each class's measuring calls (6, or 16 on a near tie)
        call()
    before = sdpa()
    assert len(before) == 2 and all(c["provider"] in ("own", "torch") for c in before.values()), before
    for _ in range(40):  # past the 33rd call after each decision
        call()
    for key, c in sdpa().items():
        if before[key]["provider"] == "own":
            assert c["samples"] == before[key]["samples"] + 4, (before[key], c)
        else:  # torch's: sampled the same way, whether the op ran its calls or F.sdpa did
            assert c["samples"] == before[key]["samples"] + 4, (before[key], c)
        assert c["provider"] == ("torch" if c["torch_gflops"] > c["own_gflops"] / 0.97 else "own"), c


def test_attention_classes_on_torchs_kernel_are_checked_again(gemm_mode, tmp_path):
    """Attention classes on torch's kernel (here from a cache file whose rates are far too low), whose calls
    the Python layer sends to F.scaled_dot_product_attention: after 32 of them it asks again, the next four
    calls go to the op, which samples torch's kernel, then opforge's, forward and backward, and the best
    samples decide the classes again."""
    gemm_mode("auto")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, requires_grad=True) for _ in range(3))
    for _ in range(16):  # the classes' keys, from their first measuring calls
        opforge.scaled_dot_product_attention(q, k, v).sum().backward()
    keys = sorted(c["key"] for c in opforge.gemm_choices() if c["key"].startswith("sdpa"))
    assert len(keys) == 2, keys
    path = tmp_path / "sdpa.tsv"
    path.write_text("".join(f"{key}\ttorch\t1e-06\t1e-06\n" for key in keys))
    _set_cache(path)
    opforge._runtime.TORCH_LINEARS.clear()  # (the Python layer's answers for the classes measured above)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    want = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    for call in range(1, 38):
        out = opforge.scaled_dot_product_attention(q, k, v)
        got = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
        for x, y in zip(got, want):
            torch.testing.assert_close(x.double(), y.double(), rtol=1e-3, atol=1e-3)
        for key in keys:
            c = _choice(key)
            if call <= 32:
                assert c["samples"] == 0 and c["provider"] == "torch", (call, c)
            elif call < 36:
                assert c["samples"] == call - 32 and c["provider"] == "torch", (call, c)
                assert (c["own_gflops"] > 1e-3) == (call > 34) and c["torch_gflops"] > 1e-3, (call, c)
            else:  # the fourth sample decides
                assert c["samples"] == 4, (call, c)
                assert c["provider"] == ("torch" if c["torch_gflops"] > c["own_gflops"] / 0.97 else "own"), c


def test_a_class_being_measured_gives_the_results_of_either_gemm(gemm_mode):
    gemm_mode("own")
    x, w = torch.randn(300, 96), torch.randn(160, 96)
    want = opforge.linear(x, w, None, "silu")
    gemm_mode("auto")
    for _ in range(8):
        torch.testing.assert_close(opforge.linear(x, w, None, "silu"), want, rtol=1e-5, atol=1e-5)


def test_info_names_the_mode_and_the_choices(tmp_path):
    env = {**os.environ, "OPFORGE_CACHE_DIR": str(tmp_path), "OPFORGE_GEMM": "torch"}
    r = subprocess.run([sys.executable, "-m", "opforge", "info"], env=env, capture_output=True, text=True)
    assert "gemm        torch (OPFORGE_GEMM=torch)" in r.stdout, r.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 2, 1])  # 2, 1: grouped-query (torch's kernel reads K, V unrepeated)
def test_attention_on_torchs_kernel_matches_own(gemm_mode, dtype, causal, heads_kv, tmp_path):
    q = torch.randn(2, 4, 160, 64, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, heads_kv, 160, 64, dtype=dtype, requires_grad=True) for _ in range(2))
    g = torch.randn(2, 4, 160, 64, dtype=dtype)
    runs = {}
    for mode in ("own", "torch"):
        gemm_mode(mode)
        with _logged(tmp_path / f"{mode}.log"):
            out, lse = torch.ops.opforge.attention(q, k, v, None, causal, None)
            y = opforge.scaled_dot_product_attention(q, k, v, is_causal=causal)
            runs[mode] = (out, lse, *torch.autograd.grad(y, (q, k, v), g))
    # the op called itself runs torch's kernel; the wrapper is F.scaled_dot_product_attention itself (no op call)
    assert (tmp_path / "torch.log").read_text().count("attention:torch_sdpa") == 1
    assert (tmp_path / "torch.log").read_text().count("opforge::attention ") == 1
    assert "torch_sdpa" not in (tmp_path / "own.log").read_text()
    assert runs["torch"][0].stride() == runs["own"][0].stride() and runs["torch"][1].is_contiguous()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    # torch's bfloat16 backward rounds each query head's share of dK and dV before summing a group's (the
    # op sums in float32 and rounds once): up to a rounding per head more, near zero where they cancel
    group_tol = dict(tol, atol=tol["atol"] * (4 // heads_kv)) if dtype == torch.bfloat16 else tol
    for i, (got, want) in enumerate(zip(runs["torch"], runs["own"])):
        torch.testing.assert_close(got.float(), want.float(), **(group_tol if i >= 3 else tol))
    # the backward of either runs on the other's out and lse
    gemm_mode("own")
    mixed = torch.ops.opforge.attention_backward(g, q, k, v, None, *runs["torch"][:2], causal, None)
    for got, want in zip(mixed, runs["own"][2:]):
        torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_on_torchs_kernel_is_torchs_sdpa(gemm_mode, dtype, tmp_path):
    # an unmasked attention whose forward (and backward, with a gradient) the provider runs on torch's fused
    # kernel is F.scaled_dot_product_attention itself in eager mode: torch's autograd node, the same bits; the
    # op where opforge's kernel runs, for the cases torch's kernel lacks, and under torch.compile
    q, k, v = (torch.randn(2, 160, 4, 64, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3))
    torch_node = type(F.scaled_dot_product_attention(q, k, v).grad_fn)
    for turn, (mode, routed) in enumerate((("torch", True), ("own", False), ("torch", True))):  # set_gemm
        gemm_mode(mode)  # empties the kept answers
        for causal in (False, True):
            for i, args in enumerate(((q, k, v), (q.detach(), k, v), (q.detach(), k.detach(), v.detach()))):
                log = tmp_path / f"{turn}-{causal}-{i}.log"
                with _logged(log):
                    y = opforge.scaled_dot_product_attention(*args, is_causal=causal)
                assert ("opforge::attention " not in log.read_text()) == routed, (mode, causal)
                assert (type(y.grad_fn) is torch_node) == (routed and y.requires_grad)
                if routed:
                    with torch.no_grad():
                        assert torch.equal(y, F.scaled_dot_product_attention(*args, is_causal=causal))
        y = opforge.scaled_dot_product_attention(q[0], k[0], v[0])  # 3-d: (B, N, D) with B = 4 here
        assert y.shape == (4, 160, 64) and (type(y.grad_fn.next_functions[0][0]) is torch_node) == routed
        # grouped-query heads: F.scaled_dot_product_attention(enable_gqa=True), K and V not repeated
        for kv in (k[:, :2], k[:, :1].detach()):
            with _logged(tmp_path / f"{turn}-gqa.log"):
                y = opforge.scaled_dot_product_attention(q, kv, kv, is_causal=True)
            assert ("opforge::attention " not in (tmp_path / f"{turn}-gqa.log").read_text()) == routed
            assert (type(y.grad_fn) is torch_node) == routed
            if routed:
                with torch.no_grad():
                    assert torch.equal(y, F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True))
    mask = torch.rand(160, 160) > 0.2
    with _logged(tmp_path / "cases.log"):  # what torch's kernel does not run: the op
        opforge.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        opforge.scaled_dot_product_attention(q[:, :, :100], k, v, is_causal=True)  # bottom-right causal
        opforge.scaled_dot_product_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)  # strided rows
    assert (tmp_path / "cases.log").read_text().count("opforge::attention ") == 3
    with pytest.raises(RuntimeError, match="dividing"):  # 3 key/value heads for 4: the op's error, not torch's
        opforge.scaled_dot_product_attention(q, k[:, :3], v[:, :3])
    torch._dynamo.reset()
    with _logged(tmp_path / "compiled.log"):
        torch.compile(lambda a, b, c: opforge.scaled_dot_product_attention(a, b, c), fullgraph=True)(q, k, v)
    assert "opforge::attention " in (tmp_path / "compiled.log").read_text()
    if dtype == torch.float32:  # under autocast: F.scaled_dot_product_attention's bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = opforge.scaled_dot_product_attention(q, k, v)
            want = F.scaled_dot_product_attention(q, k, v)
        assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    gemm_mode("auto")  # auto mode: the op until both passes' classes are settled (none yet in this cache)
    q2 = torch.randn(1, 8, 512, 64, dtype=dtype, requires_grad=True)  # past the work torch's kernel is tried at
    with _logged(tmp_path / "auto.log"):
        opforge.scaled_dot_product_attention(q2, q2, q2)
    assert "opforge::attention " in (tmp_path / "auto.log").read_text()


def test_small_attention_is_timed_whole_twice(gemm_mode, tmp_path):
    # below the work the op offers torch's kernel, auto mode times whole calls (forward and backward) of the
    # op and of F.scaled_dot_product_attention per class (the op's autograd hop through Python weighs most
    # there): on the class's first call, whose answer its next calls take, and again after _SMALL_AGAIN
    # calls, which settles it; without drawing random numbers. Without a gradient a small call is the
    # op's, unchecked
    from opforge._runtime import SMALL_TRIALS, TORCH_LINEARS

    lin = sys.modules["opforge.functional.linear"]
    q, k, v = (torch.randn(1, 64, 2, 64).transpose(1, 2).requires_grad_() for _ in range(3))
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    gemm_mode("own")
    bits = {False: opforge.scaled_dot_product_attention(q, k, v, is_causal=True), True: theirs}  # the op's, SDPA's
    gemm_mode("auto")
    rng = torch.get_rng_state()
    y = opforge.scaled_dot_product_attention(q, k, v, is_causal=True)  # the first timing's answer, for now
    assert torch.equal(y, bits[type(y.grad_fn) is type(theirs.grad_fn)])
    assert torch.equal(torch.get_rng_state(), rng) and not TORCH_LINEARS and len(SMALL_TRIALS) == 1
    (trial,) = SMALL_TRIALS.values()
    for calls in range(2, lin._SMALL_AGAIN + 1):  # the first timing's answer, the class not timed again
        assert torch.equal(opforge.scaled_dot_product_attention(q, k, v, is_causal=True), y)
        assert trial[0] == calls and not TORCH_LINEARS
    opforge.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(torch.get_rng_state(), rng) and len(TORCH_LINEARS) == 1 and not SMALL_TRIALS
    (key, routed), = TORCH_LINEARS.items()
    assert key[0] == "attention causal" and key[1]
    with _logged(tmp_path / "log"):
        z = opforge.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert ("opforge::attention " in (tmp_path / "log").read_text()) != routed and len(TORCH_LINEARS) == 1
    assert torch.equal(z, bits[routed])  # (the second timing may settle on the other side: a near tie)
    torch.testing.assert_close(z, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)
    with torch.no_grad(), _logged(tmp_path / "nograd.log"):
        opforge.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert "opforge::attention " in (tmp_path / "nograd.log").read_text() and len(TORCH_LINEARS) == 1


def test_attention_cases_torch_lacks_stay_on_opforges_kernels(gemm_mode, tmp_path):
    gemm_mode("torch")
    q = torch.randn(2, 4, 160, 64)
    kv = torch.randn(2, 2, 160, 64)  # grouped-query heads: torch's kernel has them (without a mask)
    mask = torch.rand(160, 160) > 0.2
    with _logged(tmp_path / "log"):
        opforge.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)
        opforge.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        opforge.scaled_dot_product_attention(q[:, :, :100], q, q, is_causal=True)  # bottom-right causal
    log = (tmp_path / "log").read_text()
    assert log.count("opforge::attention ") == 3 and "torch_sdpa" not in log


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_small_softmax_with_a_gradient_may_be_torchs(gemm_mode, name, tmp_path):
    # an eager call with a gradient below 2^20 elements: mode torch runs torch's function (its autograd
    # node, its bits), mode own the op; auto mode times both whole per class (twice: _small_class), drawing
    # no random numbers, and keeps the answer. Without a gradient, past the size, or in float64: the op
    from opforge._runtime import TORCH_LINEARS

    lin = sys.modules["opforge.functional.linear"]

    ours, theirs = getattr(opforge.functional, name), getattr(torch, name)
    x = torch.randn(64, 96, requires_grad=True)
    node = type(theirs(x, -1).grad_fn)
    for mode, routed in (("torch", True), ("own", False)):
        gemm_mode(mode)
        with _logged(tmp_path / f"{mode}.log"):
            y = ours(x, -1)
        assert (type(y.grad_fn) is node) == routed
        assert (f"opforge::{name} " in (tmp_path / f"{mode}.log").read_text()) != routed
        if routed:
            assert torch.equal(y, theirs(x, -1))
        with torch.no_grad(), _logged(tmp_path / f"{mode}-nograd.log"):
            ours(x, -1)
        assert f"opforge::{name} " in (tmp_path / f"{mode}-nograd.log").read_text()
    gemm_mode("torch")
    assert type(ours(torch.randn(1024, 1024, requires_grad=True), -1).grad_fn) is not node
    assert type(ours(x.detach().double().requires_grad_(), -1).grad_fn) is not node
    gemm_mode("own")
    bits = {False: ours(x, 0), True: theirs(x, 0)}  # the op's, torch's
    gemm_mode("auto")
    rng = torch.get_rng_state()
    y = ours(x, 0)  # the first timing's answer, for now (the second may differ: a near tie)
    assert torch.equal(y, bits[type(y.grad_fn) is node])
    for _ in range(lin._SMALL_AGAIN):
        assert not TORCH_LINEARS
        ours(x, 0)
    assert torch.equal(torch.get_rng_state(), rng) and len(TORCH_LINEARS) == 1
    (key, routed), = TORCH_LINEARS.items()
    assert key[0] == name and key[1] == 1
    z = ours(x, 0)
    assert (type(z.grad_fn) is node) == routed and len(TORCH_LINEARS) == 1
    assert torch.equal(z, bits[routed])
    torch.testing.assert_close(z, theirs(x, 0), rtol=1e-5, atol=1e-6)
    (g,) = torch.autograd.grad(z, x, torch.ones_like(z))
    (want,) = torch.autograd.grad(theirs(x, 0), x, torch.ones_like(z))
    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def test_attention_on_torchs_kernel_holds_one_output(gemm_mode):
    """Where the op runs torch's kernel, it keeps torch's out and gradients (in the op's layout) and makes
    its own only where it must copy: its peak memory is torch's kernel's, plus the op's float32
    log-sum-exp copy, never a second set of outputs."""
    from opforge.benchmark import peak_memory

    gemm_mode("torch")
    q, k, v = (torch.randn(1, 1024, 8, 64).transpose(1, 2) for _ in range(3))  # 2 MiB each
    lse_bytes = 8 * 1024 * 4
    op = peak_memory(lambda: torch.ops.opforge.attention(q, k, v, None, False, None))
    theirs = peak_memory(lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v))
    assert 0 < op <= theirs + lse_bytes, (op, theirs)
    out, lse = torch.ops.opforge.attention(q, k, v, None, False, None)
    their_out, their_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    g = torch.randn_like(out)
    op = peak_memory(lambda: torch.ops.opforge.attention_backward(g, q, k, v, None, out, lse, False, None))
    theirs = peak_memory(lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, their_out, their_lse, 0.0, False))
    assert 0 < op <= theirs, (op, theirs)


@pytest.mark.parametrize("threads", [1, 3, 16, 64])
def test_attention_on_torchs_kernel_copies_into_the_ops_layout_on_any_thread_count(gemm_mode, threads):
    """torch's kernel returns (B, H, N, D) rows; the op's output is laid out (B, N, H, D): the copy runs
    over the threads (oversubscribed here) and gives torch's values bit for bit."""
    gemm_mode("torch")
    q, k, v = (torch.randn(2, 3, 300, 40) for _ in range(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = torch.ops.opforge.attention(q, k, v, None, True, None)
        want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    finally:
        torch.set_num_threads(before)
    assert out.stride() == (300 * 3 * 40, 40, 3 * 40, 1)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@pytest.mark.parametrize("first, again, answers", [
    ((100, 90), (100, 90), (-2, 1)),  # torch's both times
    ((100, 120), (100, 90), (-1, 1)),  # a busy first moment on torch's side: the second timing settles it
    ((130, 115), (100, 110), (-2, 0)),  # and on the op's
    ((100, 101), (100, 104), (-2, 1)),  # a near tie: torch's (the op's best 100 us against torch's 101)
])
def test_small_class_is_timed_twice(monkeypatch, first, again, answers):
    """_small_class on a fake timing: the first timing's answer for now (-2 torch's, -1 the op's) on the
    class's first _SMALL_AGAIN calls, then timed again and settled on each side's best of both timings."""
    lin = sys.modules["opforge.functional.linear"]
    timings = [first, again]
    monkeypatch.setattr(lin, "_timed_whole", lambda own, theirs, inputs, needs_grad: timings.pop(0))
    monkeypatch.setattr(lin, "SMALL_TRIALS", {})
    got = [lin._small_class("key", None, None, (), True) for _ in range(lin._SMALL_AGAIN)]
    assert got == [answers[0]] * lin._SMALL_AGAIN and len(timings) == 1
    assert lin._small_class("key", None, None, (), True) == answers[1] and not timings and not lin.SMALL_TRIALS


def test_small_class_settled_by_two_threads_at_once(monkeypatch):
    """A second thread may reach a class's settling call while the first times it (the timing releases the
    GIL): both settle it, and neither finds the trial gone."""
    lin = sys.modules["opforge.functional.linear"]
    monkeypatch.setattr(lin, "SMALL_TRIALS", {})
    inner = []

    def timed(own, theirs, inputs, needs_grad):
        if lin.SMALL_TRIALS.get("key", [0])[0] > lin._SMALL_AGAIN and not inner:
            inner.append(None)  # the other thread's call, made while this one times
            inner[0] = lin._small_class("key", None, None, (), True)
        return 100, 90

    monkeypatch.setattr(lin, "_timed_whole", timed)
    for _ in range(lin._SMALL_AGAIN):
        assert lin._small_class("key", None, None, (), True) == -2
    assert lin._small_class("key", None, None, (), True) == 1 and inner == [1] and not lin.SMALL_TRIALS


@pytest.mark.parametrize("own_us, theirs_us, on_torch", [(100, 101, True), (100, 102.9, True), (100, 104, False),
                                                         (100, 90, True)])
def test_small_class_timing_prefers_torch_on_near_ties(monkeypatch, own_us, theirs_us, on_torch):
    """The whole-call timing of a small class (_small_class's first, _timed_whole) on a clock that each
    call advances by its side's fixed time: the op takes the class only where it wins by _OWN_MARGIN,
    and the two sides run in alternating order, each once to warm up first."""
    lin = sys.modules["opforge.functional.linear"]  # the module (the package's `linear` is the function)
    clock, calls = [0.0], []

    def side(name, us):
        def fn(t):
            calls.append(name)
            clock[0] += us * 1e-6
            return t * 2

        return fn

    monkeypatch.setattr(lin.time, "perf_counter", lambda: clock[0])
    x = torch.randn(3, 5)
    monkeypatch.setattr(lin, "SMALL_TRIALS", {})
    assert lin._small_class("key", side("own", own_us), side("theirs", theirs_us), (x,), True) == (
        -2 if on_torch else -1)
    rounds = [tuple(calls[i:i + 2]) for i in range(0, len(calls), 2)]
    assert len(rounds) == lin._SMALL_ROUNDS + 1
    assert rounds[::2] == [("theirs", "own")] * len(rounds[::2]) and rounds[1::2] == [("own", "theirs")] * len(
        rounds[1::2])
