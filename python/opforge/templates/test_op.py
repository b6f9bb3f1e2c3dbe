"""{name} against its PyTorch reference: values, every ISA variant, gradients,
opcheck, torch.compile, bad input. Run: pytest"""

import pytest
import torch
from torch.library import opcheck

import opforge
import opforge.testing
from ops import {name}, {name}_backward
from reference import {name} as reference

ALPHA = 0.75
SHAPES = [(), (0,), (1,), (7,), (17,), (123,), (4099,), (33, 17), (5, 6, 7)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_values(shape):
    x = torch.randn(shape)
    torch.testing.assert_close({name}(x, ALPHA), reference(x, ALPHA))


@pytest.mark.parametrize("view", ["transposed", "strided", "broadcast"])
def test_strided_inputs(view):
    base = torch.randn(20, 30)
    x = {"transposed": base.t(), "strided": base[:, ::3], "broadcast": base[:1].expand(5, 30)}[view]
    torch.testing.assert_close({name}(x, ALPHA), reference(x, ALPHA))


def test_every_isa_matches_the_reference_kernel():
    x = torch.randn(3, 1001)
    outs = {}
    try:
        for isa in opforge.supported_isas():
            opforge.set_isa(isa)
            outs[isa] = ({name}(x, ALPHA), {name}_backward(torch.randn(3, 1001, generator=torch.Generator().manual_seed(0)), x, ALPHA))
    finally:
        opforge.set_isa("auto")
    for isa, (y, dx) in outs.items():
        torch.testing.assert_close(y, outs["ref"][0], rtol=0, atol=0, msg=f"{isa} forward")
        torch.testing.assert_close(dx, outs["ref"][1], rtol=0, atol=0, msg=f"{isa} backward")


def test_gradient_matches_autograd_of_reference():
    x = torch.randn(33, 17, requires_grad=True)
    g = torch.randn(33, 17)
    {name}(x, ALPHA).backward(g)
    xr = x.detach().clone().requires_grad_()
    reference(xr, ALPHA).backward(g)
    torch.testing.assert_close(x.grad, xr.grad)


def test_check_report_passes():
    report = opforge.testing.check(torch.ops.{name}.{name}, reference, dtypes=[torch.float32])
    print(report)
    assert report.passed


@pytest.mark.parametrize("x", [torch.randn(7, 13), torch.randn(5, 6).t(), torch.randn(())], ids=["2d", "t", "0d"])
def test_opcheck(x):
    op, backward = torch.ops.{name}.{name}.default, torch.ops.{name}.{name}_backward.default
    opcheck(op, (x, ALPHA))
    opcheck(op, (x.clone().requires_grad_(), ALPHA))
    opcheck(backward, (torch.randn_like(x), x, ALPHA))


def test_compile_fullgraph():
    f = torch.compile(lambda t: {name}(t, ALPHA).sin(), fullgraph=True)
    x = torch.randn(16, 8, requires_grad=True)
    f(x).sum().backward()
    xr = x.detach().clone().requires_grad_()
    reference(xr, ALPHA).sin().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)


def test_bad_input_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"\[{name}::{name}\] argument 'x' must be float32, got float64"):
        {name}(torch.randn(3, dtype=torch.float64), ALPHA)
    with pytest.raises(RuntimeError, match=r"argument 'x' must be a floating-point tensor"):
        {name}(torch.ones(3, dtype=torch.int64), ALPHA)
