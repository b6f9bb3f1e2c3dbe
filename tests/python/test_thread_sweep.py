"""Every op on empty and tiny shapes (each dim 0 in turn, 1, small odd sizes; grouped-query head
counts down to 0; GEMM-based ops with M, N and K each 0 and 1), forward and backward, float32,
bfloat16 and float64, at torch.set_num_threads(t) for t in THREADS and on every ISA this CPU runs.

Why: plans over threads (workers per task count, split-K, decode chunks, GEMM plans, row chunks,
grain sizes) divide by counts that an empty dim can make 0, and some plans depend on the thread
count: a division by zero is a SIGFPE that kills the whole run (test_attention's empty-head shapes
died so on a 16-core Xeon). 64 threads on a small machine plans as a large one does. The
references here are written out (no torch SDPA: its CPU flash kernel itself divides by zero on
empty heads, queries or keys).

Each result is compared with the float64 PyTorch reference on the same (rounded) inputs: exactly
where the reference is empty or all zeros (no key, no class, K = 0), within the dtype's tolerance
otherwise; and, per ISA, bit for bit across thread counts (README, Determinism: every op, forward
and backward, gives the same bits at any thread count).

The standalone pthread backend is not reachable from Python (the glue always installs torch's
pool): tests/c/test_sweep.c sweeps it through OPFORGE_NUM_THREADS.

The cases are each op's, in the SWEEP table of its test module (tests/python/discover.py): op ->
a function giving its list of thread_sweep.Case; ops that share a function (a family: the norms,
softmax and log_softmax) share its cases. thread_sweep.py holds the machinery.
"""

from __future__ import annotations

import pytest
import torch

import discover
import opforge
import thread_sweep
from thread_sweep import BF16, F32


@pytest.fixture(autouse=True)
def _restore_threads_and_isa():
    threads, isa = torch.get_num_threads(), opforge.get_isa()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        opforge.set_isa("auto" if isa == opforge.isa_best() else isa)


def _cases() -> list[thread_sweep.Case]:
    """Every op's cases; a function several ops share runs once."""
    makers = list({id(f): f for f in discover.entries("SWEEP").values()}.values())
    return [case for make in makers for case in make()]


def test_every_registered_op_is_swept():
    """A new op gets a sweep: every forward op of the library is a key of some test module's SWEEP."""
    msg = discover.coverage("SWEEP", discover.entries("SWEEP"))
    assert msg is None, msg


def _dtypes(case):
    """The case's dtypes; float32 and bfloat16 alone for the wide shapes that split over threads (the
    plans are the same for float64, the time is not)."""
    wide = max((a.numel() for a in case.make(F32) if isinstance(a, torch.Tensor)), default=0) > 4096
    return (F32, BF16) if wide else case.dtypes


PARAMS = [pytest.param(case, dtype, id=f"{case.label} {str(dtype)[6:]}") for case in _cases() for dtype in _dtypes(case)]


@pytest.mark.slow
@pytest.mark.parametrize("case, dtype", PARAMS)
def test_sweep(case, dtype):
    thread_sweep.sweep(case, dtype)
