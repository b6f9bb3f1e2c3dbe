"""Builds (once; cached) and loads the {name} op library: torch.ops.{name}.*"""

import os

import opforge

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(HERE, f) for f in ("{name}.c", "{name}_avx2.c", "{name}_avx512.c")]
library = opforge.load("{name}", SOURCES)

# Python functions calling the ops (torch.ops.{name}.* are the same ops; these
# skip the autograd kernel's Python round trip when no input requires grad)
{name} = library.{name}
