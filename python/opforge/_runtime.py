"""opforge's own op library, loaded once at import, and the runtime's knobs."""

from __future__ import annotations

import ctypes
import os

import torch

from ._lib import OpLibrary

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libopforge.so")
if not os.path.exists(_PATH):
    raise ImportError(
        f"opforge's op library is not built ({_PATH} is missing): run `make build` or "
        "`pip install --no-build-isolation -e .`"
    )

library = OpLibrary(_PATH)  # under the namespace it was built with (OPFORGE_NAMESPACE, default opforge)
namespace = library.namespace
ops = getattr(torch.ops, namespace)
_dll = library.dll
_dll.opforge_isa.restype = ctypes.c_char_p
_dll.opforge_isa_best.restype = ctypes.c_char_p
_dll.opforge_isa_name_at.restype = ctypes.c_char_p
_dll.opforge_isa_name_at.argtypes = [ctypes.c_int]
_dll.opforge_kernel_variant.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.POINTER(ctypes.c_char_p)] * 3 + [
    ctypes.POINTER(ctypes.c_int)]


# ---- the CUDA kernels ------------------------------------------------------------------

CUDA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libopforge_cuda.so")


def _load_cuda() -> tuple[ctypes.CDLL | None, str]:
    """libopforge_cuda.so, loaded where torch has CUDA and a GPU: its constructor registers the ops'
    CUDA kernels (same namespace, same schemas; fake, autograd and autocast are the CPU library's).
    Elsewhere nothing is loaded, and the reason is kept for cuda_status()."""
    if not os.path.exists(CUDA_PATH):
        return None, ("the CUDA library was not built (no nvcc at install: install the CUDA toolkit and "
                      "reinstall, or `make cuda`)")
    if torch.version.cuda is None:
        return None, f"this torch ({torch.__version__}) is a CPU build"
    if not torch.cuda.is_available():
        return None, "torch finds no GPU"
    try:
        dll = ctypes.CDLL(CUDA_PATH)
    except OSError as e:
        raise ImportError(f"cannot load opforge's CUDA library {CUDA_PATH}: {e}") from e
    err = ctypes.create_string_buffer(1024)
    rc = dll.opforge_cuda_registered(err, ctypes.c_size_t(1024))
    if rc == -2:  # a driver too old for the runtime linked in: it registered nothing, and says why
        return None, err.value.decode()
    if rc != 0:
        raise ImportError(f"opforge's CUDA library {CUDA_PATH}: {err.value.decode()}")
    dll.opforge_cuda_kernel_at.restype = ctypes.c_char_p
    dll.opforge_cuda_kernel_at.argtypes = [ctypes.c_int]
    return dll, "loaded"


_cuda_dll, _cuda_reason = _load_cuda()


def cuda_status() -> dict:
    """Whether opforge's ops have CUDA kernels in this process: ``loaded``, ``reason`` (why not),
    ``path`` and the ``ops`` with a CUDA kernel."""
    ops_ = []
    if _cuda_dll is not None:
        i = 0
        while (name := _cuda_dll.opforge_cuda_kernel_at(i)) is not None:
            ops_.append(name.decode())
            i += 1
    return {"loaded": _cuda_dll is not None, "reason": _cuda_reason, "path": CUDA_PATH, "ops": ops_,
            "runtime": _cuda_dll.opforge_cuda_runtime_version() if _cuda_dll is not None else None}


_dll.opforge_enum_value.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
                                    ctypes.POINTER(ctypes.c_int64)]
_dll.opforge_enum_at.restype = ctypes.c_char_p
_dll.opforge_enum_at.argtypes = [ctypes.c_int]


def enum(name: str) -> dict[str, int]:
    """The names and codes of an integer argument's values, as the C op that takes them
    defines them (OPF_REGISTER_ENUM): enum("reduction") == {"none": 0, "mean": 1, "sum": 2}."""
    out, value, code, i = {}, ctypes.c_char_p(), ctypes.c_int64(), 0
    while (r := _dll.opforge_enum_value(name.encode(), i, ctypes.byref(value), ctypes.byref(code))) == 1:
        out[value.value.decode()] = code.value
        i += 1
    if r < 0:
        raise KeyError(f"opforge's library defines no enum {name!r}; it has {', '.join(enums())}")
    return out


def enum_code(values: dict[str, int], op: str, arg: str, name, also: str = "") -> int:
    """The code of name in values (an enum()), or the op's RuntimeError listing the accepted names (and
    ``also``, a further accepted form the caller maps itself, e.g. " or None")."""
    code = values.get(name)
    if code is None:
        raise RuntimeError(f"[{namespace}::{op}] argument '{arg}' must be one of {', '.join(map(repr, values))}{also}, "
                           f"got {name!r}")
    return code


def enums() -> list[str]:
    """The enums the library defines."""
    names, i = [], 0
    while (name := _dll.opforge_enum_at(i)) is not None:
        names.append(name.decode())
        i += 1
    return names


def cuda_library_path() -> str | None:
    """The path of opforge's CUDA library (the ops' CUDA kernels), None where it was not built. A
    deployed program loads it after :func:`library_path`'s."""
    return CUDA_PATH if os.path.exists(CUDA_PATH) else None


def library_path() -> str:
    """The path of opforge's op library. Loading it registers the ops' schemas and CPU kernels
    (``torch.ops.load_library(path)``): what a deployed program (an AOTInductor package compiled
    without :func:`opforge.aoti_config`, a ``torch.export.load``-ed program) needs in a process that
    does not import opforge."""
    return _PATH


def set_isa(name: str) -> None:
    """Forces the kernels' ISA: one of :func:`supported_isas` or "auto" (the best one).
    The same as starting with OPFORGE_ISA=name. Raises RuntimeError when this
    CPU lacks it or the name is unknown."""
    library._call("opforge_set_isa", name.encode())
    TORCH_LINEARS.clear()  # the kernel table is part of the GEMM provider's classes
    SMALL_TRIALS.clear()


def get_isa() -> str:
    """The ISA opforge's kernels run now."""
    return _dll.opforge_isa().decode()


def isa_best() -> str:
    """The best ISA this CPU supports."""
    return _dll.opforge_isa_best().decode()


def supported_isas() -> list[str]:
    """The ISAs this CPU runs, in order ("ref", "avx2", "avx512", "avx512_bf16",
    "amx" where it has them): each can be forced with :func:`set_isa`, and a later
    one implies the earlier ones."""
    names, i = [], 0
    while (name := _dll.opforge_isa_name_at(i)) is not None:
        names.append(name.decode())
        i += 1
    return names[: names.index(isa_best()) + 1]


def kernel_variants() -> dict[str, list[tuple[str, str, bool]]]:
    """Each kernel family's variants in this build, read from the C tables the
    kernels are chosen from: (name, the ISA it needs, whether the current ISA
    runs it), the reference first."""
    out: dict[str, list[tuple[str, str, bool]]] = {}
    family, name, isa, current = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_int()
    f = 0
    while True:
        i = 0
        while (r := _dll.opforge_kernel_variant(f, i, *map(ctypes.byref, (family, name, isa, current)))) == 1:
            if name.value is not None:
                out.setdefault(family.value.decode(), []).append((name.value.decode(), isa.value.decode(),
                                                                  bool(current.value)))
            i += 1
        if r < 0:
            return out
        f += 1


# ---- the GEMM provider (csrc/torch/gemm_torch.c) --------------------------------------

_dll.opforge_gemm.restype = ctypes.c_char_p
_dll.opforge_gemm_choice_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int),
                                        ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double),
                                        ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]


# Plain linears (no activation), 2-d matmuls and plain attention: whether the provider runs their every
# product on torch's kernel, per key (operands' types, devices, dtypes, sizes, strides; autocast, threads,
# grads), as opforge_linear_on_torch / opforge_matmul_on_torch / opforge_attention_on_torch answered once
# the answer was final (not while auto mode still measures a class): False, True (mode torch), or, for
# classes auto mode gave to torch's kernel, a list of the calls routed and the counts at which the answer
# is asked again (functional.linear._routed: the provider's re-checks). It stays so for the process unless
# the mode or the ISA changes (set_gemm, set_isa empty it); opforge.linear calls F.linear and
# opforge.matmul torch.mm where it is not False.
TORCH_LINEARS: dict = {}
# Small classes auto mode times whole (opforge.functional.linear._small_class), per the same keys while
# they are tried: [calls so far, the op's best time, torch's]; emptied with TORCH_LINEARS.
SMALL_TRIALS: dict = {}


def set_gemm(mode: str) -> None:
    """Who multiplies the matrices inside linear, matmul and linear_cross_entropy (forward and
    backward): "own" (opforge's kernels), "torch" (torch's own GEMM, aten::mm: MKL, oneDNN, AMX;
    opforge's epilogues and fusions around it), or "auto" (the default: the faster of the two per
    class of product, measured the first time the class is met and kept on disk per CPU model and
    torch version). The same as starting with OPFORGE_GEMM=mode. "own" gives results that are
    bitwise the same at every thread count. The same mode chooses between opforge's attention and
    torch's fused CPU attention for the plain cases torch's kernel covers (float32 and bfloat16, no
    mask, key/value heads dividing the query heads, causal only with as many keys as queries), and
    for small softmax / log_softmax calls with a gradient whether torch's function runs them."""
    library._call("opforge_set_gemm", mode.encode())
    TORCH_LINEARS.clear()
    SMALL_TRIALS.clear()


def get_gemm() -> str:
    """The GEMM provider mode: "own", "torch" or "auto"."""
    return _dll.opforge_gemm().decode()


def gemm_choices() -> list[dict]:
    """What auto mode knows, per class of product (and of attention): ``key`` (kernel table, operand
    types > result type, epilogue, threads, log2 of M, N, K rounded up, layouts; "sdpa fwd|bwd ..."
    for attention), ``provider`` ("own", "torch", or "measuring" while its first calls are timed),
    the best ``own_gflops`` and ``torch_gflops`` measured (2 x multiply-adds per second; for attention
    per B H N S D), the ``samples`` taken in this process, and ``here`` (decided in this process
    rather than read from the cache file)."""
    out, i = [], 0
    key, state, own, theirs, samples, here = (ctypes.create_string_buffer(256), ctypes.c_int(), ctypes.c_double(),
                                              ctypes.c_double(), ctypes.c_int(), ctypes.c_int())
    while _dll.opforge_gemm_choice_at(i, key, 256, *map(ctypes.byref, (state, own, theirs, samples, here))):
        out.append({"key": key.value.decode(), "provider": ("measuring", "own", "torch")[state.value],
                    "own_gflops": 2 * own.value, "torch_gflops": 2 * theirs.value, "samples": samples.value,
                    "here": bool(here.value)})
        i += 1
    return out


def gemm_cache_file() -> str:
    """Where auto mode keeps its choices: per CPU model (brand string and cpuid signature: hypervisors
    give several generations one brand string), torch version and build of opforge's library
    (its size and modification time: a rebuilt or reinstalled library, whose kernels may have changed
    speed, measures its classes again instead of trusting another build's choices), under the build
    cache ($OPFORGE_CACHE_DIR or ~/.cache/opforge)."""
    import hashlib

    from .build import cache_dir

    cpu = cpu_features()
    model = cpu["model"] or "unknown-cpu"
    slug = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in model).strip("-")
    slug += f"-{cpu['family']}.{cpu['model_number']}.{cpu['stepping']}"
    try:
        st = os.stat(library.path)
        build = hashlib.blake2b(f"{st.st_size}:{st.st_mtime_ns}".encode(), digest_size=4).hexdigest()
    except OSError:
        build = "unknown"
    return os.path.join(cache_dir(), "providers",
                        f"{slug}-torch-{torch.__version__.replace('+', '-')}-lib-{build}.tsv")



# ---- how large fresh outputs are paged in (csrc/torch/glue.c) --------------------------

_dll.opforge_pages.restype = ctypes.c_char_p


def set_pages(mode: str) -> None:
    """How an op pages in a CPU output of 4 MiB or more whose memory is fresh (not yet resident:
    glibc maps large blocks anew on every allocation, and its first writes fault it in 4 KiB at a
    time, which can cost more than the op's own work). "touch": nothing, the kernel's writes fault
    it in, as eager's ops do; "populate" (the default): the threads fault it in first, in parallel,
    without a trap per page (MADV_POPULATE_WRITE, Linux 5.14); "huge": transparent huge pages are
    advised for it, then it is populated, one fault per 2 MiB (fastest where THP is enabled, but on a
    VM a huge page the guest has not used before can cost far more than its 512 small ones, and
    THP's defrag may stall a fault on compaction; /sys/kernel/mm/transparent_hugepage/). Values never
    change. The same as starting with OPFORGE_PAGES=mode."""
    library._call("opforge_set_pages", mode.encode())


def get_pages() -> str:
    """The mode of :func:`set_pages`: "touch", "populate" or "huge"."""
    return _dll.opforge_pages().decode()


def thp_mode() -> str:
    """The kernel's transparent huge page setting ("always", "madvise", "never"), or "unknown"."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return next((w[1:-1] for w in f.read().split() if w.startswith("[")), "unknown")
    except OSError:
        return "unknown"


def set_log_level(level: str) -> None:
    """"error", "warning" (default), "info" (one line per op call) or "debug";
    the same as OPFORGE_LOG_LEVEL."""
    library._call("opforge_set_log_level", level.encode())


def set_log_file(path: str | None) -> None:
    """Appends log lines to path instead of stderr (None: back to stderr)."""
    library._call("opforge_set_log_file", (path or "").encode())


_SIGNATURE = ("family", "model_number", "stepping")  # cpuid leaf 1's, after the brand string


class _CpuFeatures(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int)
        for name in (
            "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512bf16 amx_tile amx_bf16 os_avx os_avx512 os_amx"
        ).split()
    ] + [("model", ctypes.c_char * 64)] + [(name, ctypes.c_int) for name in _SIGNATURE]


_dll.opforge_cpu_features.restype = ctypes.POINTER(_CpuFeatures)


def cpu_features() -> dict:
    """What cpuid reports, as the runtime sees it."""
    f = _dll.opforge_cpu_features().contents
    out = {name: bool(getattr(f, name)) for name, kind in _CpuFeatures._fields_
           if kind is ctypes.c_int and name not in _SIGNATURE}
    out["model"] = f.model.decode(errors="replace")
    out.update((name, getattr(f, name)) for name in _SIGNATURE)
    return out


if (_mode := os.environ.get("OPFORGE_GEMM")):
    set_gemm(_mode)  # raises what is wrong with it (the library, loading, only logged it)
library._call("opforge_set_gemm_cache", gemm_cache_file().encode())
