"""Compile C sources into an op library with the system C compiler.

Used by setup.py for opforge's own library. It imports nothing from torch at
module level so that setup.py can load it by path before opforge is built.
Files named ``*_avx2.c`` / ``*_avx512.c`` / ``*_amx.c`` get that ISA's ``-m`` flags and no
other file does: the library runs on any x86-64 CPU and picks kernels at run
time. Never ``-march=native``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig

CFLAGS = [
    "-std=c11",
    "-O3",
    "-fPIC",
    "-fexceptions",  # torch's errors are C++ exceptions that unwind through our frames
    "-fno-math-errno",  # sqrt and friends inline to one instruction
    "-ffp-contract=off",  # ISA variants round exactly as the scalar reference
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    # C11 has no implicit declarations; gcc still accepts them with a warning,
    # and a misspelled call would then surface only at load, as a missing symbol
    "-Werror=implicit-function-declaration",
]

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}
ISA_FLAGS["avx512_bf16"] = ISA_FLAGS["avx512"] + ["-mavx512bf16"]
ISA_FLAGS["amx"] = ISA_FLAGS["avx512_bf16"] + ["-mamx-tile", "-mamx-bf16"]

# The emulated AVX-512 test build (-DOPF_EMULATE_AVX512, C tests only): the
# AVX-512 and AMX files are compiled for AVX2, their 512-bit intrinsics mapped
# onto a portable implementation by tests/emu/immintrin.h.
EMULATE_AVX512 = "-DOPF_EMULATE_AVX512"
EMU_INCLUDE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "emu")


SIMDE_HEADER = os.path.join("simde", "x86", "avx512.h")


def simde_include() -> str | None:
    """Where SIMDe's headers are: $SIMDE_INCLUDE, the cmeel-simde package of this
    python (requirements-dev.txt installs it in the venv), or the system's
    (Debian's libsimde-dev); None without them."""
    prefix = os.path.join(sysconfig.get_paths()["purelib"], "cmeel.prefix", "include")
    for d in (os.environ.get("SIMDE_INCLUDE"), prefix, "/usr/local/include", "/usr/include"):
        if d and os.path.exists(os.path.join(d, SIMDE_HEADER)):
            return d
    return None


def isa_flags(isa: str | None, extra_cflags: list[str]) -> list[str]:
    if isa is None:
        return []
    if EMULATE_AVX512 in extra_cflags and isa != "avx2":
        simde = simde_include()
        if simde is None:
            raise BuildError("the emulated AVX-512 build needs SIMDe's headers: pip install cmeel-simde "
                             "(make setup does), apt-get install libsimde-dev, or set SIMDE_INCLUDE")
        # AMX instructions: the C model of gemm_amx.c; -Wno-psabi: 512-bit values pass as the emulation's structs
        emu = ["-DOPF_AMX_EMULATE"] if isa == "amx" else []
        return ISA_FLAGS["avx2"] + [f"-I{os.path.abspath(EMU_INCLUDE)}", f"-I{simde}", "-Wno-psabi", *emu]
    return ISA_FLAGS[isa]


class BuildError(RuntimeError):
    """The C compiler or linker failed; the message carries its output."""


def compiler() -> str:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    found = shutil.which(cc) or shutil.which("cc") or shutil.which("gcc")
    if not found:
        raise BuildError("no C compiler found: install gcc (apt-get install gcc) or set CC")
    return found


def isa_of(source: str) -> str | None:
    stem = os.path.splitext(os.path.basename(source))[0]
    for isa in ISA_FLAGS:
        if stem.endswith("_" + isa):
            return isa
    return None


def select_sources(sources: list[str]) -> list[str]:
    """Drops ISA files on machines that are not x86."""
    return [s for s in sources if _X86 or isa_of(s) is None]


def torch_lib_dir() -> str:
    import torch  # the build links libtorch_cpu of the torch installed here

    return os.path.join(os.path.dirname(torch.__file__), "lib")


def _run(cmd: list[str], warnings: str = "") -> str:
    """Runs cmd; returns what it printed (warnings). On failure the BuildError
    carries its output and ``warnings`` (those of the steps before it)."""
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise BuildError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}{warnings}")
    return proc.stdout


def _show(output: str) -> None:
    if output.strip():
        sys.stderr.write(output if output.endswith("\n") else output + "\n")


def _up_to_date(cmd: list[str]) -> bool:
    """Whether the object cmd writes exists, was made by this same command, and
    is newer than its source and every header the compiler listed for it (-MMD)."""
    obj, dep = cmd[-4], cmd[-1]
    try:
        with open(obj + ".cmd") as f:
            if f.read() != " ".join(cmd):
                return False
        with open(dep) as f:
            deps = f.read().replace("\\\n", " ").split(":", 1)[1].split()
        made = os.path.getmtime(obj)
        return all(os.path.getmtime(d) <= made for d in deps)
    except (OSError, IndexError):
        return False


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def _text_closure(src: str, include_dirs: list[str], seen: dict[str, str]) -> str:
    """The text of src and of every header it includes with quotes, transitively
    (resolved as the compiler does: beside the including file, then include_dirs)."""
    path = os.path.abspath(src)
    if path in seen:
        return ""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    seen[path] = text
    for name in _INCLUDE.findall(text):
        for d in (os.path.dirname(path), *include_dirs):
            if os.path.exists(os.path.join(d, name)):
                _text_closure(os.path.join(d, name), include_dirs, seen)
                break
    return "".join(seen.values())


def flags_for(src: str, include_dirs: list[str], extra_cflags: list[str]) -> list[str]:
    """extra_cflags as src sees them: a -D goes only to a file that reads its macro
    (in its own text or in a header it includes), so that a define for one file
    (a test's build parameter, the op namespace) recompiles that file alone."""
    out, text = [], None
    for flag in extra_cflags:
        if flag.startswith("-D"):
            if text is None:
                text = _text_closure(src, include_dirs, {})
            if not re.search(r"\b" + re.escape(flag[2:].split("=")[0]) + r"\b", text):
                continue
        out.append(flag)
    return out


def compile_objects(
    sources: list[str],
    include_dirs: list[str],
    build_dir: str,
    extra_cflags: list[str] | None = None,
    verbose: bool = False,
) -> tuple[list[str], str]:
    """Compiles each source (in parallel) with CFLAGS plus its ISA's flags;
    returns the objects and the compiler's warnings. A failure raises a
    BuildError with every file's messages, warnings of the files that
    compiled included. An object's name carries a digest of its command, so
    one build_dir is a cache that builds with other flags share: a file is
    compiled once per distinct command (the library, each C test binary and a
    rebuild under another namespace reuse what they have in common)."""
    cc = compiler()
    # absolute paths: the same file reached from the Makefile (relative) and from setup.py (absolute)
    # is one command, so one object
    build_dir = os.path.abspath(build_dir)
    os.makedirs(build_dir, exist_ok=True)
    include_dirs = [os.path.abspath(d) for d in include_dirs]
    incs = [f"-I{d}" for d in include_dirs]
    jobs = []
    for src in select_sources([os.path.abspath(s) for s in sources]):
        isa = isa_of(src)
        flags = CFLAGS + isa_flags(isa, extra_cflags or []) + flags_for(src, include_dirs, extra_cflags or [])
        digest = hashlib.sha1(" ".join([cc, *flags, *incs, src]).encode()).hexdigest()[:10]
        # the same stem lives in csrc/kernels and csrc/torch: keep the folder in the name
        parent = os.path.basename(os.path.dirname(os.path.abspath(src)))
        obj = os.path.join(build_dir, f"{parent}_{os.path.basename(src)[:-2]}-{digest}.o")
        jobs.append(([cc, *flags, *incs, "-c", src, "-o", obj, "-MMD", "-MF", obj[:-2] + ".d"], obj))
    if verbose:
        for cmd, _ in jobs:
            print(" ".join(cmd))

    warnings = _compile_all([cmd for cmd, _ in jobs])
    return [obj for _, obj in jobs], warnings


def _compile_all(cmds: list[list[str]]) -> str:
    """Runs the compile commands whose object is missing or stale (_up_to_date), in parallel; returns the
    compilers' warnings, or raises a BuildError with every failure's messages and the warnings."""

    def run(cmd):
        if _up_to_date(cmd):
            return "", ""
        try:
            out = _run(cmd)
        except BuildError as e:
            return str(e), ""
        with open(cmd[-4] + ".cmd", "w") as f:  # the object's command, for _up_to_date
            f.write(" ".join(cmd))
        return "", out

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(run, cmds))
    errors = "".join(e for e, _ in results)
    warnings = "".join(w for _, w in results)
    if errors:
        raise BuildError(errors + warnings)
    return warnings


DEFAULT_NAMESPACE = "opforge"


def namespace_flags(namespace: str | None) -> list[str]:
    """The C flag that compiles opforge's ops under torch.ops.<namespace>
    (csrc/torch/namespace.h); none for the default namespace."""
    if not namespace or namespace == DEFAULT_NAMESPACE:
        return []
    if not namespace.isidentifier() or not namespace.isascii():
        raise BuildError(f"the op namespace (OPFORGE_NAMESPACE) must be a Python identifier such as "
                         f"acme_ops_1a2b, got {namespace!r}")
    return [f'-DOPF_NAMESPACE="{namespace}"']


PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
RUNTIME_LIBRARY = "libopforge.so"


def include_dir() -> str:
    """opforge's public C headers: shipped in the package, or csrc/include in a checkout."""
    for d in (os.path.join(PACKAGE_DIR, "include"), os.path.join(PACKAGE_DIR, "..", "..", "csrc", "include")):
        if os.path.exists(os.path.join(d, "opforge", "op.h")):
            return os.path.abspath(d)
    raise BuildError(f"opforge's C headers are missing from {PACKAGE_DIR}/include: reinstall opforge")


def build_library(
    sources: list[str],
    output: str,
    include_dirs: list[str],
    build_dir: str,
    extra_cflags: list[str] | None = None,
    verbose: bool = False,
    link_runtime: bool = False,
) -> str:
    """Compiles ``sources`` and links ``output`` against libtorch_cpu. A user op
    library (link_runtime) also links opforge's own library, whose runtime
    (ISA choice, threads, logging) and glue helpers it shares."""
    objs, warnings = compile_objects(sources, include_dirs, build_dir, extra_cflags, verbose)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    lib = torch_lib_dir()
    if link_runtime:
        # a user library is built where it runs: the paths of this torch and opforge hold
        runtime = [f"-L{PACKAGE_DIR}", f"-Wl,-rpath,{PACKAGE_DIR}", f"-l:{RUNTIME_LIBRARY}", f"-Wl,-rpath,{lib}"]
    else:
        # opforge's own library ships in a wheel: no path of the build machine.
        # torch is imported (libtorch_cpu loaded) before it; $ORIGIN finds the
        # torch installed beside opforge otherwise.
        runtime = [f"-Wl,-soname,{RUNTIME_LIBRARY}", "-Wl,-rpath,$ORIGIN/../torch/lib"]
    link = [
        compiler(),
        "-shared",
        *[f for f in extra_cflags or [] if f.startswith("-fsanitize")],  # the sanitizer runtimes (make sanitize)
        *objs,
        *runtime,
        f"-L{lib}",
        "-Wl,-z,now",  # a missing torch symbol fails at load, not at first call
        "-Wl,-z,defs",  # a symbol no linked library defines (a misspelled call) fails here, not at load
        "-ltorch_cpu",
        "-lpthread",
        "-lm",
        "-o",
        output,
    ]
    if verbose:
        print(" ".join(link))
    _show(warnings + _run(link, warnings))
    return output


# ---- CUDA --------------------------------------------------------------------------------------

# SASS for A100-class (sm_80) and Hopper (sm_90) GPUs, and sm_90 PTX that the driver compiles for newer ones
CUDA_ARCHS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
              "-gencode", "arch=compute_90,code=compute_90"]
# no C++ runtime: no exceptions or thread-safe statics in the host code nvcc generates (the library links
# no libstdc++)
NVCCFLAGS = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-Xcompiler", "-fno-math-errno", "-Xcompiler",
             "-fno-exceptions", "-Xcompiler", "-fno-threadsafe-statics", "-Xcompiler", "-fno-rtti", "-Xptxas", "-O3",
             "--expt-relaxed-constexpr"]
# the emulated build of a .cu (C tests on machines without a GPU): C++ on the CPU, over tests/emu/cuda_emu.h
EMULATE_CUDA = ["-x", "c++", "-std=c++17", "-O1", "-fPIC", "-DOPF_CUDA_EMULATE", "-Wall", "-Wno-unused-function",
                "-Wno-unused-variable", "-Wno-unknown-pragmas"]


def nvcc() -> str | None:
    """nvcc: $NVCC, $CUDA_HOME/bin/nvcc, the PATH's, or /usr/local/cuda's; None without one."""
    for cand in (os.environ.get("NVCC"),
                 os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None,
                 shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.exists(cand):
            return cand
    return None


def cuda_home() -> str:
    """The CUDA toolkit nvcc belongs to (its include/ and lib64/)."""
    found = nvcc()
    if found is None:
        raise BuildError("no nvcc found: install the CUDA toolkit, put nvcc on the PATH or set CUDA_HOME")
    for cand in (os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(os.path.realpath(found))),
                 "/usr/local/cuda"):
        if cand and os.path.exists(os.path.join(cand, "include", "cuda_runtime_api.h")):
            return cand
    # nvcc may be a wrapper script (/usr/local/bin/nvcc): ask it where its headers are
    out = subprocess.run([found, "--dryrun", "-x", "cu", "-c", "/dev/null"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True).stdout
    m = re.search(r"TOP=(\S+)", out)
    if m and os.path.exists(os.path.join(m.group(1), "include", "cuda_runtime_api.h")):
        return m.group(1)
    raise BuildError(f"could not find the CUDA headers of {found}: set CUDA_HOME")


def compile_cuda_objects(sources: list[str], include_dirs: list[str], build_dir: str, emulate: bool = False,
                         verbose: bool = False) -> tuple[list[str], str]:
    """Compiles .cu files: with nvcc for the GPU, or (emulate) with the C++ compiler for the CPU
    emulation the C tests run. Cached in build_dir by a digest of the command, as compile_objects; returns
    the objects and the compilers' warnings."""
    build_dir = os.path.abspath(build_dir)
    os.makedirs(build_dir, exist_ok=True)
    incs = [f"-I{os.path.abspath(d)}" for d in include_dirs]
    if emulate:
        cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
        if cxx is None:
            raise BuildError("the emulated CUDA tests need a C++ compiler (apt-get install g++)")
        base = [cxx, *EMULATE_CUDA, f"-I{os.path.abspath(EMU_INCLUDE)}"]
    else:
        found = nvcc()
        if found is None:
            raise BuildError("no nvcc found: install the CUDA toolkit, put nvcc on the PATH or set CUDA_HOME")
        base = [found, *NVCCFLAGS, *CUDA_ARCHS]
    jobs = []
    for src in (os.path.abspath(s) for s in sources):
        digest = hashlib.sha1(" ".join([*base, *incs, src]).encode()).hexdigest()[:10]
        parent = os.path.basename(os.path.dirname(src))
        obj = os.path.join(build_dir, f"{parent}_{os.path.basename(src)[:-3]}{'-emu' if emulate else ''}-{digest}.o")
        jobs.append([*base, *incs, "-c", src, "-o", obj, "-MMD", "-MF", obj[:-2] + ".d"])
    if verbose:
        for cmd in jobs:
            print(" ".join(cmd))
    warnings = _compile_all(jobs)
    return [cmd[-4] for cmd in jobs], warnings


CUDA_LIBRARY = "libopforge_cuda.so"


def build_cuda_library(c_sources: list[str], cu_sources: list[str], output: str, include_dirs: list[str],
                       build_dir: str, extra_cflags: list[str] | None = None, verbose: bool = False,
                       runtime_dir: str | None = None, link_dir: str | None = None) -> str:
    """Links a library of CUDA ops: the .cu files through nvcc, the C glue through the C compiler
    (with the CUDA headers), the CUDA runtime statically (so that no libcudart path of the build
    machine is needed where it runs), opforge's own library (its glue helpers, runtime and op table)
    and libtorch_cpu. libtorch_cuda is not linked: the glue looks its one symbol up at run time.
    runtime_dir: where libopforge.so is at link time (and, for a user library built where it runs,
    at run time); opforge's own CUDA library finds it beside itself ($ORIGIN), link_dir at link time."""
    home = cuda_home()
    objs, warnings = compile_objects(c_sources, [*include_dirs, os.path.join(home, "include")], build_dir,
                                     extra_cflags, verbose) if c_sources else ([], "")
    cu_objs, cu_warnings = compile_cuda_objects(cu_sources, include_dirs, build_dir, verbose=verbose)
    objs, warnings = objs + cu_objs, warnings + cu_warnings
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    lib = torch_lib_dir()
    rdir = runtime_dir or link_dir or PACKAGE_DIR
    if runtime_dir is None:  # opforge's own: shipped beside libopforge.so
        where = [f"-Wl,-soname,{CUDA_LIBRARY}", "-Wl,-rpath,$ORIGIN", "-Wl,-rpath,$ORIGIN/../torch/lib"]
    else:
        where = [f"-Wl,-rpath,{rdir}", f"-Wl,-rpath,{lib}"]
    lib64 = next((d for d in (os.path.join(home, "lib64"), os.path.join(home, "lib"))
                  if os.path.exists(os.path.join(d, "libcudart_static.a"))), os.path.join(home, "lib64"))
    link = [compiler(), "-shared", *objs, *where, f"-L{rdir}", f"-l:{RUNTIME_LIBRARY}", f"-L{lib}", f"-L{lib64}",
            "-Wl,-z,now", "-Wl,-z,defs", "-ltorch_cpu", "-lcudart_static", "-ldl", "-lrt", "-lpthread", "-lm",
            "-o", output]
    if verbose:
        print(" ".join(link))
    _show(warnings + _run(link, warnings))
    return output


def build_emulated_cuda_test(sources: list[str], cu_sources: list[str], output: str, include_dirs: list[str],
                             build_dir: str) -> str:
    """A C test of CUDA kernels on the CPU: the C sources as build_test_binary compiles them, the .cu
    files over tests/emu/cuda_emu.h, linked with the C++ compiler."""
    objs, warnings = compile_objects(sources, include_dirs, build_dir)
    cu_objs, cu_warnings = compile_cuda_objects(cu_sources, include_dirs, build_dir, emulate=True)
    objs, warnings = objs + cu_objs, warnings + cu_warnings
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    cxx = shutil.which(os.environ.get("CXX", "g++")) or "c++"
    _show(warnings + _run([cxx, *objs, "-lpthread", "-lm", "-o", output], warnings))
    return output


def build_test_binary(
    sources: list[str], output: str, include_dirs: list[str], build_dir: str, defines: list[str] | None = None
) -> str:
    """Compiles a standalone C test (kernels + runtime, no torch) with the
    library's flags, so the tests exercise exactly what ships and share its
    objects (plus ``defines``, e.g. a test model of instructions the CPU lacks,
    which reach only the files that read them)."""
    objs, warnings = compile_objects(sources, include_dirs, build_dir, [f"-D{d}" for d in defines or []])
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    _show(warnings + _run([compiler(), *objs, "-lpthread", "-lm", "-o", output], warnings))
    return output


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="build a standalone C test binary with opforge's flags")
    p.add_argument("output")
    p.add_argument("sources", nargs="+")
    p.add_argument("-I", dest="include", action="append", default=[])
    p.add_argument("-D", dest="defines", action="append", default=[])
    p.add_argument("--objects", default="build/obj", help="the object cache (shared with the library's build)")
    a = p.parse_args()
    cu = [s for s in a.sources if s.endswith(".cu")]
    if cu:  # a C test of CUDA kernels: on the CPU, over the emulation
        build_emulated_cuda_test([s for s in a.sources if not s.endswith(".cu")], cu, a.output, a.include, a.objects)
    else:
        build_test_binary(a.sources, a.output, a.include, a.objects, a.defines)
