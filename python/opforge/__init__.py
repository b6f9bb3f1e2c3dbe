"""opforge: PyTorch operators written in plain C.

    import opforge
    y = opforge.dispersion_correction(x, 0.8)          # torch.ops.opforge.dispersion_correction
    opforge.ops.dispersion_correction(x, 0.8)          # the same op, under the namespace built in
"""

from ._runtime import (cpu_features, cuda_library_path, cuda_status, gemm_choices, get_gemm, get_isa, get_pages,
                       isa_best, kernel_variants, library, library_path, namespace, ops, set_gemm, set_isa,
                       set_log_file, set_log_level, set_pages, supported_isas)
from . import functional, nn, optim
from .aoti import aoti_config
from .build import BuildError, load, load_library
from .hf import patch_hf
from .patch import PatchReport, patch

__version__ = "0.1.0"

# the ops, as opforge.functional finds them (its name tables, upper case, stay there)
_ops = [name for name in functional.__all__ if not name.isupper()]
globals().update({name: getattr(functional, name) for name in _ops})

__all__ = [
    "aoti_config",
    "BuildError",
    "cpu_features",
    "cuda_library_path",
    "cuda_status",
    "functional",
    "gemm_choices",
    "get_gemm",
    "get_isa",
    "get_pages",
    "isa_best",
    "kernel_variants",
    "library",
    "library_path",
    "load",
    "load_library",
    "namespace",
    "nn",
    "optim",
    "ops",
    "patch",
    "patch_hf",
    "PatchReport",
    "set_gemm",
    "set_isa",
    "set_log_file",
    "set_log_level",
    "set_pages",
    "supported_isas",
    *_ops,
]
