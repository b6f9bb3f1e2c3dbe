"""opforge: PyTorch operators written in plain C.

    import opforge
    y = opforge.dispersion_correction(x, 0.8)          # torch.ops.opforge.dispersion_correction
    opforge.ops.dispersion_correction(x, 0.8)          # the same op, under the namespace built in
"""

from ._runtime import (cpu_features, get_isa, isa_best, kernel_variants, library, namespace, ops, set_isa, set_log_file,
                       set_log_level, supported_isas)
from . import functional, nn
from .aoti import aoti_config
from .build import BuildError, load, load_library
from .functional import (add_rms_norm, attention_decode, cross_entropy, dispersion_correction, geglu, layer_norm, linear,
                         linear_cross_entropy, log_softmax, matmul, rms_norm, rope, scaled_dot_product_attention,
                         softmax, swiglu)
from .hf import patch_hf
from .patch import PatchReport, patch

__version__ = "0.1.0"

__all__ = [
    "add_rms_norm",
    "aoti_config",
    "attention_decode",
    "BuildError",
    "cpu_features",
    "cross_entropy",
    "dispersion_correction",
    "functional",
    "geglu",
    "get_isa",
    "isa_best",
    "kernel_variants",
    "layer_norm",
    "library",
    "linear",
    "linear_cross_entropy",
    "load",
    "load_library",
    "log_softmax",
    "matmul",
    "namespace",
    "nn",
    "ops",
    "patch",
    "patch_hf",
    "PatchReport",
    "rms_norm",
    "rope",
    "scaled_dot_product_attention",
    "set_isa",
    "set_log_file",
    "set_log_level",
    "softmax",
    "supported_isas",
    "swiglu",
]
