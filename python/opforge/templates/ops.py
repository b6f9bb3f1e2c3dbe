"""Builds (once; cached) and loads the {name} op library: torch.ops.{name}.*"""

import os

import opforge
import opforge.build

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(HERE, "{name}.c"), os.path.join(HERE, "{name}_avx2.c")]
# the CUDA kernels (opforge new --cuda), where nvcc can build them: the op then runs on GPU tensors too
CUDA = os.path.join(HERE, "{name}.cu")
if os.path.exists(CUDA) and opforge.build.have_nvcc():
    SOURCES.append(CUDA)
library = opforge.load("{name}", SOURCES)

# Python functions calling the ops (torch.ops.{name}.* are the same ops; these
# skip the autograd kernel's Python round trip when no input requires grad)
{name} = library.{name}
{name}_backward = library.{name}_backward
