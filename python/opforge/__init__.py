"""opforge: PyTorch operators written in plain C.

    import opforge
    y = opforge.dispersion_correction(x, 0.8)          # torch.ops.opforge.dispersion_correction
    opforge.ops.dispersion_correction(x, 0.8)          # the same op, under the namespace built in
"""

from ._runtime import (cpu_features, get_isa, isa_best, kernel_variants, library, namespace, ops, set_isa, set_log_file,
                       set_log_level, supported_isas)
from . import functional, nn
from .build import BuildError, load, load_library
from .functional import dispersion_correction, linear, matmul, scaled_dot_product_attention
from .hf import patch_hf
from .patch import PatchReport, patch

__version__ = "0.1.0"

__all__ = [
    "BuildError",
    "cpu_features",
    "dispersion_correction",
    "functional",
    "get_isa",
    "isa_best",
    "kernel_variants",
    "library",
    "linear",
    "load",
    "load_library",
    "matmul",
    "namespace",
    "nn",
    "ops",
    "patch",
    "patch_hf",
    "PatchReport",
    "scaled_dot_product_attention",
    "set_isa",
    "set_log_file",
    "set_log_level",
    "supported_isas",
]

from .functional import add_rms_norm, layer_norm, rms_norm  # noqa: E402

__all__ += ["add_rms_norm", "layer_norm", "rms_norm"]
