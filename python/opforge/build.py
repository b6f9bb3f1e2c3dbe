"""Building and loading user op libraries written in C.

    import opforge
    lib = opforge.load("myops", ["myop.c"])      # compiled once, cached, registered
    torch.ops.myops.myop(x, 0.5)

Ahead of time, in a setup.py:

    from opforge.build import BuildExtension, CExtension
    setup(ext_modules=[CExtension("mypkg.myops", ["csrc/myop.c"])],
          cmdclass={"build_ext": BuildExtension})
    # at run time: opforge.load_library(<path of mypkg/libmyops.so>, "myops")
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import tempfile
import threading

import torch

from . import _build
from ._build import BuildError
from ._lib import OpLibrary
from ._runtime import library as _runtime

__all__ = ["BuildError", "BuildExtension", "CExtension", "cache_dir", "have_nvcc", "load", "load_library"]

_loaded: dict[str, tuple[str, OpLibrary]] = {}  # namespace -> (build key, library)
_lock = threading.Lock()


def have_nvcc() -> bool:
    """Whether .cu sources can be built here (nvcc on the PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin)."""
    return _build.nvcc() is not None


def cache_dir() -> str:
    """Where built libraries are kept: $OPFORGE_CACHE_DIR or ~/.cache/opforge."""
    return os.environ.get("OPFORGE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "opforge"
    )


@functools.lru_cache(maxsize=None)
def _compiler_id() -> str:
    cc = _build.compiler()
    out = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()
    return f"{cc} {out[0] if out else ''}"


@functools.lru_cache(maxsize=None)
def _nvcc_id() -> str:
    nvcc = _build.nvcc()
    if nvcc is None:
        return ""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.splitlines()
    return f"{nvcc} {out[-1] if out else ''} {' '.join(_build.NVCCFLAGS + _build.CUDA_ARCHS)}"


def _link(sources: list[str], output: str, include_dirs: list[str], build_dir: str, extra_cflags: list[str],
          verbose: bool) -> None:
    """A user op library: C files only, or C and CUDA (.cu) files, which nvcc compiles and whose glue
    (opforge/cuda.h) the library links with the CUDA runtime."""
    cu = [s for s in sources if s.endswith(".cu")]
    if not cu:
        _build.build_library(sources, output, include_dirs=include_dirs, build_dir=build_dir,
                             extra_cflags=extra_cflags, verbose=verbose, link_runtime=True)
        return
    _build.build_cuda_library([s for s in sources if s.endswith(".c")], cu, output, include_dirs=include_dirs,
                              build_dir=build_dir, extra_cflags=["-DOPF_WITH_CUDA", *extra_cflags],
                              verbose=verbose, runtime_dir=_build.PACKAGE_DIR)


def _build_key(name: str, sources: list[str], extra_cflags: list[str]) -> str:
    from . import __version__

    h = hashlib.sha256()
    parts = [name, __version__, torch.__version__, _compiler_id(), " ".join(_build.CFLAGS), " ".join(extra_cflags)]
    if any(s.endswith(".cu") for s in sources):
        parts.append(_nvcc_id())
    for part in parts:
        h.update(part.encode() + b"\0")
    headers = os.path.join(_build.include_dir(), "opforge")
    for path in sorted(os.path.join(headers, f) for f in os.listdir(headers)) + sources:
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:20]


def load(name: str, sources: list[str] | str, extra_cflags: list[str] | None = None, verbose: bool = False) -> OpLibrary:
    """Compiles C sources into an op library, loads it and registers its ops as
    ``torch.ops.<name>.*`` with autograd, fake kernels and autocast wired from
    their descriptors.

    ``.cu`` files are CUDA kernels (C-style CUDA, opforge/cuda_kernel.cuh), compiled with nvcc; the
    C sources are then built with ``-DOPF_WITH_CUDA`` (so that a descriptor can name its ``.cuda``
    kernel only when its .cu file is built) and the library links the CUDA runtime statically.

    The library is cached under ``cache_dir()``, keyed by the sources, the
    flags, the compiler, torch's and opforge's versions and opforge's headers:
    a second call (in this process or another) does not compile. Files named
    ``*_avx2.c`` / ``*_avx512.c`` are built for that ISA only. Raises
    ``BuildError`` with the compiler's messages (file:line) when a file does
    not compile.
    """
    if not name.isidentifier():
        raise ValueError(f"[opforge.load] name must be a Python identifier (it becomes torch.ops.<name>), got {name!r}")
    sources = [os.path.abspath(s) for s in ([sources] if isinstance(sources, str) else sources)]
    for s in sources:
        if not os.path.isfile(s):
            raise FileNotFoundError(f"[opforge.load] source file {s} does not exist")
        if not s.endswith((".c", ".cu")):
            raise ValueError(f"[opforge.load] sources must be C files (.c) or CUDA C files (.cu), got {s}")
    if any(s.endswith(".cu") for s in sources) and _build.nvcc() is None:
        raise BuildError("[opforge.load] .cu sources need nvcc (the CUDA toolkit): none found on the PATH, "
                         "in $CUDA_HOME/bin or /usr/local/cuda/bin")
    flags = list(extra_cflags or [])
    with _lock:
        key = _build_key(name, sources, flags)
        if name in _loaded:
            old_key, lib = _loaded[name]
            if old_key == key:
                return lib
            raise RuntimeError(
                f"[opforge.load] namespace '{name}' is already loaded from other sources or flags in this "
                "process; ops cannot be redefined: restart Python or pick another name"
            )
        out_dir = os.path.join(cache_dir(), f"{name}-{key}")
        path = os.path.join(out_dir, f"lib{name}.so")
        if not os.path.exists(path):
            os.makedirs(cache_dir(), exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=f".build-{name}-") as tmp:
                tmp_lib = os.path.join(tmp, f"lib{name}.so")
                _link(sources, tmp_lib, [_build.include_dir()] + sorted({os.path.dirname(s) for s in sources}),
                      os.path.join(tmp, "obj"), flags, verbose)
                os.makedirs(out_dir, exist_ok=True)
                os.replace(tmp_lib, path)  # atomic: a concurrent loader sees all or nothing
        elif verbose:
            print(f"[opforge.load] {name}: cached {path}")
        lib = OpLibrary(path, name, runtime=_runtime)
        _loaded[name] = (key, lib)
        return lib


def load_library(path: str, namespace: str) -> OpLibrary:
    """Loads an op library built ahead of time (CExtension) and registers its ops
    as ``torch.ops.<namespace>.*``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"[opforge.load_library] {path} does not exist (a library built by CExtension, "
                                "lib<name>.so)")
    with _lock:
        if namespace in _loaded:
            return _loaded[namespace][1]
        lib = OpLibrary(path, namespace, runtime=_runtime)
        _loaded[namespace] = (os.path.abspath(path), lib)
        return lib


# ---- setup.py helpers ---------------------------------------------------------------

from setuptools import Extension  # noqa: E402  (setup.py helpers only)
from setuptools.command.build_ext import build_ext  # noqa: E402


class CExtension(Extension):
    """An op library of C sources, built by BuildExtension into
    ``<package>/lib<name>.so`` (name: the last part of the dotted name)."""

    def __init__(self, name: str, sources: list[str], extra_cflags: list[str] | None = None, **kw):
        super().__init__(name, sources, **kw)
        self.extra_cflags = list(extra_cflags or [])


class BuildExtension(build_ext):
    """build_ext for CExtension: the C compiler with opforge's flags, ISA files
    with their own, linked against opforge's runtime and libtorch_cpu."""

    def get_ext_filename(self, fullname):
        parts = fullname.split(".")
        return os.path.join(*parts[:-1], f"lib{parts[-1]}.so")

    def build_extension(self, ext):
        if not isinstance(ext, CExtension):
            return super().build_extension(ext)
        _link([os.path.abspath(s) for s in ext.sources], self.get_ext_fullpath(ext.name),
              [_build.include_dir()] + list(ext.include_dirs or []), os.path.join(self.build_temp, ext.name),
              ext.extra_cflags, self.verbose > 1)
