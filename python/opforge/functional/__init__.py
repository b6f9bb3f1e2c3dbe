"""opforge's ops, called like ``torch.nn.functional``.

Each function is the registered ``torch.ops.opforge.<op>`` (``opforge.ops``,
the namespace being a build parameter): autograd,
``torch.compile(fullgraph=True)``, autocast and the profiler work on it.

One module per op stem (the stem of its ``csrc/torch/<op>.c``) defines its
functions and lists them in its ``__all__``; this package imports every
module it holds and re-exports those names, so a new op is a new file here.

Autocast: each op's policy is its descriptor's ``.autocast`` (registered for
AutocastCPU and AutocastCUDA alike), and each function's docstring names its
policy. Under ``torch.autocast("cpu", dtype=torch.bfloat16 / torch.float16)``
each returns the dtype its torch twin returns (tests/python/test_training.py
checks every op):

========  ============================================================  ==========================================
policy    the op runs in and returns                                    as torch's
========  ============================================================  ==========================================
lower     the autocast dtype                                            F.linear, torch.matmul,
                                                                        F.scaled_dot_product_attention
fp32      float32                                                       F.cross_entropy
promote   the widest floating input (16-bit stays 16-bit, with a        eager elementwise ops
          float32 one: float32)
none      the dtype it is given                                         F.softmax, F.log_softmax
follow    the first tensor input's dtype: float32 parameters (the       F.rms_norm, F.layer_norm (float32
          optional tensors) are cast to a 16-bit one                    parameters beside 16-bit activations)
========  ============================================================  ==========================================

float64 tensors are never cast, as torch's autocast leaves them. Gradients
come back in each input's own dtype (the casts are in the graph). The table is
torch's CPU autocast; its CUDA autocast runs softmax, log_softmax and
layer_norm in float32, which opforge's one policy per op does not (no op has a
CUDA kernel yet).
"""

from .._discover import op_modules, reexport

__all__ = reexport(globals(), op_modules(__name__, __path__))
