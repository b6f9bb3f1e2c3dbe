"""The private torch internals opforge uses (python/opforge/_torch_private.py),
each taken away or made to raise: the ops still give the right values and
gradients, through the public fallback paths.

Names are hidden from opforge's view of torch (the module's _torch, _C and
_forward_ad), not deleted from torch, whose own public functions use them.
Internals read while the ops are wired are hidden before opforge is imported,
all at once, in a subprocess; the others here, one at a time."""

import os
import subprocess
import sys

import pytest
import torch

import opforge
from opforge import _torch_private as private
from opforge._lib import op_function


def _raise(*args, **kwargs):
    raise RuntimeError("internal changed")


class Hiding:
    """A module as a newer torch might have it: `hidden` names missing, `raising` ones raising."""

    def __init__(self, module, hidden=(), raising=()):
        self._module, self._hidden, self._raising = module, set(hidden), set(raising)

    def __getattr__(self, name):
        if name in self._hidden:
            raise AttributeError(name)
        if name in self._raising:
            return _raise
        return getattr(self._module, name)


def hide(monkeypatch, where, name, how="missing"):
    module = getattr(private, where)
    monkeypatch.setattr(private, where, Hiding(module, **{"hidden" if how == "missing" else "raising": [name]}))


def _ref_linear(x, w, b):
    return torch.nn.functional.gelu(x @ w.T + b)


def _linear_grads(retain=False):
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 3, dtype=torch.float64)
    out = opforge.linear(x, w, b, "gelu")
    torch.testing.assert_close(out, _ref_linear(x, w, b))
    got = torch.autograd.grad(out, (x, w, b), g, retain_graph=retain)
    want = torch.autograd.grad(_ref_linear(x, w, b), (x, w, b), g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def _dispersion_value_and_grad(fn=opforge.dispersion_correction):
    x = (torch.rand(4, 6, dtype=torch.float64) + 0.5).requires_grad_()
    out = fn(x, 0.7)
    torch.testing.assert_close(out, x * 0.7 + x.sqrt())
    (gx,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(gx, 0.7 + 0.5 / x.detach().sqrt())
    with torch.no_grad():
        torch.testing.assert_close(fn(x, 0.7), x * 0.7 + x.sqrt())


@pytest.mark.parametrize("internal", ["_storage_Use_Count", "_autograd._get_current_graph_task_keep_graph"])
def test_no_donation_without_use_counts(monkeypatch, internal):
    if internal.startswith("_autograd."):
        autograd = Hiding(torch._C._autograd, hidden=[internal.partition(".")[2]])
        monkeypatch.setattr(private, "_C", Hiding(torch._C, hidden=[]))
        monkeypatch.setattr(private._C, "_autograd", autograd, raising=False)
    else:
        hide(monkeypatch, "_C", internal)
    _linear_grads()


def test_no_donation_when_use_count_raises(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "_use_count", _raise, raising=False)
    _linear_grads()


def test_may_donate_false_without_clearing():
    class Ctx:  # a node without maybe_clear_saved_tensors
        pass

    assert private.may_donate(Ctx(), [torch.zeros(3)], 0) is False


def test_donation_still_taken_when_available():
    calls = []
    real = private.may_donate

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    try:
        private.may_donate = spy
        _linear_grads()
        _linear_grads(retain=True)
    finally:
        private.may_donate = real
    assert calls == [True, False]


@pytest.mark.parametrize("name", ["_dispatch_tls_is_dispatch_key_excluded", "_dispatch_tls_set_dispatch_key_excluded"])
@pytest.mark.parametrize("how", ["missing", "raises"])
def test_tls_fallback_calls_op_normally(monkeypatch, name, how):
    hide(monkeypatch, "_C", name, how)
    assert private.autograd_tls() is None
    monkeypatch.setattr(private, "_tls", None)  # the backward's below-autograd call
    fn = op_function(torch.ops.opforge.dispersion_correction.default)(lambda x, alpha: None)
    _dispersion_value_and_grad(fn)
    _linear_grads()


def test_op_entry_without_op_attribute():
    class Overload:
        def __call__(self, *args):
            return "called"

    assert private.op_entry(Overload())() == "called"


@pytest.mark.parametrize("name", ["_is_any_autocast_enabled", "_len_torch_function_stack", "_len_torch_dispatch_stack",
                                  "_get_tracing_state", "_dispatch_tls_is_dispatch_key_excluded"])
@pytest.mark.parametrize("how", ["missing", "raises"])
def test_eager_calls_take_the_dispatcher_without_the_checks(monkeypatch, name, how):
    # the direct entry into an op's autograd.Function needs to know that nothing could act at or above the
    # autograd key; without a piece to tell, every call goes through the dispatcher as before
    hide(monkeypatch, "_C", name, how)
    if name == "_get_tracing_state":  # read by op_function's own check before the direct entry's
        assert private.jit_tracing()() is False
    elif how == "missing":
        tls = private.autograd_tls()
        assert private.plain_eager_check(tls[0] if tls else None) is None
    fn = op_function(torch.ops.opforge.dispersion_correction.default)(lambda x, alpha: None)
    _dispersion_value_and_grad(fn)


@pytest.mark.parametrize("name", ["_AutoDispatchBelowAutograd", "_after_autograd_keyset"])
def test_redispatch_below_autograd_without_guard(monkeypatch, name):
    hide(monkeypatch, "_C", name)
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU).add(torch._C.DispatchKey.AutogradCPU)
    x, g = torch.rand(3, 4) + 0.5, torch.randn(3, 4, requires_grad=True)
    out = private.redispatch_below_autograd(torch.ops.opforge.dispersion_correction_backward.default, keys, (g, x, 0.7), {})
    assert out.grad_fn is None
    torch.testing.assert_close(out, g.detach() * 0.7 + g.detach() / (2 * x.sqrt()))


def test_forward_ad_level_unknown_is_the_safe_side(monkeypatch):
    hide(monkeypatch, "_forward_ad", "_current_level")
    assert private.forward_ad_active()
    _dispersion_value_and_grad()


@pytest.mark.parametrize("how", ["missing", "raises"])
def test_functorch_peek_fallback(monkeypatch, how):
    monkeypatch.setattr(private, "_C", Hiding(torch._C))
    functorch = Hiding(torch._C._functorch, **{"hidden" if how == "missing" else "raising": ["peek_interpreter_stack"]})
    monkeypatch.setattr(private._C, "_functorch", functorch, raising=False)
    assert private.functorch_transform() is None
    _dispersion_value_and_grad()


def test_functorch_transform_named():
    seen = []
    torch.func.grad(lambda x: seen.append(private.functorch_transform()) or x.sum())(torch.ones(2))
    assert seen == ["grad"]


@pytest.mark.parametrize("name", ["_dispatch_key_for_device", "_ExcludeDispatchKeyGuard"])
def test_autocast_fallbacks(monkeypatch, name):
    hide(monkeypatch, "_C", name)
    assert private.autocast_key_name("cpu") == "AutocastCPU"
    x = torch.rand(4, 6) + 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with private.autocast_excluded("cpu", "AutocastCPU"):
            out = torch.ops.opforge.dispersion_correction(x, 0.7)
    assert out.dtype == torch.float32  # autocast's kernel not entered: no cast
    torch.testing.assert_close(out, x * 0.7 + x.sqrt())


def test_python_dispatcher_kernel_fallback():
    class Overload:  # an op without py_impl / py_kernels
        pass

    private.set_python_dispatcher_kernel(Overload(), "AutocastCPU", lambda *a: None)


def test_fake_mode_exit_missing(monkeypatch):
    hide(monkeypatch, "_torch", "_subclasses")
    assert private.fake_mode_exit() is None
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.opforge.linear(torch.empty(5, 7), torch.empty(3, 7), None, "none", False)[0]
    assert out.shape == (5, 3)


def test_lean_autograd_kernel_restores_dropped_defaults():
    # the dispatcher leaves out trailing arguments equal to their defaults (linear's save_preact=True);
    # setup_context still sees every input, so the backward finds the saved pre-activation
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    out = torch.ops.opforge.linear(x, w, None, "relu")[0]  # save_preact omitted
    gx, gw = torch.autograd.grad(out.square().sum(), (x, w))
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    want = torch.autograd.grad(torch.relu(xr @ wr.T).square().sum(), (xr, wr))
    torch.testing.assert_close((gx, gw), want)


def test_lean_autograd_kernel_declines_what_it_does_not_serve():
    # a mutable (in-place) op is left to torch's own kernel; so is an op once a piece is missing
    assert private.lean_autograd_kernel(torch.ops.opforge.linear_backward_.default, None, None) is None
    assert private.lean_autograd_kernel(torch.ops.opforge.dispersion_correction.default, None, None) is not None


def test_lean_autograd_kernel_missing_piece(monkeypatch):
    hide(monkeypatch, "_C", "_any_requires_grad")
    assert private.lean_autograd_kernel(torch.ops.opforge.dispersion_correction.default, None, None) is None
    op = torch.ops.opforge.dispersion_correction.default
    kernel = private.autograd_kernel("opforge::dispersion_correction", op, lambda ctx, g: g, lambda ctx, i, o: None)
    assert callable(kernel)  # torch's generated kernel instead


def test_autograd_kernel_from_public_registration(monkeypatch):
    hide(monkeypatch, "_torch", "_library")
    hide(monkeypatch, "_C", "_AutoDispatchBelowAutograd")
    op = torch.ops.opforge.dispersion_correction.default
    kernel = private.autograd_kernel("opforge::dispersion_correction", op, lambda ctx, g: g, lambda ctx, i, o: None)
    assert callable(kernel)


_HIDE_ALL = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("opforge._torch_private", PRIVATE)
private = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = private  # loaded before the package, so its wiring sees the hidden names
spec.loader.exec_module(private)
from test_torch_private import Hiding
C = Hiding(torch._C, hidden=["_dispatch_tls_is_dispatch_key_excluded", "_dispatch_tls_set_dispatch_key_excluded",
                              "_storage_Use_Count", "_dispatch_key_for_device", "_AutoDispatchBelowAutograd",
                              "_after_autograd_keyset", "_ExcludeDispatchKeyGuard", "_autograd", "_functorch",
                              "_is_any_autocast_enabled"])
private._C, private._torch = C, Hiding(torch, hidden=["_library", "_subclasses"])
private._forward_ad = Hiding(torch.autograd.forward_ad, hidden=["_current_level"])
private._tls = private.autograd_tls()
assert private._tls is None
torch.Tensor._use_count = None
"""

_CHECK = """
import opforge
assert opforge._lib._private is private
from test_torch_private import _dispersion_value_and_grad, _linear_grads
_dispersion_value_and_grad()
_linear_grads()
_linear_grads(retain=True)
a, b = torch.randn(4, 5, dtype=torch.float64, requires_grad=True), torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
torch.autograd.gradcheck(opforge.matmul, (a, b))
q, k, v = (torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
torch.autograd.gradcheck(opforge.scaled_dot_product_attention, (q, k, v))
x, w = torch.rand(4, 6), torch.rand(3, 6)
with torch.autocast("cpu", dtype=torch.bfloat16):  # linear's policy: the autocast dtype
    assert opforge.linear(x, w).dtype == torch.bfloat16
print("ok")
"""


def test_every_internal_missing_at_once():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    prelude = f"PRIVATE = {private.__file__!r}\n"
    run = subprocess.run([sys.executable, "-c", prelude + _HIDE_ALL + _CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
