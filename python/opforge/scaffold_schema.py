"""`opforge new` from a schema: an op of any argument list, computed row by row.

    opforge new "causal_conv1d(Tensor x, Tensor weight, Tensor? bias=None, str activation='none') -> Tensor" \\
        --enum activation=none,silu --dims x=B,D,L --dims weight=D,W --dims bias=D

The first tensor argument is the op's *main* input: the kernels run over its rows (its last dim), one
row per call, on every thread (``opf_parallel_for`` over tasks of rows). The other tensor arguments
are *parameters* (``Tensor?``: may be None): the kernels see them whole, as contiguous float32 (or
float64) arrays. The output is shaped ``like:MAIN`` (a row in, a row out) or ``[MAIN[:-1]]`` (a row
in, one value out: ``--shape``). Scalars (float, float?, int, int?, int[], bool) and enums (``str``
with ``--enum NAME=a,b,c``: an integer in C) reach the kernels in one struct.

The project is a working op before anything is edited. Its placeholder computation uses every
argument: y = s * x + c(row), where s is the product of the numeric scalars, (1 + length) for each
int list, -1 for each true bool and (1 + index) for each enum, and c(row) is the sum over the given parameters p of
p.flatten()[row % p.numel()] (for x (B, D, L) and bias (D,), that is bias[d]: a bias per channel).
With ``[MAIN[:-1]]``, y = s * x.sum(-1) + c(row). Its backward gives the main input's gradient row by
row, and each parameter's gradient summed over the rows: every task adds its rows into its own
accumulators, which are then added in task order, so that no result depends on the thread count.
"""

from __future__ import annotations

import keyword
import os
import re
from dataclasses import dataclass, field
from string import Template

from .scaffold import BEGIN, CONVERT_C, END, _templates, refuse_used_name, write_project

# schema type -> kind
KINDS = {"Tensor": "tensor", "Optional[Tensor]": "tensor?", "float": "float", "Optional[float]": "float?",
         "int": "int", "Optional[int]": "int?", "List[int]": "int[]", "bool": "bool", "str": "enum"}
MAX_LIST = 16  # the most values the generated C takes for an int[] argument
# names the generated C uses itself
RESERVED = {"y", "dy", "dx", "g", "s", "a", "k", "n", "r", "t", "i", "j", "op", "stack", "nin", "nout", "row",
            "rows", "off", "dt", "job", "grad", "buf", "acc", "sum", "c", "p", "pd", "pn", "auto", "char", "const",
            "double", "enum", "extern", "float", "goto", "int", "long", "register", "short", "signed", "sizeof",
            "static", "struct", "switch", "typedef", "union", "unsigned", "void", "volatile", "restrict", "inline",
            "case", "default", "do", "main", "xb", "xo", "xs", "yb", "yo", "ys", "gb", "go", "gs", "gn", "dxb", "dxo",
            "dxs", "lead", "tasks", "kt", "acc_n", "nl", "logged", "sj", "dparams", "params", "out_dt", "torch_kt"}


def _bad(msg: str):
    raise SystemExit(f"opforge new: {msg}")


@dataclass
class Arg:
    name: str
    kind: str  # tensor, tensor?, float, float?, int, int?, int[], bool, enum
    default: object = None
    has_default: bool = False
    values: tuple[str, ...] = ()  # an enum's

    @property
    def is_tensor(self) -> bool:
        return self.kind in ("tensor", "tensor?")

    def decl(self, with_default: bool = True) -> str:
        ty = {"tensor": "Tensor", "tensor?": "Tensor?", "float": "float", "float?": "float?", "int": "int",
              "int?": "int?", "int[]": "int[]", "bool": "bool", "enum": "str"}[self.kind]
        text = f"{ty} {self.name}"
        if with_default and self.has_default:
            d = self.default
            text += "=" + ("None" if d is None else f"'{d}'" if isinstance(d, str) else
                           ("True" if d else "False") if isinstance(d, bool) else repr(d))
        return text


@dataclass
class SchemaSig:
    name: str
    args: list[Arg]
    reduce: bool = False  # output [MAIN[:-1]]
    grads: list[str] = field(default_factory=list)  # the tensor arguments that get gradients ([]: no backward)
    dims: dict[str, list[str]] = field(default_factory=dict)  # tensor -> its dims' names

    # ---- parsing ----------------------------------------------------------------------------------

    @classmethod
    def parse(cls, schema: str, enums: list[str] | None = None, dims: list[str] | None = None,
              shape: str | None = None, backward: str | None = None) -> "SchemaSig":
        import torch

        name = schema.partition("(")[0].strip()
        if not name.isidentifier() or name.startswith("_") or keyword.iskeyword(name):
            _bad(f"the op's name must be a C and Python identifier, got {name!r}")
        try:
            parsed = torch._C.parse_schema(schema)
        except RuntimeError as e:
            _bad(f"cannot parse the schema {schema!r}: {str(e).splitlines()[0]}")
        if len(parsed.returns) != 1 or str(parsed.returns[0].type) != "Tensor":
            _bad(f"the scaffold writes ops that return one Tensor ('-> Tensor'), got '{schema.partition('->')[2].strip()}'"
                 " (more outputs: see how csrc/torch/norm.c returns three)")
        enum_values = {}
        for spec in enums or []:
            ename, _, vals = spec.partition("=")
            values = tuple(v.strip() for v in re.split(r"[,|]", vals) if v.strip())
            if not values:
                _bad(f"--enum takes NAME=a,b,c, got {spec!r}")
            enum_values[ename.strip()] = values
        args = []
        for a in parsed.arguments:
            ty = str(a.type)
            if a.alias_info is not None or a.kwarg_only:
                _bad(f"argument '{a.name}': the scaffold writes ops whose arguments are read-only and positional, "
                     f"got {'an alias annotation (Tensor(a!): an op that writes its input)' if a.alias_info is not None else 'a keyword-only one (after *)'}")
            if ty not in KINDS:
                _bad(f"argument '{a.name}': the scaffold handles Tensor, Tensor?, float, float?, int, int?, int[], bool "
                     f"and str; got {ty}")
            arg = Arg(a.name, KINDS[ty], a.default_value, a.has_default_value())
            if arg.kind == "enum":
                if a.name not in enum_values:
                    _bad(f"str argument '{a.name}' needs its values: --enum {a.name}=first,second,...")
                arg.values = enum_values.pop(a.name)
                if arg.has_default and arg.default not in arg.values:
                    _bad(f"the default of '{a.name}' ({arg.default!r}) is not one of its values {', '.join(arg.values)}")
            args.append(arg)
        if enum_values:
            _bad(f"--enum names no str argument of the schema: {', '.join(enum_values)}")
        sig = cls(name, args)
        tensors = [a.name for a in args if a.is_tensor]
        if not tensors or args[[a.name for a in args].index(tensors[0])].kind != "tensor":
            _bad("the schema needs a Tensor argument (not Tensor?) before any Tensor?: the main input, whose rows "
                 "the kernels run over")
        main = tensors[0]
        if shape in (None, "", f"like:{main}"):
            sig.reduce = False
        elif shape.replace(" ", "") == f"[{main}[:-1]]":
            sig.reduce = True
        else:
            _bad(f"--shape takes like:{main} (a row in, a row out; the default) or [{main}[:-1]] (a row in, one value "
                 f"out), got {shape!r}")
        if backward in (None, ""):
            sig.grads = tensors
        elif backward == "none":
            sig.grads = []
        else:
            sig.grads = [g.strip() for g in backward.split(",") if g.strip()]
            for g in sig.grads:
                if g not in tensors:
                    _bad(f"--backward names {g!r}, which is not a tensor argument ({', '.join(tensors)})")
            if main not in sig.grads:
                _bad(f"--backward must include the main input '{main}' (or be 'none': no autograd)")
            sig.grads = [t for t in tensors if t in sig.grads]  # in the schema's order
        for spec in dims or []:
            tname, _, names = spec.partition("=")
            tname = tname.strip()
            if tname not in tensors:
                _bad(f"--dims names {tname!r}, which is not a tensor argument ({', '.join(tensors)})")
            syms = [s.strip() for s in names.split(",") if s.strip()]
            if not syms or not all(s.isidentifier() for s in syms):
                _bad(f"--dims takes TENSOR=A,B,C (a name per dim), got {spec!r}")
            sig.dims[tname] = syms
        if main in sig.dims and not sig.dims[main]:
            _bad(f"--dims {main}= needs at least one dim: its last is the row")
        sig._check()
        return sig

    def _check(self) -> None:
        names = [a.name for a in self.args]
        for n in names:
            if n in RESERVED:
                _bad(f"{n!r} cannot name an argument here: the generated C uses it (reserved: "
                     f"{', '.join(sorted(RESERVED))})")
            if not n.isidentifier() or keyword.iskeyword(n) or n.startswith("_") or n == self.name \
                    or n.endswith("_h") or n.upper() == n:
                _bad(f"{n!r} cannot name an argument here (not an identifier, the op's own name, or a name the "
                     "generated C derives: ending in _h, or all capitals)")
        syms = {s for d in self.dims.values() for s in d}
        for sym in syms:
            if sym in names or sym in RESERVED or keyword.iskeyword(sym) or sym.startswith("has_"):
                _bad(f"--dims name {sym!r} clashes with an argument or a name the generated C uses")
        for t in self.tensors:
            if "d" + t in names:
                _bad(f"{t!r} and {'d' + t!r}: the generated C names {t!r}'s gradient {'d' + t!r}")

    # ---- views ------------------------------------------------------------------------------------

    @property
    def tensors(self) -> list[str]:
        return [a.name for a in self.args if a.is_tensor]

    @property
    def main(self) -> str:
        return self.tensors[0]

    @property
    def params(self) -> list[Arg]:
        return [a for a in self.args if a.is_tensor][1:]

    @property
    def scalars(self) -> list[Arg]:
        return [a for a in self.args if not a.is_tensor]

    @property
    def param_grads(self) -> list[Arg]:
        return [p for p in self.params if p.name in self.grads]

    def schema(self) -> str:
        return f"{self.name}({', '.join(a.decl() for a in self.args)}) -> Tensor"

    def bwd_schema(self) -> str:
        outs = ", ".join("Tensor" for _ in self.grads)
        return (f"{self.name}_backward(Tensor grad, {', '.join(a.decl(False) for a in self.args)}) -> "
                f"{outs if len(self.grads) == 1 else '(' + outs + ')'}")

    def enums(self) -> str:
        return "; ".join(f"{a.name}: \" {a.name.upper()}_VALUES \"" for a in self.scalars if a.kind == "enum")


# ---- C ------------------------------------------------------------------------------------------------

_C_SCALAR = {"float": "double", "float?": "double", "int": "int64_t", "int?": "int64_t", "bool": "int", "enum": "int"}


def _scalar_fields(sig: SchemaSig) -> str:
    out = []
    for a in sig.scalars:
        if a.kind == "enum":
            out.append(f"    int {a.name}; /* {', '.join(f'{k} {v}' for k, v in enumerate(a.values))} */\n")
        elif a.kind in ("float?", "int?"):
            out.append(f"    {_C_SCALAR[a.kind]} {a.name};\n    int has_{a.name}; /* 0: None */\n")
        elif a.kind == "int[]":
            out.append(f"    int64_t {a.name}[MAX_LIST], {a.name}_len; /* its values, and how many */\n")
        else:
            out.append(f"    {_C_SCALAR[a.kind]} {a.name};\n")
    syms = _symbols(sig)
    if syms:
        out.append(f"    int64_t {', '.join(syms)}; /* the sizes named by --dims */\n")
    return "".join(out) or "    int unused; /* the op has no scalar arguments */\n"


def _symbols(sig: SchemaSig) -> dict[str, tuple[str, int]]:
    """Each --dims name and where the glue reads it: a required tensor's dim where one has it."""
    where: dict[str, tuple[str, int]] = {}
    required = {a.name for a in sig.args if a.kind == "tensor"}
    for t in sorted(sig.tensors, key=lambda t: t not in required):
        for j, sym in enumerate(sig.dims.get(t, [])):
            where.setdefault(sym, (t, j))
    return where


def _param_fields(sig: SchemaSig, real: str) -> str:
    return "".join(f"    const {real} *{p.name};\n    int64_t {p.name}_n; /* its element count; "
                   f"{'NULL and 0 for None' if p.kind == 'tensor?' else 'its sizes are checked by the glue'} */\n"
                   for p in sig.params)


def _grad_fields(sig: SchemaSig, real: str) -> str:
    return "".join(f"    {real} *{p.name}; /* {p.name}_n elements; NULL where {p.name} is None or empty */\n"
                   for p in sig.param_grads) or "    int unused; /* no parameter gets a gradient */\n"


def _header(sig: SchemaSig) -> str:
    n, m, up = sig.name, sig.main, sig.name.upper()
    rows = _row_doc(sig)
    bwd = ""
    if sig.grads:
        bwd = f"""    /* the row's backward: d{m}[i * d{m}_s] for i < n from dy[i * dy_s]{' (one value: dy_s is 0)' if sig.reduce else ''}
     * and {m}; adds the row's share of the parameters' gradients to g (its task's own accumulators) */
    void (*bwd)(float *d{m}, int64_t d{m}_s, const float *dy, int64_t dy_s, const float *{m}, int64_t {m}_s,
                int64_t n, int64_t row, const {n}_args *a, const {n}_grads *g);
"""
        bwd64 = f"""void {n}_bwd64(double *d{m}, int64_t d{m}_s, const double *dy, int64_t dy_s, const double *{m}, int64_t {m}_s,
              int64_t n, int64_t row, const {n}_args64 *a, const {n}_grads64 *g);
"""
    else:
        bwd64 = ""
    enums = "".join(f"#define {a.name.upper()}_VALUES \"{'|'.join(a.values)}\" /* {a.name}: its index in C */\n"
                    for a in sig.scalars if a.kind == "enum")
    grads = f"""
/* Where a row's backward adds the parameters' gradients: its task's accumulators, contiguous, zeroed
 * before the first row; the glue adds the tasks' in task order. */
typedef struct {n}_grads {{
{_grad_fields(sig, 'float')}}} {n}_grads;

typedef struct {n}_grads64 {{
{_grad_fields(sig, 'double')}}} {n}_grads64;
""" if sig.grads else ""
    return f"""/* {n}: the kernel contract shared by the scalar reference ({n}.c) and the ISA variants ({n}_avx2.c,
 * {n}_avx512.c). One row of {m} at a time: {rows}; float32 on raw pointers, strides (the _s
 * arguments) in elements. bfloat16 and float16 rows arrive as float32 copies (stride 1); float64 runs
 * the reference in double ({n}_fwd64). */
#ifndef {up}_H
#define {up}_H

#include <stdint.h>

#include <opforge/runtime.h>

{enums}{'#define MAX_LIST ' + str(MAX_LIST) + ' /* the most values an int[] argument takes */' + chr(10) if any(a.kind == 'int[]' for a in sig.scalars) else ''}
/* The scalar arguments (an enum as its value's index). */
typedef struct {n}_scalars {{
{_scalar_fields(sig)}}} {n}_scalars;

/* Everything a row needs besides the row: the scalars and the parameters, whole, contiguous, in the
 * kernels' type (float; double for float64). */
typedef struct {n}_args {{
    {n}_scalars s;
{_param_fields(sig, 'float')}}} {n}_args;

typedef struct {n}_args64 {{
    {n}_scalars s;
{_param_fields(sig, 'double')}}} {n}_args64;
{grads}
typedef struct {n}_kernels {{
    OPF_VARIANT_HEAD; /* "avx2" and the ISA it needs: opf_variant_pick chooses by them */
    /* row `row` (its index over {m}'s leading dims): y[i * y_s] for i < n{' -- one value, y[0]' if sig.reduce else ''}
     * from {m}[i * {m}_s] */
    void (*fwd)(float *y, int64_t y_s, const float *{m}, int64_t {m}_s, int64_t n, int64_t row, const {n}_args *a);
{bwd}}} {n}_kernels;

extern const {n}_kernels {n}_kernels_ref;
/* The family's variant table: a variant that runs the reference instead (a strided row) says so with
 * opf_variant_fallback(&{n}_variants, &{n}_kernels_ref, "why"), and the log line names what ran. */
extern const opf_variants {n}_variants;

/* float64 (gradcheck, opforge check's float64 row): the reference, in double. */
void {n}_fwd64(double *y, int64_t y_s, const double *{m}, int64_t {m}_s, int64_t n, int64_t row, const {n}_args64 *a);
{bwd64}
/* The placeholder's helpers ({n}.c): delete them with it. */
double {n}_scale(const {n}_scalars *s);
float {n}_shift(const {n}_args *a, int64_t row);

#endif
"""


def _row_doc(sig: SchemaSig) -> str:
    m = sig.main
    d = sig.dims.get(m)
    if not d:
        return f"its last dim, any stride; `row` counts {m}'s rows in order"
    if len(d) == 1:
        return f"{m} ({d[0]}) is one row"
    lead, idx = d[:-1], [s.lower() for s in d[:-1]]
    expr = idx[0]
    for s, i in zip(lead[1:], idx[1:]):  # row = (i0 * S1 + i1) * S2 + i2 ...
        expr = f"{expr} * {s} + {i}" if expr == idx[0] else f"({expr}) * {s} + {i}"
    return f"{m}[{', '.join(idx)}, :] (length {d[-1]}) is row {expr}"


# The placeholder's factor per scalar argument, in the C kernels (s: the scalars struct) and in
# reference.py: the two must agree. {n} is the argument, {values} an enum's list.
_SCALE = {
    "float": ("(double)s->{n}", "{n}"),
    "int": ("(double)s->{n}", "{n}"),
    "float?": ("(s->has_{n} ? (double)s->{n} : 1.0)", "({n} if {n} is not None else 1.0)"),
    "int?": ("(s->has_{n} ? (double)s->{n} : 1.0)", "({n} if {n} is not None else 1.0)"),
    "int[]": ("(1.0 + (double)s->{n}_len)", "(1 + len({n}))"),
    "bool": ("(s->{n} ? -1.0 : 1.0)", "(-1.0 if {n} else 1.0)"),
    "enum": ("(1.0 + s->{n})", "(1 + {values}.index({n}))"),
}


def _scale_expr(sig: SchemaSig, lang: int) -> str:
    """The placeholder's s: in C (lang 0) or Python (lang 1)."""
    parts = [_SCALE[a.kind][lang].format(n=a.name, values=list(a.values)) for a in sig.scalars]
    return " * ".join(parts) if parts else "1.0"


def _shift(sig: SchemaSig, real: str) -> str:
    lines = "".join(f"    if (a->{p.name}_n) c += a->{p.name}[row % a->{p.name}_n];\n" for p in sig.params)
    return f"    {real} c = 0;\n{lines}    return c;\n"


def _ref_kernels(sig: SchemaSig) -> str:
    n, m = sig.name, sig.main
    scal = ", ".join(f"{a.name}" for a in sig.scalars) or "none"
    pars = ", ".join(p.name for p in sig.params)
    doc = (f"s * {m}.sum(-1) + c(row)" if sig.reduce else f"s * {m} + c(row)")
    shift_doc = (f"c(row) = the sum over the given parameters ({pars}) of p.flatten()[row % p.numel()]"
                 if sig.params else "c(row) = 0 (no parameters)")
    if sig.reduce:
        fwd = f"""    const REAL s = (REAL){n}_scale(&a->s);
    REAL sum = 0;
    for (int64_t i = 0; i < n; i++) sum += {m}[i * {m}_s];
    y[0] = s * sum + SHIFT(a, row);
"""
        bwd = f"""    const REAL s = (REAL){n}_scale(&a->s), g0 = dy[0];
    for (int64_t i = 0; i < n; i++) d{m}[i * d{m}_s] = s * g0;
{''.join(f'    if (g->{p.name}) g->{p.name}[row % a->{p.name}_n] += g0;' + chr(10) for p in sig.param_grads)}"""
    else:
        fwd = f"""    const REAL s = (REAL){n}_scale(&a->s), c = SHIFT(a, row);
    for (int64_t i = 0; i < n; i++) y[i * y_s] = s * {m}[i * {m}_s] + c;
"""
        bwd = f"""    const REAL s = (REAL){n}_scale(&a->s);
    REAL sum = 0;
    for (int64_t i = 0; i < n; i++) {{
        const REAL g0 = dy[i * dy_s];
        d{m}[i * d{m}_s] = s * g0;
        sum += g0;
    }}
{''.join(f'    if (g->{p.name}) g->{p.name}[row % a->{p.name}_n] += sum;' + chr(10) for p in sig.param_grads)}"""

    def inst(real: str, suffix: str, args: str, grads: str, shift: str) -> str:
        f = (f"static void fwd_ref{suffix}" if not suffix else f"void {n}_fwd64")
        out = f"""{f}({real} *y, int64_t y_s, const {real} *{m}, int64_t {m}_s, int64_t n, int64_t row, const {args} *a) {{
{fwd.replace('REAL', real).replace('SHIFT', shift)}}}
"""
        if sig.grads:
            b = (f"static void bwd_ref{suffix}" if not suffix else f"void {n}_bwd64")
            out += f"""
{b}({real} *d{m}, int64_t d{m}_s, const {real} *dy, int64_t dy_s, const {real} *{m}, int64_t {m}_s, int64_t n,
       int64_t row, const {args} *a, const {grads} *g) {{
{bwd.replace('REAL', real)}}}
"""
        return out

    return f"""{BEGIN}: the computation. Edit these kernels (the float pair, then the same in double for float64),
 * the variants in {n}_avx2.c and {n}_avx512.c, and reference.py. */

/* placeholder: y = {doc}, with s = the product of the numeric scalars, -1 per true bool and
 * (1 + index) per enum ({scal}), and {shift_doc}. */
double {n}_scale(const {n}_scalars *s) {{ return {_scale_expr(sig, 0)}; }}

float {n}_shift(const {n}_args *a, int64_t row) {{
{_shift(sig, 'float')}}}

static double shift64(const {n}_args64 *a, int64_t row) {{
{_shift(sig, 'double')}}}

{inst('float', '', f'{n}_args', f'{n}_grads', f'{n}_shift')}
{inst('double', '64', f'{n}_args64', f'{n}_grads64', 'shift64')}{END}
"""


# ---- the ISA variants: the placeholder vectorised, the reference where a row is strided -------------------

_ISA = {
    "avx2": dict(vec="__m256", lanes=8, set1="_mm256_set1_ps", load="_mm256_loadu_ps", store="_mm256_storeu_ps",
                 mul="_mm256_mul_ps", add="_mm256_add_ps", zero="_mm256_setzero_ps()", hsum="hsum8",
                 flags="-mavx2 -mfma -mf16c", isa="OPF_ISA_AVX2", what="AVX2", cpus="AVX2",
                 hsum_def="""
/* The sum of v's 8 lanes. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
"""),
    "avx512": dict(vec="__m512", lanes=16, set1="_mm512_set1_ps", load="_mm512_loadu_ps", store="_mm512_storeu_ps",
                   mul="_mm512_mul_ps", add="_mm512_add_ps", zero="_mm512_setzero_ps()", hsum="_mm512_reduce_add_ps",
                   flags="-mavx512f -mavx512bw -mavx512vl -mavx512dq (and AVX2's)", isa="OPF_ISA_AVX512",
                   what="AVX-512", cpus="AVX-512 (F, BW, VL, DQ)", hsum_def=""),
}


def _variant_file(sig: SchemaSig, isa: str) -> str:
    n, m, v = sig.name, sig.main, _ISA[isa]
    V, L = v["vec"], v["lanes"]
    fallback = f"""        opf_variant_fallback(&{n}_variants, &{n}_kernels_ref, "strided row");"""
    if sig.reduce:
        fwd = f"""static void fwd_{isa}(float *y, int64_t y_s, const float *{m}, int64_t {m}_s, int64_t n, int64_t row,
{' ' * (len(isa) + 13)}const {n}_args *a) {{
    if ({m}_s != 1) {{ /* a strided row: the reference runs it, and the log line says so */
{fallback}
        {n}_kernels_ref.fwd(y, y_s, {m}, {m}_s, n, row, a);
        return;
    }}
    {V} acc = {v['zero']};
    int64_t i = 0;
    for (; i + {L} <= n; i += {L}) acc = {v['add']}(acc, {v['load']}({m} + i));
    float sum = {v['hsum']}(acc);
    for (; i < n; i++) sum += {m}[i];
    y[0] = (float){n}_scale(&a->s) * sum + {n}_shift(a, row);
}}
"""
        bwd = f"""
static void bwd_{isa}(float *d{m}, int64_t d{m}_s, const float *dy, int64_t dy_s, const float *{m}, int64_t {m}_s,
{' ' * (len(isa) + 13)}int64_t n, int64_t row, const {n}_args *a, const {n}_grads *g) {{
    if (d{m}_s != 1) {{
{fallback}
        {n}_kernels_ref.bwd(d{m}, d{m}_s, dy, dy_s, {m}, {m}_s, n, row, a, g);
        return;
    }}
    const float s = (float){n}_scale(&a->s), g0 = dy[0];
    const {V} d = {v['set1']}(s * g0);
    int64_t i = 0;
    for (; i + {L} <= n; i += {L}) {v['store']}(d{m} + i, d);
    for (; i < n; i++) d{m}[i] = s * g0;
{''.join(f'    if (g->{p.name}) g->{p.name}[row % a->{p.name}_n] += g0;' + chr(10) for p in sig.param_grads)}}}
""" if sig.grads else ""
    else:
        fwd = f"""static void fwd_{isa}(float *y, int64_t y_s, const float *{m}, int64_t {m}_s, int64_t n, int64_t row,
{' ' * (len(isa) + 13)}const {n}_args *a) {{
    if (y_s != 1 || {m}_s != 1) {{ /* a strided row: the reference runs it, and the log line says so */
{fallback}
        {n}_kernels_ref.fwd(y, y_s, {m}, {m}_s, n, row, a);
        return;
    }}
    const float s = (float){n}_scale(&a->s), c = {n}_shift(a, row);
    const {V} sv = {v['set1']}(s), cv = {v['set1']}(c);
    int64_t i = 0;
    for (; i + {L} <= n; i += {L}) {v['store']}(y + i, {v['add']}({v['mul']}(sv, {v['load']}({m} + i)), cv));
    for (; i < n; i++) y[i] = s * {m}[i] + c;
}}
"""
        bwd = f"""
static void bwd_{isa}(float *d{m}, int64_t d{m}_s, const float *dy, int64_t dy_s, const float *{m}, int64_t {m}_s,
{' ' * (len(isa) + 13)}int64_t n, int64_t row, const {n}_args *a, const {n}_grads *g) {{
    if (d{m}_s != 1 || dy_s != 1) {{ /* a strided row: the reference runs it, and the log line says so */
{fallback}
        {n}_kernels_ref.bwd(d{m}, d{m}_s, dy, dy_s, {m}, {m}_s, n, row, a, g);
        return;
    }}
    const float s = (float){n}_scale(&a->s);
    const {V} sv = {v['set1']}(s);
    {V} acc = {v['zero']};
    int64_t i = 0;
    for (; i + {L} <= n; i += {L}) {{
        const {V} g0 = {v['load']}(dy + i);
        {v['store']}(d{m} + i, {v['mul']}(sv, g0));
        acc = {v['add']}(acc, g0);
    }}
    float sum = {v['hsum']}(acc); /* {L} partial sums: the reference's one running sum rounds differently */
    for (; i < n; i++) {{
        d{m}[i] = s * dy[i];
        sum += dy[i];
    }}
{''.join(f'    if (g->{p.name}) g->{p.name}[row % a->{p.name}_n] += sum;' + chr(10) for p in sig.param_grads)}}}
""" if sig.grads else ""
    table = f"{{\"{isa}\", {v['isa']}, fwd_{isa}{', bwd_' + isa if sig.grads else ''}}}"
    return f"""/*
 * {n}, {v['what']}. Built with {v['flags']} because of the _{isa}.c suffix, and run only on
 * CPUs that have {v['cpus']} (opf_variant_pick). Options: -ffp-contract=off, so a + b * c rounds as the
 * reference's does unless you write an FMA.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "{n}.h"
{v['hsum_def']}
{BEGIN}: the computation, {L} floats at a time. The glue hands this variant rows of stride 1 (it
 * copies a row that is not into a buffer first: a bfloat16 row, a transposed x, the stride-0 gradient of
 * y.sum().backward()); called with other strides, it runs the reference and says so (opf_variant_fallback). */

{fwd}{bwd}{END}

const {n}_kernels {n}_kernels_{isa} = {table};
"""


# ---- the glue: unboxing, checks, outputs, the row tasks, descriptors --------------------------------------


def _dims_checks(sig: SchemaSig) -> str:
    """opf_check_dims / opf_check_size calls from --dims: a name seen twice is one size."""
    out, seen = [], {}
    optional = {p.name for p in sig.params if p.kind == "tensor?"}
    for a in sig.args:
        if not a.is_tensor:
            continue
        t = a.name
        if t not in sig.dims:
            if t == sig.main:
                out.append(f"    if ({t}->ndim < 1) opf_fail(op, \"argument '{t}' must have at least 1 dim (its last is the "
                           f"row), got a 0-d tensor\");\n")
            continue
        syms = sig.dims[t]
        lines = [f"opf_check_dims(op, \"{t}\", {t}, {len(syms)}, \"({', '.join(syms)})\");"]
        for j, sym in enumerate(syms):
            if sym in seen:
                r, rj = seen[sym]
                call = f"opf_check_size(op, \"{t}\", {t}, {j}, \"{r}\", {r}, {rj}); /* {sym} */"
                lines.append(f"if ({r}) {call}" if r in optional else call)
            else:
                seen[sym] = (t, j)
        if t in optional:
            out.append(f"    if ({t}) {{\n" + "".join(f"        {ln}\n" for ln in lines) + "    }\n")
        else:
            out.extend(f"    {ln}\n" for ln in lines)
    return "".join(out)


def _glue(sig: SchemaSig) -> str:
    n, m, params, up = sig.name, sig.main, sig.params, sig.name.upper()
    np_ = len(params)
    tensors = [a for a in sig.args if a.is_tensor]
    check_params = ", ".join(f"const opf_tensor *{a.name}" for a in tensors)
    check_args = ", ".join(f"&{a.name}" if a.kind == "tensor" else f"{a.name}_h ? &{a.name} : NULL" for a in tensors)
    param_checks = "".join(
        (f"    if ({p.name}) {{\n        opf_check_device(op, \"{p.name}\", {p.name}, \"{m}\", {m});\n"
         f"        opf_check_dtype(op, \"{p.name}\", {p.name}, OPF_DTYPES_FLOAT);\n    }}\n") if p.kind == "tensor?" else
        (f"    opf_check_device(op, \"{p.name}\", {p.name}, \"{m}\", {m});\n"
         f"    opf_check_dtype(op, \"{p.name}\", {p.name}, OPF_DTYPES_FLOAT);\n") for p in params)

    def take(base: int) -> str:
        out, k = [], base
        for a in sig.args:
            if a.kind == "tensor":
                out.append(f"    OPF_ARG_TENSOR({a.name}, stack, {k});\n")
            elif a.kind == "tensor?":
                out.append(f"    OPF_OWNED AtenTensorHandle {a.name}_h = opf_arg_optional_tensor(stack[{k}]); /* NULL: None */\n")
            k += 1
        k = base  # then the scalars, enums last (a refused enum raises: everything before it is released)
        for a in sig.args:
            if a.kind == "float":
                out.append(f"    const double {a.name} = opf_arg_double(stack[{k}]);\n")
            elif a.kind == "float?":
                out.append(f"    double {a.name} = 0;\n    const int has_{a.name} = opf_arg_optional_double(stack[{k}], &{a.name});\n")
            elif a.kind == "int?":
                out.append(f"    int64_t {a.name} = 0;\n    const int has_{a.name} = opf_arg_optional_int(stack[{k}], &{a.name});\n")
            elif a.kind == "int[]":
                out.append(f"    int64_t {a.name}[MAX_LIST];\n    const int64_t {a.name}_len = opf_arg_int_list(OP, \"{a.name}\", "
                           f"stack[{k}], {a.name}, MAX_LIST);\n")
            elif a.kind == "int":
                out.append(f"    const int64_t {a.name} = opf_arg_int(stack[{k}]);\n")
            elif a.kind == "bool":
                out.append(f"    const int {a.name} = opf_arg_bool(stack[{k}]);\n")
            k += 1
        k = base
        for a in sig.args:
            if a.kind == "enum":
                out.append(f"    const int {a.name} = opf_arg_enum(OP, \"{a.name}\", stack[{k}], {a.name.upper()}_VALUES);\n")
            k += 1
        return "".join(out)

    infos = "".join(f"    const opf_tensor {a.name} = opf_tensor_info(OP, \"{a.name}\", {a.name}_h);\n" if a.kind == "tensor"
                    else f"    const opf_tensor {a.name} = {a.name}_h ? opf_tensor_info(OP, \"{a.name}\", {a.name}_h) : "
                         f"(opf_tensor){{0}};\n" for a in tensors)
    optional = {p.name for p in sig.params if p.kind == "tensor?"}
    scalar_init = ", ".join([f".{a.name} = {a.name}" for a in sig.scalars if a.kind != "int[]"] +
                            [f".{a.name}_len = {a.name}_len" for a in sig.scalars if a.kind == "int[]"] +
                            [f".has_{a.name} = has_{a.name}" for a in sig.scalars if a.kind in ("float?", "int?")] +
                            [f".{sym} = {t}.sizes[{j}]" if t not in optional else f".{sym} = {t}_h ? {t}.sizes[{j}] : 0"
                             for sym, (t, j) in _symbols(sig).items()]) or "0"
    params_arr = ", ".join([f"&{p.name}" if p.kind == "tensor" else f"{p.name}_h ? &{p.name} : NULL" for p in params]
                           + ["NULL"])
    logged = "".join(f"    logged[nl++] = {a.name};\n" if a.kind == "tensor" else
                     f"    if ({a.name}_h) logged[nl++] = {a.name};\n" for a in tensors)
    enum_p = "".join(f"    P_{p.name.upper()},\n" for p in params)
    names = ", ".join(f'"{p.name}"' for p in params) or '""'
    args_of = "".join(f", .{p.name} = p->data[P_{p.name.upper()}], .{p.name}_n = p->numel[P_{p.name.upper()}]"
                      for p in params)
    grads_of = ", ".join(f".{p.name} = p->numel[P_{p.name.upper()}] ? acc + off[P_{p.name.upper()}] : NULL"
                         for p in sig.param_grads) or "0"
    grad_flags = ", ".join("1" if p.name in sig.grads else "0" for p in params) or "0"
    flops = f"2*numel({m})"
    bwd_args = ",".join(["grad0"] + [a.name for a in sig.args])
    shape_fwd = f"[{m}[:-1]]" if sig.reduce else f"like:{m}"
    shape_bwd = ";".join([f"like:{m}"] + [f"[{p.name}[:]] dtype={p.name}" + (f" if {p.name}" if p.kind == "tensor?" else "")
                                          for p in sig.param_grads])
    grad_check = (f"    opf_check_same_shape(OP, \"grad\", &g, \"{m}\", &{m});\n" if not sig.reduce else
                  f"    opf_check_dims(OP, \"grad\", &g, {m}.ndim - 1, NULL);\n"
                  f"    for (int64_t d = 0; d < g.ndim; d++) opf_check_size(OP, \"grad\", &g, d, \"{m}\", &{m}, d);\n")
    pg = sig.param_grads
    grad_allocs = "".join(
        f"    OPF_OWNED AtenTensorHandle d{p.name}_h = {'' if p.kind == 'tensor' else p.name + '_h ? '}"
        f"opf_empty(OP, {p.name}.ndim, {p.name}.sizes, {p.name}.dtype, &{m})"
        f"{'' if p.kind == 'tensor' else ' : opf_empty(OP, 1, (int64_t[]){0}, ' + m + '.dtype, &' + m + ')'};\n"
        f"    const opf_tensor d{p.name} = opf_tensor_info(OP, \"d{p.name}\", d{p.name}_h);\n" for p in pg)
    dparams_arr = ", ".join((f"{p.name}_h ? &d{p.name} : NULL" if p.kind == "tensor?" else f"&d{p.name}")
                            if p.name in sig.grads else "NULL" for p in params) or "NULL"
    grad_returns = "".join(f"    OPF_RETURN(stack, {k}, d{t}_h);\n" for k, t in enumerate(sig.grads))
    bwd = ""
    if sig.grads:
        bwd = Template(_BWD).substitute(
            n=n, m=m, take=take(1), infos=infos, check_args=check_args, scalar_init=scalar_init, grad_check=grad_check,
            copy_lists_bwd="".join(f"        memcpy(s.{a.name}, {a.name}, sizeof s.{a.name});\n" for a in sig.scalars
                                   if a.kind == "int[]"),
            grad_allocs=grad_allocs, params_arr=params_arr, dparams_arr=dparams_arr, grad_returns=grad_returns,
            logged=logged, nlog=len(tensors) + 1 + len(sig.grads), grads_of=grads_of, bwd_schema=sig.bwd_schema(),
            logged_grads="".join(f"    logged[nl++] = d{t};\n" for t in sig.grads))
    desc_bwd = f"""
     .backward = "{n}_backward",
     .backward_args = "{bwd_args}", /* what the backward is called with: the gradient of output 0, the arguments */
     .backward_grads = "{','.join(sig.grads)}",      /* its outputs are the gradients of these */""" if sig.grads else ""
    enums = sig.enums()
    desc_enums = f"\n     .enums = \"{enums}\", /* the values of str arguments */" if enums else ""
    table_bwd = f""",
    {{.schema = "{sig.bwd_schema()}",
     .cpu = {n}_backward_cpu,
     .shape = "{shape_bwd}",{desc_enums}
     .flops = "3*numel({m})",
     .meta = 1}}""" if sig.grads else ""
    return Template(_GLUE).substitute(
        n=n, m=m, NP=np_, enum_p=enum_p, names=names, args_of=args_of, grad_flags=grad_flags,
        check_params=check_params, dims_checks=_dims_checks(sig), param_checks=param_checks, take=take(0),
        infos=infos, check_args=check_args, scalar_init=scalar_init, params_arr=params_arr, logged=logged,
        copy_lists="".join(f"    memcpy(s.{a.name}, {a.name}, sizeof s.{a.name});\n" for a in sig.scalars if a.kind == "int[]"),
        nlog=len(tensors) + 1, schema=sig.schema(), REDUCE=int(sig.reduce), bwd=bwd, shape_fwd=shape_fwd,
        desc_bwd=desc_bwd, desc_enums=desc_enums, flops=flops, table_bwd=table_bwd, UP=up,
        alloc_y=(f"opf_empty(OP, {m}.ndim - 1, {m}.sizes, {m}.dtype, &{m})" if sig.reduce else f"opf_empty_like(OP, &{m})"),
        bwd_ref=", bwd_ref" if sig.grads else "", convert=CONVERT_C)


_GLUE = r"""/* ---- the variant table: the reference, and the AVX2 and AVX-512 variants where the CPU has them ---- */

const ${n}_kernels ${n}_kernels_ref = {"ref", OPF_ISA_REF, fwd_ref${bwd_ref}};

/* A build without ${n}_avx2.c or ${n}_avx512.c leaves its weak reference NULL; opf_variant_pick skips it. */
extern const ${n}_kernels ${n}_kernels_avx2 __attribute__((weak));
extern const ${n}_kernels ${n}_kernels_avx512 __attribute__((weak));
const opf_variants ${n}_variants = OPF_VARIANTS("${n}", &${n}_kernels_ref, &${n}_kernels_avx2, &${n}_kernels_avx512);
OPF_KERNEL_FAMILIES(&${n}_variants) /* `opforge info --load` lists them */

/* The variant for the ISA in force (OPFORGE_ISA, opforge.set_isa); the log line names it. */
static const ${n}_kernels *kernels(void) { return opf_variant_pick(&${n}_variants, opf_isa_current()); }

/* ---- the parameters: contiguous, in the kernels' type -------------------------------------------- */

enum {
${enum_p}    NPARAMS
};
static const char *const PARAM_NAMES[NPARAMS + 1] = {${names}};
static const int PARAM_GRAD[NPARAMS + 1] = {${grad_flags}}; /* 1: the backward gives its gradient */

${convert}
static int is_contiguous(const opf_tensor *t) {
    int64_t want = 1;
    for (int64_t d = t->ndim - 1; d >= 0; d--) {
        if (t->sizes[d] != 1 && t->strides[d] != want) return 0;
        want *= t->sizes[d];
    }
    return 1;
}

typedef struct prepared {
    AtenTensorHandle h[NPARAMS + 1]; /* the copies made (NULL: the parameter's own memory is read) */
    const void *data[NPARAMS + 1];   /* NULL: None, or no elements */
    int64_t numel[NPARAMS + 1];
} prepared;

static void prepared_release(prepared *p) {
    for (int k = 0; k < NPARAMS; k++) opf_tensor_release(&p->h[k]);
}

/* The parameters as the kernels read them: contiguous, of the kernels' type kt. One that is not (a
 * float32 weight beside float64 x, a bfloat16 bias, a transposed view) is copied: parameters are
 * small next to the rows, and this is the one copy the op makes. */
static void prepare(const char *op, const opf_tensor *const *params, opf_dtype kt, prepared *p) {
    for (int k = 0; k < NPARAMS; k++) {
        const opf_tensor *t = params[k];
        if (!t || !t->numel) continue;
        p->numel[k] = t->numel;
        const opf_dtype dt = opf_check_dtype(op, PARAM_NAMES[k], t, OPF_DTYPES_FLOAT);
        if (dt == kt && is_contiguous(t)) {
            p->data[k] = t->data;
            continue;
        }
        const int32_t torch_kt = kt == OPF_F64 ? aoti_torch_dtype_float64() : aoti_torch_dtype_float32();
        p->h[k] = opf_empty(op, t->ndim, t->sizes, torch_kt, t);
        const opf_tensor c = opf_tensor_info(op, "parameter copy", p->h[k]);
        convert(&c, kt, t, dt);
        p->data[k] = c.data;
    }
}

static ${n}_args args_of(const ${n}_scalars *s, const prepared *p) {
    return (${n}_args){.s = *s${args_of}};
}

static ${n}_args64 args64_of(const ${n}_scalars *s, const prepared *p) {
    return (${n}_args64){.s = *s${args_of}};
}

/* ---- rows and tasks ------------------------------------------------------------------------------- */

#define REDUCE ${REDUCE} /* 1: a row in, one value out (the output is ${m}'s shape without its last dim) */
#define TASKS 64          /* the rows are split into at most this many tasks: work for 64 threads */
#define TASK_ELEMS 16384  /* and tasks of this many elements at least: a hand-off costs microseconds */

/* The split depends on the sizes alone, never on the thread count: each task's sums are its own
 * and are added in task order, so every result is the same at any thread count. */
static int64_t task_count(int64_t rows, int64_t n) {
    int64_t t = rows * (n > 0 ? n : 1) / TASK_ELEMS;
    if (t > TASKS) t = TASKS;
    if (t > rows) t = rows;
    return t < 1 && rows ? 1 : t;
}

static int64_t first_row(int64_t task, int64_t tasks, int64_t rows) { return task * rows / tasks; }

/* Where row r of t starts: r unravelled over t's first `lead` dims. */
static int64_t offset_of(const opf_tensor *t, int64_t lead, int64_t r) {
    int64_t off = 0;
    for (int64_t d = lead - 1; d >= 0; d--) {
        off += (r % t->sizes[d]) * t->strides[d];
        r /= t->sizes[d];
    }
    return off;
}

static int64_t col_stride(const opf_tensor *t) { return t->ndim ? t->strides[t->ndim - 1] : 1; }

/* A row to a float32 row of stride 1 and back: bfloat16 and float16 rows, and float32 rows of other
 * strides for a vector variant (a transposed x, the stride-0 gradient of y.sum().backward()), reach the
 * kernels that way, in per-task buffers. */
static void load_row(float *dst, const void *src, int64_t off, int64_t st, int64_t len, opf_dtype dt) {
    const uint16_t *h = (const uint16_t *)src + off;
    if (dt == OPF_F32)
        for (int64_t i = 0; i < len; i++) dst[i] = ((const float *)src)[off + i * st];
    else if (dt == OPF_BF16 && st == 1) /* the common case, apart: the compiler vectorises it */
        for (int64_t i = 0; i < len; i++) dst[i] = opf_bf16_to_f32(h[i]);
    else if (dt == OPF_BF16)
        for (int64_t i = 0; i < len; i++) dst[i] = opf_bf16_to_f32(h[i * st]);
    else
        for (int64_t i = 0; i < len; i++) dst[i] = opf_f16_to_f32(h[i * st]);
}

static void store_row(void *dst, int64_t off, int64_t st, const float *src, int64_t len, opf_dtype dt) {
    uint16_t *h = (uint16_t *)dst + off;
    if (dt == OPF_F32)
        for (int64_t i = 0; i < len; i++) ((float *)dst)[off + i * st] = src[i];
    else if (dt == OPF_BF16 && st == 1)
        for (int64_t i = 0; i < len; i++) h[i] = opf_f32_to_bf16(src[i]);
    else if (dt == OPF_BF16)
        for (int64_t i = 0; i < len; i++) h[i * st] = opf_f32_to_bf16(src[i]);
    else
        for (int64_t i = 0; i < len; i++) h[i * st] = opf_f32_to_f16(src[i]);
}

typedef struct fwd_job {
    const ${n}_kernels *k;
    const opf_tensor *${m}, *y;
    opf_dtype dt;
    int64_t rows, n, tasks;
    float *buf; /* per task, a row of ${m} and one of y as float32 of stride 1; NULL: the kernels read in place */
    const ${n}_args *a;
    const ${n}_args64 *a64;
} fwd_job;

static void fwd_tasks(int64_t begin, int64_t end, void *ctx) {
    const fwd_job *j = ctx;
    const int64_t lead = j->${m}->ndim - 1, n = j->n, xs = col_stride(j->${m}), ys = REDUCE ? 0 : col_stride(j->y);
    for (int64_t t = begin; t < end; t++) {
        float *xb = j->buf ? j->buf + t * 2 * (n + 1) : NULL, *yb = xb ? xb + n + 1 : NULL;
        for (int64_t r = first_row(t, j->tasks, j->rows); r < first_row(t + 1, j->tasks, j->rows); r++) {
            const int64_t xo = offset_of(j->${m}, lead, r), yo = offset_of(j->y, lead, r);
            if (j->dt == OPF_F64) {
                ${n}_fwd64((double *)j->y->data + yo, ys, (const double *)j->${m}->data + xo, xs, n, r, j->a64);
            } else if (!j->buf) {
                j->k->fwd((float *)j->y->data + yo, ys, (const float *)j->${m}->data + xo, xs, n, r, j->a);
            } else {
                load_row(xb, j->${m}->data, xo, xs, n, j->dt);
                j->k->fwd(yb, 1, xb, 1, n, r, j->a);
                store_row(j->y->data, yo, ys, yb, REDUCE ? 1 : n, j->dt);
            }
        }
    }
}

/* Rows of ${m} (its last dim) over every thread: tasks of whole rows. */
static void run_fwd(const char *op, opf_dtype dt, const opf_tensor *${m}, const opf_tensor *y, const ${n}_scalars *s,
                    const opf_tensor *const *params) {
    __attribute__((cleanup(prepared_release))) prepared p = {.numel = {0}};
    prepare(op, params, dt == OPF_F64 ? OPF_F64 : OPF_F32, &p);
    const ${n}_args a = args_of(s, &p);
    const ${n}_args64 a64 = args64_of(s, &p);
    const int64_t n = ${m}->sizes[${m}->ndim - 1], rows = n ? ${m}->numel / n : y->numel;
    const int64_t tasks = task_count(rows, n);
    const ${n}_kernels *k = kernels();
    const int strided = col_stride(${m}) != 1 || (!REDUCE && col_stride(y) != 1);
    float *buf = NULL;
    OPF_OWNED AtenTensorHandle buf_h = NULL;
    if (dt == OPF_BF16 || dt == OPF_F16 || (dt == OPF_F32 && strided && k != &${n}_kernels_ref))
        buf_h = opf_workspace(op, tasks * 2 * (n + 1), ${m}, &buf);
    fwd_job j = {k, ${m}, y, dt, rows, n, tasks, buf, &a, &a64};
    opf_parallel_for(0, tasks, 1, fwd_tasks, &j);
}

/* ---- the ops ---------------------------------------------------------------------------------------- */

/* The checks eager and the fake kernel share (the fake kernel runs this glue on meta tensors):
 * devices, dtypes (parameters of any float dtype: a float32 weight beside a bfloat16 ${m} is fine),
 * dims. Edit the dims to your op's with opf_check_dims and opf_check_size (opforge new --dims). */
static opf_dtype check_inputs(const char *op, ${check_params}) {
    opf_check_device(op, "${m}", ${m}, "${m}", ${m});
    const opf_dtype dt = opf_check_dtype(op, "${m}", ${m}, OPF_DTYPES_FLOAT);
${param_checks}${dims_checks}    return dt;
}

/* ${schema} */
static void ${n}_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    static const char OP[] = "${n}::${n}";
${take}    const double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
${infos}    const opf_dtype dt = check_inputs(OP, ${check_args});
    OPF_OWNED AtenTensorHandle y_h = ${alloc_y};
    const opf_tensor y = opf_tensor_info(OP, "y", y_h);
    if (opf_is_meta(&y)) { /* checked and allocated: all a fake kernel needs */
        OPF_RETURN(stack, 0, y_h);
        return;
    }
    ${n}_scalars s = {${scalar_init}};
${copy_lists}    run_fwd(OP, dt, &${m}, &y, &s, (const opf_tensor *const[]){${params_arr}});
    opf_tensor logged[${nlog}];
    int nl = 0;
${logged}    logged[nl++] = y;
    opf_log_call(OP, t0, nl, logged);
    OPF_RETURN(stack, 0, y_h);
}
${bwd}
/* ---- descriptors: the Python layer wires the fake kernel, autograd and autocast from these -------- */

OPF_OP_TABLE(
    {.schema = "${schema}",
     .cpu = ${n}_cpu,
     .shape = "${shape_fwd}", /* the output's shape and dtype (csrc/include/opforge/op.h) */${desc_bwd}${desc_enums}
     .autocast = OPF_AUTOCAST_LOWER, /* under autocast: runs in its dtype (bfloat16 / float16) */
     .flops = "${flops}",           /* for torch.utils.flop_counter */
     .meta = 1}${table_bwd})        /* meta: the glue takes meta tensors, so compile refuses what eager refuses */
"""

_BWD = r"""
typedef struct bwd_job {
    const ${n}_kernels *k;
    const opf_tensor *g, *${m}, *d${m};
    opf_dtype dt;
    int64_t rows, n, tasks;
    float *buf;   /* per task, rows of grad, ${m} and d${m} as float32 of stride 1; NULL: read in place */
    void *acc;    /* per task, acc_n accumulators of the kernels' type: the parameters' gradients */
    int64_t acc_n;
    const int64_t *off; /* parameter k's accumulators start at off[k] in a task's */
    const prepared *p;
    const ${n}_args *a;
    const ${n}_args64 *a64;
} bwd_job;

static void bwd_tasks(int64_t begin, int64_t end, void *ctx) {
    const bwd_job *j = ctx;
    const int64_t lead = j->${m}->ndim - 1, n = j->n, xs = col_stride(j->${m}), dxs = col_stride(j->d${m});
    const int64_t gs = REDUCE ? 0 : col_stride(j->g), gn = REDUCE ? 1 : n;
    const int64_t *off = j->off;
    const prepared *p = j->p;
    for (int64_t t = begin; t < end; t++) {
        float *gb = j->buf ? j->buf + t * 3 * (n + 1) : NULL, *xb = gb ? gb + n + 1 : NULL, *dxb = xb ? xb + n + 1 : NULL;
        for (int64_t r = first_row(t, j->tasks, j->rows); r < first_row(t + 1, j->tasks, j->rows); r++) {
            const int64_t xo = offset_of(j->${m}, lead, r), dxo = offset_of(j->d${m}, lead, r);
            const int64_t go = offset_of(j->g, lead, r);
            if (j->dt == OPF_F64) {
                double *acc = (double *)j->acc + t * j->acc_n;
                (void)acc, (void)off, (void)p;
                const ${n}_grads64 g = {${grads_of}};
                ${n}_bwd64((double *)j->d${m}->data + dxo, dxs, (const double *)j->g->data + go, gs,
                        (const double *)j->${m}->data + xo, xs, n, r, j->a64, &g);
            } else {
                float *acc = (float *)j->acc + t * j->acc_n;
                (void)acc;
                const ${n}_grads g = {${grads_of}};
                if (!j->buf) {
                    j->k->bwd((float *)j->d${m}->data + dxo, dxs, (const float *)j->g->data + go, gs,
                              (const float *)j->${m}->data + xo, xs, n, r, j->a, &g);
                } else {
                    load_row(gb, j->g->data, go, gs, gn, j->dt);
                    load_row(xb, j->${m}->data, xo, xs, n, j->dt);
                    j->k->bwd(dxb, 1, gb, REDUCE ? 0 : 1, xb, 1, n, r, j->a, &g);
                    store_row(j->d${m}->data, dxo, dxs, dxb, n, j->dt);
                }
            }
        }
    }
}

typedef struct sum_job {
    const void *acc;
    int64_t acc_n, tasks, off;
    opf_dtype kt;
    const opf_tensor *out;
    opf_dtype out_dt;
} sum_job;

/* Elements [begin, end) of a parameter's gradient: its tasks' accumulators added in task order. */
static void sum_tasks(int64_t begin, int64_t end, void *ctx) {
    const sum_job *j = ctx;
    for (int64_t i = begin; i < end; i++) {
        double sum = 0;
        if (j->kt == OPF_F64) {
            for (int64_t t = 0; t < j->tasks; t++) sum += ((const double *)j->acc)[t * j->acc_n + j->off + i];
        } else {
            float s = 0;
            for (int64_t t = 0; t < j->tasks; t++) s += ((const float *)j->acc)[t * j->acc_n + j->off + i];
            sum = s;
        }
        opf_store_elem(j->out->data, i, j->out_dt, sum);
    }
}

#define ACC_MAX (1 << 24) /* accumulators at most (tasks x the parameters' elements): fewer tasks beyond */

static void run_bwd(const char *op, opf_dtype dt, const opf_tensor *g, const opf_tensor *${m}, const opf_tensor *d${m},
                    const ${n}_scalars *s, const opf_tensor *const *params, const opf_tensor *const *dparams) {
    const opf_dtype kt = dt == OPF_F64 ? OPF_F64 : OPF_F32;
    __attribute__((cleanup(prepared_release))) prepared p = {.numel = {0}};
    prepare(op, params, kt, &p);
    const ${n}_args a = args_of(s, &p);
    const ${n}_args64 a64 = args64_of(s, &p);
    int64_t off[NPARAMS + 1] = {0}, acc_n = 0;
    for (int k = 0; k < NPARAMS; k++)
        if (PARAM_GRAD[k] && p.numel[k]) off[k] = acc_n, acc_n += p.numel[k];
    const int64_t n = ${m}->sizes[${m}->ndim - 1], rows = n ? ${m}->numel / n : g->numel;
    int64_t tasks = task_count(rows, n);
    while (tasks > 1 && tasks * acc_n > ACC_MAX) tasks /= 2; /* a function of the sizes alone, as task_count */
    float *acc = NULL, *buf = NULL;
    OPF_OWNED AtenTensorHandle acc_h = opf_workspace(op, tasks * acc_n * (kt == OPF_F64 ? 2 : 1), ${m}, &acc);
    memset(acc, 0, (size_t)(tasks * acc_n) * (kt == OPF_F64 ? sizeof(double) : sizeof(float)));
    OPF_OWNED AtenTensorHandle buf_h = NULL;
    const ${n}_kernels *k = kernels();
    const int strided = col_stride(${m}) != 1 || col_stride(d${m}) != 1 || (!REDUCE && col_stride(g) != 1);
    if (dt == OPF_BF16 || dt == OPF_F16 || (dt == OPF_F32 && strided && k != &${n}_kernels_ref))
        buf_h = opf_workspace(op, tasks * 3 * (n + 1), ${m}, &buf);
    bwd_job j = {k, g, ${m}, d${m}, dt, rows, n, tasks, buf, acc, acc_n, off, &p, &a, &a64};
    opf_parallel_for(0, tasks, 1, bwd_tasks, &j);
    for (int k = 0; k < NPARAMS; k++) {
        if (!dparams[k] || !dparams[k]->numel) continue;
        const opf_dtype out_dt = opf_check_dtype(op, PARAM_NAMES[k], dparams[k], OPF_DTYPES_FLOAT);
        sum_job sj = {acc, acc_n, tasks, off[k], kt, dparams[k], out_dt};
        opf_parallel_for(0, dparams[k]->numel, 4096, sum_tasks, &sj);
    }
}

/* ${bwd_schema} */
static void ${n}_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    static const char OP[] = "${n}::${n}_backward";
    OPF_ARG_TENSOR(grad, stack, 0);
${take}    const double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
    const opf_tensor g = opf_tensor_info(OP, "grad", grad_h);
${infos}    const opf_dtype dt = check_inputs(OP, ${check_args});
    opf_check_device(OP, "grad", &g, "${m}", &${m});
    opf_check_same_dtype(OP, "grad", &g, "${m}", &${m});
${grad_check}    OPF_OWNED AtenTensorHandle d${m}_h = opf_empty_like(OP, &${m});
    const opf_tensor d${m} = opf_tensor_info(OP, "d${m}", d${m}_h);
${grad_allocs}    if (!opf_is_meta(&g)) {
        ${n}_scalars s = {${scalar_init}};
${copy_lists_bwd}        run_bwd(OP, dt, &g, &${m}, &d${m}, &s, (const opf_tensor *const[]){${params_arr}},
                (const opf_tensor *const[]){${dparams_arr}, NULL});
        opf_tensor logged[${nlog}];
        int nl = 0;
        logged[nl++] = g;
${logged}${logged_grads}        opf_log_call(OP, t0, nl, logged);
    }
${grad_returns}}
"""


# ---- the files ----------------------------------------------------------------------------------------------


def _c_file(sig: SchemaSig) -> str:
    n = sig.name
    return f"""/*
 * {sig.schema()}
 *
 * This file: the scalar reference kernels (the oracle: keep them), the variant table, the glue that
 * unboxes the arguments, checks them, allocates the output and runs the kernels over {sig.main}'s rows
 * on every thread, and the descriptors. The kernels compute in float32 (float64 inputs: in double);
 * bfloat16 and float16 rows are converted to float32 by row, in per-task buffers, and rounded back
 * once. {n}_avx2.c and {n}_avx512.c hold the vectorised variants. Load with
 *     opforge.load("{n}", ["{n}.c", "{n}_avx2.c", "{n}_avx512.c"])
 */
#include <math.h>
#include <string.h>

#include <opforge/op.h>

#include "{n}.h"

{_ref_kernels(sig)}
{_glue(sig)}"""


def _py_value(a: Arg):
    """The value the generated tests and benchmark pass for a scalar."""
    if a.kind == "enum":
        return a.default if a.has_default else a.values[-1]
    if a.has_default and a.default is not None:
        return a.default
    return {"float": 0.75, "float?": 0.75, "int": 3, "int?": 3, "int[]": [1, 2], "bool": False}[a.kind]


def _reference(sig: SchemaSig) -> str:
    m = sig.main
    params = ", ".join(a.decl(True).split(" ", 1)[1] for a in sig.args)  # "bias=None", "activation='none'"
    s = _scale_expr(sig, 1)
    body = f"    y = {s} * {m}{'.sum(-1)' if sig.reduce else ''}\n"
    if sig.params:
        body += f"    rows = torch.arange({m}.shape[:-1].numel(), device={m}.device)\n"
        for p in sig.params:
            cond = f"{p.name} is not None and {p.name}.numel()" if p.kind == "tensor?" else f"{p.name}.numel()"
            shift = f"{p.name}.flatten()[rows % {p.name}.numel()].reshape({m}.shape[:-1])"
            body += f"    if {cond}:\n        y = y + {shift}{'' if sig.reduce else '.unsqueeze(-1)'}\n"
    return f'''"""The PyTorch reference of {sig.name}: what the C kernels must compute.

As generated, the placeholder: y = s * {m}{'.sum(-1)' if sig.reduce else ''} + c(row), s the product of the
numeric scalars, -1 per true bool and (1 + index) per enum; c(row) the sum over the given parameters
of p.flatten()[row % p.numel()] (row: the index of {m}'s row, {m}.shape[:-1] flattened)."""

import torch


def {sig.name}({params}):
{body}    return y.to({m}.dtype)
'''


def _cases(sig: SchemaSig) -> list[dict[str, tuple[int, ...]]]:
    """The shapes the generated tests use: a first case, a small one (gradcheck), a larger one (the ISA
    and thread tests: several tasks), an empty one and rows of one."""
    m = sig.main
    syms: list[str] = []
    for t in sig.tensors:
        for s in sig.dims.get(t, []):
            if s not in syms:
                syms.append(s)
    main_dims = sig.dims.get(m)

    def case(first: int, last: int, other: int, free_main: tuple[int, ...], free_param: tuple[int, ...]):
        values = {}
        for k, s in enumerate(syms):
            values[s] = other + k % 3
        if main_dims:
            if len(main_dims) > 1:
                values[main_dims[0]] = first
            values[main_dims[-1]] = last
        out = {}
        for t in sig.tensors:
            if t in sig.dims:
                out[t] = tuple(values[s] for s in sig.dims[t])
            else:
                out[t] = free_main if t == m else free_param
        return out

    return [case(2, 17, 3, (6, 17), (5,)), case(2, 5, 2, (2, 5), (3,)), case(64, 1000, 3, (64, 3, 1000), (7,)),
            case(0, 17, 3, (0, 17), (5,)), case(3, 1, 2, (9, 1), (4,))]


def _spec(sig: SchemaSig) -> str:
    shared, seen = [], {}
    for t in sig.tensors:
        for j, s in enumerate(sig.dims.get(t, [])):
            if s in seen:
                shared.append((t, j, *seen[s]))
            else:
                seen[s] = (t, j)
    cases = ",\n         ".join(repr(c) for c in _cases(sig))
    return f"""ARGS = {[a.name for a in sig.args]!r}  # in the schema's order
MAIN = {sig.main!r}  # the tensor whose rows the kernels run over
OPTIONAL = {{{', '.join(repr(p.name) for p in sig.params if p.kind == 'tensor?')}}}  # Tensor? arguments: None is tried too
GRADS = {sig.grads!r}  # the tensors that get gradients
SCALARS = {{{', '.join(f'{a.name!r}: {_py_value(a)!r}' for a in sig.scalars)}}}  # the values passed unless a test sweeps them
ENUMS = {{{', '.join(f'{a.name!r}: {list(a.values)!r}' for a in sig.scalars if a.kind == 'enum')}}}
BOOLS = {[a.name for a in sig.scalars if a.kind == 'bool']!r}
REDUCE = {sig.reduce!r}  # True: a row in, one value out
DIMS = {sig.dims!r}  # opforge new --dims: checked by the glue
SHARED = {shared!r}  # (tensor, dim, other, its dim): one size
CASES = [{cases}]
"""


def files(sig: SchemaSig) -> dict[str, str]:
    """The project's files: name -> text."""
    n = sig.name
    out = {f"{n}.c": _c_file(sig), f"{n}.h": _header(sig), f"{n}_avx2.c": _variant_file(sig, "avx2"),
           f"{n}_avx512.c": _variant_file(sig, "avx512"), "reference.py": _reference(sig)}
    first = _cases(sig)[0]
    shape_args = " ".join(f"--shape {t}={','.join(map(str, s))}" for t, s in first.items())
    shape_args += "".join(f" --arg {a.name}={_py_value(a)}" for a in sig.scalars if a.kind not in ("enum", "bool", "int[]"))
    for template, target in (("ops.py", "ops.py"), ("test_op.py", f"test_{n}.py"), ("bench_op.py", f"bench_{n}.py"),
                             ("README.md", "README.md")):
        with open(os.path.join(_templates(), "schema", template)) as f:
            text = f.read()
        out[target] = (text.replace("{name}", n).replace("{SPEC}", _spec(sig)).replace("{SCHEMA}", sig.schema())
                       .replace("{MAIN}", sig.main).replace("{SHAPE_ARGS}", shape_args))
    return out


def new(sig: SchemaSig, directory: str | None = None) -> str:
    """Writes the project into DIR/NAME (never over a non-empty folder); returns its path."""
    refuse_used_name(sig, files)
    return write_project(sig.name, files(sig), directory)
