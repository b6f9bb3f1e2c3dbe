"""The opforge command line (a module of its own, outside the opforge package,
so that `opforge info` can still diagnose a setting that makes `import opforge`
fail, such as an unsupported OPFORGE_ISA).

    opforge info                       environment, ABI, CPU, ISA per op, diagnosis
    opforge new NAME [--inputs a,b] [--scalars alpha:float] [--reduce last] [--dir DIR]
    opforge new "SCHEMA" [--enum ARG=a,b] [--dims T=B,D,L] [--shape RULE] [--backward A,B] [--dir DIR]
                                       scaffold a working C op project of that signature
    opforge info --load FILE.c ...     a user op library: ops, schemas, shape rules, variants, autocast
    opforge check OP [...]             precision against a PyTorch reference (msProbe-style)
    opforge bench OP [...]             speed and peak memory against eager and torch.compile
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import traceback


def new(name: str, directory: str | None = None, inputs: str | None = None, scalars: str | None = None,
        reduce: str | None = None, cuda: bool = False, schema_options: dict | None = None) -> str:
    """Writes a working op project NAME into DIR/NAME; returns its path. NAME may be a whole schema
    ("causal_conv1d(Tensor x, Tensor? bias=None, str activation='none') -> Tensor"): see scaffold_schema."""
    from opforge import scaffold

    if "(" in name:
        return _new_from_schema(name, directory, inputs, scalars, reduce, cuda, **(schema_options or {}))
    extra = [f"--{k}" for k, v in (schema_options or {}).items() if v]
    if extra:
        raise SystemExit(f"opforge new: {', '.join(extra)} go with a schema: opforge new \"{name}(Tensor x, ...) -> "
                         "Tensor\" ...")
    sig = scaffold.Signature.parse(name, inputs, scalars, reduce)
    sig.cuda = cuda
    dest = scaffold.new(sig, directory)
    print(f"created {dest}: {name}({sig.schema_args()}) -> Tensor"
          f"{' (last dim reduced, shape rule [' + sig.inputs[0] + '[:-1]])' if sig.reduce else ''}\n"
          f"  cd {dest} && pytest")
    return dest


def _new_from_schema(schema: str, directory, inputs, scalars, reduce, cuda, enum=None, dims=None, shape=None,
                     backward=None) -> str:
    from opforge import scaffold_schema

    given = [flag for flag, v in (("--inputs", inputs), ("--scalars", scalars), ("--reduce", reduce),
                                  ("--cuda", cuda)) if v]
    if given:
        raise SystemExit(f"opforge new: {', '.join(given)} go with a NAME, not a schema: the schema says what "
                         "they would (a schema's op runs on the CPU; --cuda writes elementwise ops only)")
    sig = scaffold_schema.SchemaSig.parse(schema, enum, dims, shape, backward)
    dest = scaffold_schema.new(sig, directory)
    print(f"created {dest}: {sig.schema()}\n"
          f"  rows of {sig.main} ({'one value' if sig.reduce else 'a row'} out per row); gradients of "
          f"{', '.join(sig.grads) or 'none'}\n  cd {dest} && pytest")
    return dest


# ---- resolving OP and its reference ---------------------------------------------------


def _loading(what: str, load):
    """load(): a user's op library, or the one line naming what failed (a build error, a missing or wrong
    file, a bad descriptor), no traceback."""
    import opforge

    try:
        return load()
    except (opforge.BuildError, ImportError, OSError, ValueError, RuntimeError) as e:
        raise SystemExit(f"{what}: {e}") from None


def _resolve(op_name: str, sources: list[str] | None, reference: str | None):
    import torch

    import opforge
    import opforge.testing as ot

    ns, sep, name = op_name.partition("::")
    if not sep:
        ns, name = opforge.namespace, op_name
    if sources:
        _loading("opforge: --load", lambda: opforge.load(ns, sources))
    try:
        op = getattr(getattr(torch.ops, ns), name).default
    except (AttributeError, RuntimeError):
        hint = "load its C sources with --load"
        if ns == opforge.namespace:  # opforge's own: the ops' names, which differ from some functions' (swiglu: glu)
            hint = f"opforge's ops: {', '.join(sorted(d.name for d in opforge.library.ops))}"
        raise SystemExit(f"opforge: no op {ns}::{name} ({hint})") from None
    if reference:
        ref = _load_function(reference, "--reference")
    elif ns == opforge.namespace and name in ot.REFERENCES:
        ref = ot.REFERENCES[name]
    else:
        raise SystemExit(f"opforge: no reference known for {ns}::{name}: pass --reference FILE.py:FUNCTION")
    return op, ref


_DTYPE_NAMES = ("float64", "float32", "bfloat16", "float16")
_SIZES = f"{1 << 12},{1 << 16},{1 << 20},{1 << 22}"  # bench's default 1-d input sizes


def _dtypes(names, option: str):
    import torch

    for n in names:
        if n not in _DTYPE_NAMES:
            raise SystemExit(f"opforge: {option} {n}: expected {', '.join(_DTYPE_NAMES[:-1])} or {_DTYPE_NAMES[-1]}")
    return [getattr(torch, n) for n in names]


def _load_function(spec: str, what: str):
    path, _, fn = spec.rpartition(":")
    if not path or not fn or not os.path.isfile(path):
        raise SystemExit(f"opforge: {what} must be FILE.py:FUNCTION with an existing FILE.py, got {spec!r}")
    module_spec = importlib.util.spec_from_file_location(f"_opforge_{what.strip('-')}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, fn, None)):
        raise SystemExit(f"opforge: {what}: {path} defines no function {fn!r}")
    return getattr(module, fn)


def _shapes(op, specs: list[str] | None) -> dict[str, tuple[int, ...]]:
    """--shape NAME=D0,D1,... per Tensor argument, checked against op's schema."""
    from opforge._lib import is_tensor_arg

    names = [a.name for a in op._schema.arguments if is_tensor_arg(a)]
    shapes = {}
    for spec in specs or []:
        name, _, dims = spec.partition("=")
        if name not in names:
            raise SystemExit(f"opforge: --shape {spec}: {op} has no Tensor argument {name!r} "
                             f"(its Tensor arguments: {', '.join(names)})")
        try:
            shapes[name] = tuple(int(d) for d in dims.split(",")) if dims.strip() else ()
        except ValueError:
            raise SystemExit(f"opforge: --shape must be NAME=D0,D1,... (e.g. x=64,512), got {spec!r}") from None
        if any(d < 0 for d in shapes[name]):
            raise SystemExit(f"opforge: --shape {spec}: sizes must be 0 or more") from None
    return shapes


def _given_inputs(op, args):
    """A function dtype -> argument tuple from --inputs or --shape; None for
    neither (the schema's default inputs)."""
    import opforge.testing as ot

    if args.inputs and args.shape:
        raise SystemExit("opforge: pass --inputs or --shape, not both")
    if args.inputs:
        fn = _load_function(args.inputs, "--inputs")

        def given(dtype):
            values = ot._tuple(fn())
            return tuple(a.to(dtype) if ot._is_float_tensor(a) else a for a in values)
        return given
    if not args.shape:
        return None
    shapes = _shapes(op, args.shape)
    return lambda dtype: ot.shaped_args(op, shapes, dtype)


def _scalars(op, specs: list[str] | None) -> dict:
    """--arg NAME=VALUE per scalar argument, parsed by its schema type (float, int, bool, str; none for an
    optional one)."""
    import opforge.testing as ot

    types = ot.scalar_arguments(op)
    values = {}
    for spec in specs or []:
        name, sep, text = spec.partition("=")
        if not sep or name not in types:
            raise SystemExit(f"opforge: --arg must be NAME=VALUE with NAME a scalar argument of {op._schema.name} "
                             f"(its scalar arguments: {', '.join(f'{n}: {t}' for n, t in types.items()) or 'none'}), "
                             f"got {spec!r}")
        ty = types[name].rstrip("?")
        words = {"true": True, "1": True, "false": False, "0": False}
        try:
            if types[name].endswith("?") and text.lower() == "none":
                values[name] = None
            elif ty == "bool":
                values[name] = words[text.lower()]
            else:
                values[name] = {"float": float, "int": int, "SymInt": int, "str": str}[ty](text)
        except (KeyError, ValueError):
            raise SystemExit(f"opforge: --arg {spec}: '{name}' is {types[name]}"
                             + (" (true or false)" if ty == "bool" else "") + f", got {text!r}") from None
    try:
        return ot._checked_scalars(op, values)  # an enum's value is one of its values
    except ValueError as e:
        raise SystemExit(f"opforge: --arg: {e}") from None


def _tolerances(specs: list[str] | None, option: str):
    """--atol/--rtol: VALUE for every dtype, DTYPE=VALUE for one (repeatable; the per-dtype ones win):
    a float, {dtype: float}, or None."""
    import torch

    import opforge.testing as ot

    every, per = None, {}
    for spec in specs or []:
        name, _, text = spec.rpartition("=")
        dtype = getattr(torch, name, None) if name else None
        if name and dtype not in ot.DTYPES:
            raise SystemExit(f"opforge: {option} {spec}: no dtype {name!r} "
                             f"(one of {', '.join(str(d).split('.')[1] for d in ot.DTYPES)})")
        try:
            value = float(text)
        except ValueError:
            raise SystemExit(f"opforge: {option} must be VALUE or DTYPE=VALUE (e.g. bfloat16=0.05), "
                             f"got {spec!r}") from None
        if name:
            per[dtype] = value
        else:
            every = value
    if not per:
        return every
    return {d: per.get(d, every) for d in ot.DTYPES if per.get(d, every) is not None}


def _user_frame(e: BaseException) -> str:
    """' (FILE:LINE, in FUNCTION)' of the innermost frame of e's traceback outside opforge and torch: where the
    user's reference or inputs function raised, or ''."""
    import torch

    import opforge

    ours = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (opforge, torch))
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not os.path.abspath(f.filename).startswith(ours) and os.path.abspath(f.filename) != os.path.abspath(__file__)]
    return f" ({frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""


def _failed(cmd: str, e: Exception) -> SystemExit:
    """The op or its reference refused the inputs, or the user's reference or inputs function raised: one
    clear line (with where, in the user's code), no traceback."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    kind = "" if isinstance(e, RuntimeError) and first.startswith("[") else f"{type(e).__name__}: "
    return SystemExit(f"opforge {cmd}: {kind}{first}{_user_frame(e)}\n(inputs are 1-d from the schema unless given: "
                      "--shape NAME=D0,D1 per argument, or --inputs FILE.py:FUNCTION returning the argument tuple)")


def _device(name: str) -> str | None:
    """--device: None for the CPU; cuda only where the op's CUDA kernels can run."""
    if name == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"opforge: --device {name}: torch finds no GPU here"
                         + ("" if torch.version.cuda else f" (torch {torch.__version__} is a CPU build)"))
    return name


def check(args) -> int:
    import opforge.testing as ot

    op, ref = _resolve(args.op, args.load, args.reference)
    given = _given_inputs(op, args)  # --shape: generated in the check, which sweeps the bool and enum arguments
    scalars = _scalars(op, args.arg)
    try:
        report = ot.check(op, ref, inputs=(lambda dt: [given(dt)]) if args.inputs else None,
                          dtypes=_dtypes(args.dtypes, "--dtypes"), grad=not args.no_grad, atol=_tolerances(args.atol, "--atol"),
                          rtol=_tolerances(args.rtol, "--rtol"), device=_device(args.device), scalars=scalars,
                          shapes=_shapes(op, args.shape) if args.shape else None)
    except Exception as e:  # the op's refusal, or the user's reference or inputs function raising
        raise _failed("check", e) from None
    print(report)
    if not any(r.supported for r in report.results):
        print("\nno dtype ran: if the op wants other shapes, give them with --shape NAME=D0,D1 or --inputs FILE.py:FUNCTION")
    return 0 if report.passed else 1


def bench(args) -> int:
    import opforge.benchmark as ob
    import opforge.testing as ot

    op, ref = _resolve(args.op, args.load, args.reference)
    dtype = _dtypes([args.dtype], "--dtype")[0]
    given = _given_inputs(op, args)
    if given and args.sizes:
        raise SystemExit("opforge bench: --sizes sizes the default 1-d inputs: not with --shape or --inputs")
    if given:  # one input set: its size is its elements
        sizes, make_inputs = [sum(a.numel() for a in given(dtype) if ot._is_float_tensor(a))], lambda n, dt: given(dt)
    else:
        try:
            sizes, make_inputs = [int(s) for s in (args.sizes or _SIZES).split(",")], None
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1:
            raise SystemExit(f"opforge bench: --sizes takes element counts above 0, comma-separated, got {args.sizes!r}")
        if args.smoke:
            sizes = sizes[:1]
    stem = f"bench_{args.op.replace('::', '_')}_{args.dtype}" + ("_cuda" if args.device == "cuda" else "")
    timing = dict(reps=2, target_s=0.002) if args.smoke else {}
    try:
        rows = ob.bench(op, ref, sizes=sizes, dtype=dtype, make_inputs=make_inputs, backward=not args.no_backward,
                        atol=_tolerances(args.atol, "--atol"), rtol=_tolerances(args.rtol, "--rtol"),
                        device=_device(args.device), **timing)
    except Exception as e:  # the op's refusal, or the user's reference or inputs function raising
        raise _failed("bench", e) from None
    try:
        table = ob.write_results(stem, rows, out_dir=args.out)
        png = ob.plot(stem, [r["size"] for r in rows],
                      {k: [r[k] for r in rows] for k in rows[0] if k.endswith(("_vs_eager", "_vs_compile"))},
                      "elements", "ratio (>1: op better)", out_dir=args.out)
    except OSError as e:
        raise SystemExit(f"opforge bench: --out {args.out}: cannot write the results: {e}") from None
    print(table)
    print(f"\nwrote {os.path.join(args.out, stem)}.{{csv,md{',png' if png else ''}}}"
          + ("" if png else " (no .png: matplotlib is not installed)"))
    return 0


# ---- info ---------------------------------------------------------------------------------


AUTOCAST_NAMES = {0: "none (runs in its inputs' dtype)", 1: "lower (runs in the autocast dtype)",
                  2: "fp32 (inputs cast to float32)", 3: "promote (inputs cast to the widest of their dtypes)",
                  4: "follow (float32 parameters cast to a 16-bit input's dtype)"}


def _library_info(paths: list[str], ns: str | None) -> int:
    """`opforge info --load`: a user library's ops, schemas, shape rules, autograd, autocast policy
    and kernel variants (those it exports with OPF_KERNEL_FAMILIES)."""
    import opforge

    stem = os.path.splitext(os.path.basename(paths[0]))[0]
    ns = ns or (stem[3:] if stem.startswith("lib") and paths[0].endswith(".so") else stem)
    if len(paths) == 1 and paths[0].endswith(".so"):
        lib = _loading("opforge info --load", lambda: opforge.load_library(paths[0], ns))
    else:
        lib = _loading("opforge info --load", lambda: opforge.load(ns, paths))
    lines = [f"library     {lib.path}", f"namespace   {ns} (torch.ops.{ns}.*)", "ops"]
    for d in lib.ops:
        lines.append(f"  {d.schema}")
        lines.append(f"      shape {'; '.join(str(r) for r in d.shape)}" + (f"   flops {d.flops}" if d.flops else "")
                     + ("   meta kernel" if d.meta else ""))
        if d.backward:
            lines.append(f"      autograd: {d.backward}({', '.join(d.backward_args)}) -> grads of "
                         f"{', '.join(d.backward_grads)}")
        lines.append(f"      autocast {AUTOCAST_NAMES.get(d.autocast, d.autocast)}")
    lines.append(f"kernels     variants (needed ISA); * runs at isa {opforge.get_isa()}")
    families = _variant_families(lib.dll)
    if families is None:
        lines.append("  (the library lists none: OPF_KERNEL_FAMILIES(&variants) in its C exports them)")
    for family, variants in families or []:
        lines.append(f"  {family:<22} " + ", ".join(f"{'*' if cur else ''}{name} ({isa})" for name, isa, cur in variants))
    print("\n".join(lines))
    return 0


def _variant_families(dll):
    """[(family, [(variant, isa, current)])] from a library's opforge_kernel_families, None without it."""
    import opforge

    fn = getattr(dll, "opforge_kernel_families", None)
    if fn is None:
        return None

    class Variants(ctypes.Structure):  # opf_variants (runtime.h)
        _fields_ = [("family", ctypes.c_char_p), ("count", ctypes.c_int), ("tables", ctypes.c_void_p)]

    fn.restype = ctypes.POINTER(ctypes.POINTER(Variants))
    count = ctypes.c_int()
    arr = fn(ctypes.byref(count))
    at = opforge.library.dll.opforge_variant_at
    out = []
    name, isa, cur = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_int()
    for f in range(count.value):
        vs, variants, i = arr[f], [], 0
        while at(vs, i, ctypes.byref(name), ctypes.byref(isa), ctypes.byref(cur)) == 1:
            if name.value is not None:
                variants.append((name.value.decode(), isa.value.decode(), bool(cur.value)))
            i += 1
        out.append((vs.contents.family.decode(), variants))
    return out


def info(args) -> int:
    if args is not None and getattr(args, "load", None):
        return _library_info(args.load, args.ns)
    problems = []
    lines = [f"python      {platform.python_version()} ({sys.executable})"]
    try:
        import torch
    except ImportError:
        print("\n".join(lines + ["torch       not installed", "", "problem: torch is missing -> pip install 'torch>=2.10'"]))
        return 1
    lines.append(f"torch       {torch.__version__} ({os.path.dirname(torch.__file__)})")
    cc = shutil.which((os.environ.get("CC") or "cc").split()[0]) or shutil.which("gcc")
    if cc:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()
        lines.append(f"compiler    {version[0] if version else '?'} ({cc})")
    else:
        lines.append("compiler    not found")
        problems.append("no C compiler: opforge.load and opforge new need one -> apt-get install gcc (or set CC)")
    forced = {k: os.environ.get(k) for k in ("OPFORGE_ISA", "OPFORGE_LOG_LEVEL", "OPFORGE_LOG_FILE") if os.environ.get(k)}
    try:
        import opforge
    except (ImportError, RuntimeError) as e:
        problems.append(f"import opforge failed: {str(e).splitlines()[0]}")
        if not forced:
            print("\n".join(lines + ["", "problems:"] + [f"  - {p}" for p in problems]))
            return 1
        for key in forced:  # retry without the settings, to report the rest
            os.environ.pop(key)
        try:
            import opforge
        except (ImportError, RuntimeError) as e2:
            print("\n".join(lines + ["", "problems:"] + [f"  - {p}" for p in problems + [str(e2)]]))
            return 1
        for key, value in forced.items():
            if key in str(e):
                problems.append(f"{key}={value} is not valid here -> unset it or pick a value the message lists")
    abi = opforge.library.dll.opforge_torch_abi_version
    abi.restype = ctypes.c_uint64
    v = abi()
    lines.append(f"opforge     {opforge.__version__} ({os.path.dirname(opforge.__file__)})")
    lines.append(f"stable ABI  torch reports {v >> 56}.{(v >> 48) & 0xff}; opforge supports 2.10 and newer "
                 f"(declarations checked against 2.13)")
    feats = opforge.cpu_features()
    signature = f"family {feats.pop('family')} model {feats.pop('model_number')} stepping {feats.pop('stepping')}"
    lines.append(f"cpu         {feats.pop('model') or 'unknown'} ({signature}; {os.cpu_count()} logical CPUs)")
    lines.append("features    " + " ".join(k for k, on in feats.items() if on and not k.startswith("os_")))
    lines.append(f"isa         {opforge.get_isa()} (best here: {opforge.isa_best()}; OPFORGE_ISA="
                 f"{os.environ.get('OPFORGE_ISA', 'unset')})")
    if feats["amx_tile"] and feats["amx_bf16"]:
        why = ("the OS does not enable the tile state (XCR0)" if not feats["os_amx"] else
               "Linux refused this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
        lines.append("amx         " + ("bfloat16 GEMMs on AMX-BF16 tiles" if "amx" in opforge.supported_isas() else
                                      f"present but not usable: {why}; bfloat16 GEMMs run on AVX512-BF16"))
    lines.append(f"threads     {torch.get_num_threads()} (torch.set_num_threads / OMP_NUM_THREADS)")
    choices = opforge.gemm_choices()
    on_torch = [c for c in choices if c["provider"] == "torch"]
    lines.append(f"gemm        {opforge.get_gemm()} (OPFORGE_GEMM={os.environ.get('OPFORGE_GEMM', 'unset')}): "
                 f"{len(choices)} classes of product and attention known, {len(on_torch)} on torch's kernels "
                 f"({opforge._runtime.gemm_cache_file()})")
    for c in choices:
        lines.append(f"  {c['key']:<44} {c['provider']:<9} own {c['own_gflops']:.1f}, torch {c['torch_gflops']:.1f} "
                     "GFLOP/s")
    thp = opforge._runtime.thp_mode()
    lines.append(f"pages       {opforge.get_pages()} (OPFORGE_PAGES={os.environ.get('OPFORGE_PAGES', 'unset')}): how a "
                 f"fresh CPU output of 4 MiB or more is paged in; THP here: {thp}; torch's own huge pages: "
                 f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")
    cuda = opforge.cuda_status()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if cuda["loaded"]:
        rt = cuda["runtime"]
        lines.append(f"cuda        {gpu}: opforge's CUDA kernels loaded ({len(cuda['ops'])} ops, built with CUDA "
                     f"{rt // 1000}.{rt % 1000 // 10}; {cuda['path']})")
    else:
        lines.append(f"cuda        {'GPU ' + gpu + ', but ' if gpu else ''}CPU kernels only: {cuda['reason']}")
    lines.append(f"cache       {opforge.build.cache_dir()}")
    lines.append("ops")
    for d in opforge.library.ops:
        devices = [*d.devices, *(["cuda"] if d.name in cuda["ops"] and "cuda" not in d.devices else [])]
        lines.append(f"  {d.namespace}::{d.name:<34} {', '.join(devices)}{', autograd' if d.backward else ''}")
    lines.append(f"kernels     variants (needed ISA); * runs at isa {opforge.get_isa()}")
    for family, variants in opforge.kernel_variants().items():
        lines.append(f"  {family:<22} " + ", ".join(f"{'*' if cur else ''}{name} ({isa})" for name, isa, cur in variants))
    lines.append("")
    lines.append("no problems found" if not problems else "problems:")
    lines += [f"  - {p}" for p in problems]
    print("\n".join(lines))
    return 1 if problems else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="opforge", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("info", help="environment, ABI, CPU and ISA, diagnosis; --load: a user op library")
    i.add_argument("--load", nargs="+", metavar="FILE", help="C sources (or a built lib<ns>.so) of a user op library")
    i.add_argument("--ns", help="its namespace (default: the first file's name, without lib and the suffix)")
    n = sub.add_parser("new", help="scaffold a working op project")
    n.add_argument("name", help="the op's name, or its whole schema in quotes (then --enum, --dims, --shape, "
                   "--backward apply)")
    n.add_argument("--inputs", metavar="A,B", help="its tensor arguments (default: x)")
    n.add_argument("--scalars", metavar="NAME:TYPE,...", help="scalar arguments; TYPE float (default), int or bool")
    n.add_argument("--reduce", choices=["last"], help="the output drops the inputs' last dim (a row-wise reduction)")
    n.add_argument("--dir", default=None, help="parent folder (default: here)")
    n.add_argument("--cuda", action="store_true", help="CUDA kernels too: NAME.cu beside the C ones (built with nvcc)")
    n.add_argument("--enum", action="append", metavar="ARG=a,b,c", help="a str argument's values (it arrives in C "
                   "as the value's index)")
    n.add_argument("--dims", action="append", metavar="TENSOR=B,D,L", help="a tensor's dims by name: the glue "
                   "checks their number, and that a name seen twice is one size")
    n.add_argument("--shape", metavar="RULE", help="the output's shape rule: like:MAIN (default) or [MAIN[:-1]]")
    n.add_argument("--backward", metavar="A,B|none", help="the tensors that get gradients (default: every one)")
    for cmd in ("check", "bench"):
        c = sub.add_parser(cmd, help=f"{cmd} an op against a PyTorch reference")
        c.add_argument("op", help="one of opforge's ops (dispersion_correction, linear, ...), or NS::NAME of a user op")
        c.add_argument("--load", nargs="+", metavar="FILE.c", help="C sources of a user op library (namespace NS)")
        c.add_argument("--reference", metavar="FILE.py:FUNCTION", help="the PyTorch reference")
        c.add_argument("--shape", action="append", metavar="NAME=D0,D1",
                       help="shape of Tensor argument NAME (repeat per argument; default: 1-d)")
        c.add_argument("--inputs", metavar="FILE.py:FUNCTION", help="a function returning the argument tuple")
        c.add_argument("--atol", action="append", metavar="[DTYPE=]VALUE",
                       help="a looser absolute tolerance (default: per dtype; never tightens one): VALUE for every "
                       "dtype, DTYPE=VALUE for one (repeat: --atol bfloat16=0.05 --atol float32=1e-5)")
        c.add_argument("--rtol", action="append", metavar="[DTYPE=]VALUE",
                       help="a looser relative tolerance, as --atol (e.g. float32=1e-5 for a float32 reduction)")
        c.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                       help="where the op runs (cuda: its CUDA kernel; the reference stays on the CPU in float64)")
        if cmd == "check":
            c.add_argument("--dtypes", nargs="+", default=list(_DTYPE_NAMES), metavar="DTYPE",
                           help=f"the dtypes compared (default: {' '.join(_DTYPE_NAMES)})")
            c.add_argument("--no-grad", action="store_true", help="skip the gradient comparison")
            c.add_argument("--arg", action="append", metavar="NAME=VALUE",
                           help="a scalar argument's value, instead of the generated one (repeat per argument); "
                           "a bool or enum given is not swept")
        else:
            c.add_argument("--dtype", default="float32", help=f"the dtype timed (one of {', '.join(_DTYPE_NAMES)})")
            c.add_argument("--sizes", default=None, metavar="N,N,...",
                           help=f"elements of the default 1-d inputs (default {_SIZES}; not with --shape or --inputs)")
            c.add_argument("--no-backward", action="store_true", help="time the forward alone")
            c.add_argument("--smoke", action="store_true",
                           help="the first size only, a few short samples: checks that it runs (timings not to quote)")
            c.add_argument("--out", default=os.path.join(os.getcwd(), "results"),
                           help="folder of the results (CSV, markdown, PNG; default ./results)")
    a = p.parse_args(argv)
    if a.cmd == "new":
        new(a.name, a.dir, a.inputs, a.scalars, a.reduce, a.cuda,
            dict(enum=a.enum, dims=a.dims, shape=a.shape, backward=a.backward))
        return 0
    try:
        return {"info": info, "check": check, "bench": bench}[a.cmd](a)
    except BrokenPipeError:  # `opforge info | head`: the reader left; no traceback, and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
