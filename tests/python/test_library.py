"""The op library itself: C only, stable ABI, version gate, descriptors."""

import os
import shutil
import subprocess

import pytest
import torch

import opforge
from opforge import _lib

LIB = os.path.join(os.path.dirname(opforge.__file__), "libopforge.so")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf not installed")
def test_library_needs_no_libstdcxx():
    needed = subprocess.run(["readelf", "-d", LIB], capture_output=True, text=True, check=True).stdout
    assert "libtorch_cpu" in needed
    assert "libstdc++" not in needed, needed


def test_sources_are_c_only():
    cxx = [
        os.path.join(d, f)
        for d, _, files in os.walk(os.path.join(ROOT, "csrc"))
        for f in files
        if f.endswith((".cpp", ".cc", ".cxx", ".hpp"))
    ]
    assert cxx == []


def test_old_torch_is_refused_with_the_minimum_version(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.9.1+cpu")
    with pytest.raises(ImportError, match=r"opforge needs torch >= 2\.10.*this is torch 2\.9\.1"):
        _lib.check_torch_version()


def test_descriptors_are_read_from_c():
    ops = {d.name: d for d in opforge.library.ops}
    fwd = ops["dispersion_correction"]
    assert fwd.schema == "dispersion_correction(Tensor x, float alpha) -> Tensor"
    assert fwd.devices == ("cpu",)
    assert fwd.backward == "dispersion_correction_backward"
    assert fwd.backward_args == ("grad0", "x", "alpha") and fwd.backward_grads == ("x",)
    assert fwd.autocast == _lib.AUTOCAST_PROMOTE
    assert ops["dispersion_correction_backward"].backward is None


def test_ops_are_tagged_pt2_compliant():
    assert torch.Tag.pt2_compliant_tag in torch.ops.opforge.dispersion_correction.default.tags


def test_output_strides_twin_matches_the_c_rule():
    # the fake kernel's Python twin of opf_output_strides, on the cases the C tests use
    assert _lib.output_strides([13, 7], [1, 13]) == [1, 13]
    assert _lib.output_strides([7, 13], [20, 1]) == [13, 1]
    assert _lib.output_strides([5, 4], [0, 1]) == [4, 1]
    assert _lib.output_strides([0, 4], [4, 1]) == [4, 1]
    assert _lib.output_strides([2, 1, 3], [1, 99, 2]) == [1, 99, 2]


def test_flop_estimates_reach_the_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(256, 128, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        opforge.linear(x, w, None, "gelu").sum().backward()
        opforge.dispersion_correction(torch.rand(1000), 0.5)
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert counts["opforge.linear"] == 2 * 64 * 128 * 256
    # the backward that may overwrite the saved pre-activation (linear_backward_) counts alike
    assert counts.get("opforge.linear_backward", 0) + counts.get("opforge.linear_backward_", 0) == 4 * 64 * 128 * 256
    assert counts["opforge.dispersion_correction"] == 3 * 1000
