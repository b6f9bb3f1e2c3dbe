"""Builds opforge's C tests and op library with AddressSanitizer and
UndefinedBehaviorSanitizer, through python/opforge/_build.py so each file gets
the flags (and ISA flags) of the shipped build, plus the sanitizers'.

    python tests/sanitize.py test OUTPUT SOURCES... -I DIR [-D DEFINE]   a C test binary
    python tests/sanitize.py library DIR     a copy of the python package in DIR/opforge with a sanitized libopforge.so
    python tests/sanitize.py runtime         the sanitizer runtimes to LD_PRELOAD into python

A sanitized library loads into an uninstrumented python only when the ASan
runtime comes first in the process (LD_PRELOAD); the library leaves the
sanitizer symbols to it (it is linked as _build links the shipped one).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("_opforge_build", os.path.join(ROOT, "python/opforge/_build.py"))
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)

# -O1 after the shipped -O3: reports name the right lines; any UB stops the program
# one object cache for the sanitized tests and library: a file is compiled once for all of them
OBJECTS = os.path.join(ROOT, "build", "asan", "obj")
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-O1", "-g"]


def runtime() -> list[str]:
    cc = _build.compiler()
    libs = []
    for name in ("libasan.so", "libubsan.so"):
        path = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if not os.path.isabs(path):
            raise _build.BuildError(f"{cc} has no {name}: install the sanitizer runtimes "
                                    "(apt-get install libasan8 libubsan1)")
        libs.append(path)
    return libs


def build_test(output: str, sources: list[str], include: list[str], defines: list[str]) -> None:
    objs, _ = _build.compile_objects(sources, include, OBJECTS, SANITIZE + [f"-D{d}" for d in defines])
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    subprocess.run([_build.compiler(), *SANITIZE, *objs, "-lpthread", "-lm", "-o", output], check=True)


def build_package(dest: str) -> None:
    """dest/opforge: the python package with the op library rebuilt sanitized."""
    pkg = os.path.join(dest, "opforge")
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "python", "opforge"), pkg,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    sources = sorted(s for part in ("runtime", "kernels", "torch") for s in glob.glob(f"{ROOT}/csrc/{part}/*.c"))
    _build.build_library(sources, os.path.join(pkg, _build.RUNTIME_LIBRARY), [os.path.join(ROOT, "csrc", "include")],
                         OBJECTS, SANITIZE)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("test")
    t.add_argument("output")
    t.add_argument("sources", nargs="+")
    t.add_argument("-I", dest="include", action="append", default=[])
    t.add_argument("-D", dest="defines", action="append", default=[])
    lib = sub.add_parser("library")
    lib.add_argument("dest")
    sub.add_parser("runtime")
    a = p.parse_args()
    if a.what == "test":
        build_test(a.output, a.sources, a.include, a.defines)
    elif a.what == "library":
        build_package(a.dest)
    else:
        print(" ".join(runtime()))


if __name__ == "__main__":
    main()
