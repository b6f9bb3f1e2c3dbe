"""Every test draws its random inputs from a seed of its own (a hash of its
id), so a failure reproduces on the next run instead of coming and going.

Two tiers (pytest markers, not file lists): `make test` runs the tests not
marked ``slow``, with ``torch.compile`` on the ``aot_eager`` backend, where
what a compile test checks is opforge's part (fake kernels, the graph staying
whole, autograd and autocast wiring) rather than inductor's code generation;
`make test-full` (OPFORGE_TEST_FULL=1) runs every test, compiling with
inductor as a user's ``torch.compile`` does. A test that needs inductor itself
(its generated code, AOTInductor) is marked slow or asks for its backend."""

import functools
import os
import zlib

import pytest
import torch

FULL = os.environ.get("OPFORGE_TEST_FULL") == "1"

# The tests check opforge's own kernels and plans (bitwise results at every thread count among
# them): products stay on them unless a run asks for torch's GEMM (OPFORGE_GEMM=torch, a second
# pass over the GEMM tests in `make test`) or a test sets the provider itself (test_gemm_provider.py).
os.environ.setdefault("OPFORGE_GEMM", "own")

if not FULL:
    _torch_compile = torch.compile

    @functools.wraps(_torch_compile)
    def _compile_aot_eager(model=None, **kwargs):
        kwargs.setdefault("backend", "aot_eager")
        return _torch_compile(**kwargs) if model is None else _torch_compile(model, **kwargs)

    torch.compile = _compile_aot_eager


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
