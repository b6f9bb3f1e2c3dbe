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

__all__ = ["BuildError", "BuildExtension", "CExtension", "cache_dir", "load", "load_library"]

_loaded: dict[str, tuple[str, OpLibrary]] = {}  # namespace -> (build key, library)
_lock = threading.Lock()


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


def _build_key(name: str, sources: list[str], extra_cflags: list[str]) -> str:
    from . import __version__

    h = hashlib.sha256()
    parts = [name, __version__, torch.__version__, _compiler_id(), " ".join(_build.CFLAGS), " ".join(extra_cflags)]
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
        if not s.endswith(".c"):
            raise ValueError(f"[opforge.load] sources must be C files (.c), got {s}")
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
                _build.build_library(
                    sources,
                    tmp_lib,
                    include_dirs=[_build.include_dir()] + sorted({os.path.dirname(s) for s in sources}),
                    build_dir=os.path.join(tmp, "obj"),
                    extra_cflags=flags,
                    verbose=verbose,
                    link_runtime=True,
                )
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
        _build.build_library(
            [os.path.abspath(s) for s in ext.sources],
            self.get_ext_fullpath(ext.name),
            include_dirs=[_build.include_dir()] + list(ext.include_dirs or []),
            build_dir=os.path.join(self.build_temp, ext.name),
            extra_cflags=ext.extra_cflags,
            verbose=self.verbose > 1,
            link_runtime=True,
        )
