"""Builds opforge's op library (C only) with the system C compiler.

Build without isolation so that the torch already installed is linked
(an isolated build would download another torch):
    pip install --no-build-isolation -e .

The CUDA library (libopforge_cuda.so, the ops' CUDA kernels) is built too when
nvcc is found, or always with OPFORGE_CUDA=1 (a missing nvcc is then an error);
OPFORGE_CUDA=0 leaves it out. It loads only where torch has CUDA and a GPU.

OPFORGE_NAMESPACE=acme_ops_1a2b registers the ops as torch.ops.acme_ops_1a2b
instead of torch.ops.opforge (a distribution needing a namespace of its own).
"""

import glob
import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("_opforge_build", os.path.join(ROOT, "python/opforge/_build.py"))
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)

LIBRARY_SOURCES = sorted(
    glob.glob("csrc/runtime/*.c") + glob.glob("csrc/kernels/*.c") + glob.glob("csrc/torch/*.c")
)

CUDA_C_SOURCES = sorted(glob.glob("csrc/cuda/*.c"))
CUDA_CU_SOURCES = sorted(glob.glob("csrc/cuda/*.cu"))


def want_cuda() -> bool:
    flag = os.environ.get("OPFORGE_CUDA", "")
    if flag == "0":
        return False
    if flag == "1":
        return True
    found = _build.nvcc() is not None
    print(f"opforge: {'building' if found else 'not building'} the CUDA library "
          f"({'nvcc found' if found else 'no nvcc found; OPFORGE_CUDA=1 makes it an error'})")
    return found


class BuildOpLibrary(build_ext):
    """Compiles each C file with its own ISA flags and links libopforge.so (and libopforge_cuda.so)."""

    def get_ext_filename(self, fullname):
        return os.path.join(*fullname.split(".")[:-1], fullname.split(".")[-1] + ".so")

    def build_extension(self, ext):
        try:
            import torch  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                "opforge links the installed torch: install torch>=2.10 first and build with "
                "`pip install --no-build-isolation .`"
            ) from e
        if ext.name.endswith("_cuda"):
            if os.environ.get("OPFORGE_CUDA") == "1":
                print("opforge: building the CUDA library (OPFORGE_CUDA=1)")
            _build.build_cuda_library(
                [os.path.join(ROOT, s) for s in CUDA_C_SOURCES],
                [os.path.join(ROOT, s) for s in CUDA_CU_SOURCES],
                self.get_ext_fullpath(ext.name),
                include_dirs=[os.path.join(ROOT, "csrc/include")],
                build_dir=os.path.join(ROOT, "build", "obj"),
                extra_cflags=_build.namespace_flags(os.environ.get("OPFORGE_NAMESPACE")),
                verbose=self.verbose > 1,
                runtime_dir=None,
                link_dir=os.path.dirname(self.get_ext_fullpath("opforge.libopforge")),
            )
            return
        _build.build_library(
            [os.path.join(ROOT, s) for s in ext.sources],
            self.get_ext_fullpath(ext.name),
            include_dirs=[os.path.join(ROOT, "csrc/include")],
            # the object cache the C tests share (make test): a file is compiled once for both
            build_dir=os.path.join(ROOT, "build", "obj"),
            extra_cflags=_build.namespace_flags(os.environ.get("OPFORGE_NAMESPACE")),
            verbose=self.verbose > 1,
        )


class BuildPyWithHeaders(build_py):
    """Ships csrc/include in the package: opforge.load compiles user ops against it."""

    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "opforge", "include", "opforge")
        os.makedirs(dest, exist_ok=True)
        for header in glob.glob(os.path.join(ROOT, "csrc/include/opforge/*.h")) + glob.glob(
            os.path.join(ROOT, "csrc/include/opforge/*.cuh")
        ):
            self.copy_file(header, os.path.join(dest, os.path.basename(header)))


EXTENSIONS = [Extension("opforge.libopforge", sources=LIBRARY_SOURCES)]
if want_cuda():
    EXTENSIONS.append(Extension("opforge.libopforge_cuda", sources=CUDA_C_SOURCES + CUDA_CU_SOURCES))

setup(
    ext_modules=EXTENSIONS,
    cmdclass={"build_ext": BuildOpLibrary, "build_py": BuildPyWithHeaders},
)
