"""`opforge new`: writes an op project of the signature asked for.

    opforge new squared_relu                                  # squared_relu(Tensor x) -> Tensor
    opforge new scaled_sum --inputs a,b --scalars alpha:float  # (Tensor a, Tensor b, float alpha)
    opforge new rowwise_dot --inputs a,b --reduce last        # -> a.shape[:-1], shape rule [a[:-1]]

The project is a working op before anything is edited: its kernels compute a
real placeholder (elementwise: scale * sum of the inputs' squares; with
``--reduce last``, the same summed over the last dim; scale is the product of
the numeric scalars, 1 without any), which its reference, tests and benchmark
agree with. The kernel bodies sit between ``>>> kernels`` and ``<<< kernels``
in ``NAME.c`` (scalar reference) and ``NAME_avx2.c`` (the AVX2 variant);
``reference.py`` holds the PyTorch reference. The C around them (argument
checks, output allocation, bfloat16/float16 through float32 copies, strided
iteration, the descriptors) follows the signature and needs no edit.

``--cuda`` adds ``NAME.cu``: the same placeholder as CUDA kernels (between the
same markers; a thread per element, or a block per row with ``--reduce``) and
their launchers, and the CUDA glue in ``NAME.c`` (built when ``opforge.load``
is given the .cu file, which defines ``OPF_WITH_CUDA``): the op then runs on
tensors on a GPU too, with the same schema, autograd and fake kernel.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import keyword
import os
import re
from string import Template

SCALAR_TYPES = {"float": ("float", "float", "(float)opf_arg_double"), "int": ("int", "int64_t", "opf_arg_int"),
                "bool": ("bool", "int", "opf_arg_bool")}
# names the generated C uses itself (or C keywords that are not Python ones)
RESERVED = {"y", "dy", "grad", "n", "i", "r", "s", "s2", "g", "sum", "acc", "k", "j", "op", "stack", "nin", "nout",
            "job", "ctx", "off", "st", "rows", "cols", "dt", "nd", "out", "auto", "char", "const", "double", "enum",
            "extern", "float", "goto", "int", "long", "register", "short", "signed", "sizeof", "static", "struct",
            "switch", "typedef", "union", "unsigned", "void", "volatile", "restrict", "inline", "case", "default",
            "do", "main"}
MAX_INPUTS = 3  # the elementwise backward walks 2 * inputs + 1 operands together (OPF_MAX_OPERANDS = 8)

BEGIN, END = "/* >>> kernels", "/* <<< kernels */"

# The C both scaffolds (this one and scaffold_schema) write to convert a tensor element by element.
CONVERT_C = r"""typedef struct convert_job {
    void *dst;
    const void *src;
    opf_dtype dst_dt, src_dt;
} convert_job;

static void convert_run(void *ctx, const int64_t *off, const int64_t *st, int64_t len) {
    const convert_job *c = ctx;
    for (int64_t i = 0; i < len; i++)
        opf_store_elem(c->dst, off[0] + i * st[0], c->dst_dt, opf_load_elem(c->src, off[1] + i * st[1], c->src_dt));
}

/* dst = src, element by element, any strides and dtypes. */
static void convert(const opf_tensor *dst, opf_dtype dst_dt, const opf_tensor *src, opf_dtype src_dt) {
    opf_nd nd;
    opf_nd_init(&nd, (int)src->ndim, src->sizes, 2, (const int64_t *[]){dst->strides, src->strides});
    opf_nd_parallel(&nd, 32768, convert_run, &(convert_job){dst->data, src->data, dst_dt, src_dt});
}
"""


class Signature:
    """The op's inputs (tensor names), scalars ((name, type)) and kind."""

    cuda: bool = False  # NAME.cu and the CUDA glue too (opforge new --cuda)

    def __init__(self, name: str, inputs: list[str], scalars: list[tuple[str, str]], reduce: bool):
        self.name, self.inputs, self.scalars, self.reduce = name, inputs, scalars, reduce
        self._check()

    @classmethod
    def parse(cls, name: str, inputs: str | None, scalars: str | None, reduce: str | None) -> "Signature":
        ins = [s.strip() for s in (inputs or "x").split(",") if s.strip()]
        sc = []
        for spec in [s.strip() for s in (scalars or "").split(",") if s.strip()]:
            sname, _, ty = spec.partition(":")
            sc.append((sname.strip(), (ty or "float").strip()))
        if reduce not in (None, "last"):
            raise SystemExit(f"opforge new: --reduce takes 'last' (the output drops the last dim), got {reduce!r}")
        return cls(name, ins, sc, reduce == "last")

    def _check(self) -> None:
        def bad(msg):
            raise SystemExit(f"opforge new: {msg}")

        if not self.name.isidentifier() or self.name.startswith("_") or keyword.iskeyword(self.name):
            bad(f"NAME must be a C and Python identifier, got {self.name!r}")
        if not self.inputs:
            bad("--inputs needs at least one tensor name")
        if len(self.inputs) > MAX_INPUTS:
            bad(f"--inputs takes at most {MAX_INPUTS} tensors, got {len(self.inputs)}")
        names = self.inputs + [s for s, _ in self.scalars]
        for n in names:
            if n in RESERVED:
                bad(f"{n!r} cannot name an argument: the generated C uses it (reserved: {', '.join(sorted(RESERVED))})")
            if not n.isidentifier() or keyword.iskeyword(n) or n.startswith("_") or n == self.name:
                bad(f"{n!r} cannot name an argument (not an identifier, or the op's own name)")
        if len(set(names)) != len(names):
            bad(f"argument names must differ, got {', '.join(names)}")
        for n in self.inputs:
            if "d" + n in names or n.endswith("_s") or n.endswith("32"):
                bad(f"{n!r} clashes with the names the generated C derives (d{n}, {n}_s, {n}32)")
        for sname, ty in self.scalars:
            if ty not in SCALAR_TYPES:
                bad(f"scalar {sname}: type must be one of {', '.join(SCALAR_TYPES)}, got {ty!r}")

    # ---- pieces of text -------------------------------------------------------------

    def schema_args(self) -> str:
        return ", ".join([f"Tensor {x}" for x in self.inputs] + [f"{SCALAR_TYPES[t][0]} {s}" for s, t in self.scalars])

    def c_scalar_params(self) -> str:
        return "".join(f", {SCALAR_TYPES[t][1]} {s}" for s, t in self.scalars)

    def c_scalar_args(self, prefix: str = "") -> str:
        return "".join(f", {prefix}{s}" for s, _ in self.scalars)

    def scale(self) -> str | None:
        """The placeholder's factor: the product of the numeric scalars, None without any."""
        parts = [s if t == "float" else f"(float){s}" for s, t in self.scalars if t != "bool"]
        return " * ".join(parts) if parts else None

    def grads_out(self) -> str:
        return "Tensor" if len(self.inputs) == 1 else "(" + ", ".join(["Tensor"] * len(self.inputs)) + ")"


def _ptrs(names, const=True):
    return ", ".join(f"{'const ' if const else ''}float *{x}" for x in names)


def _strides(names):
    return ", ".join(f"int64_t {x}_s" for x in names)


def _kernels(sig: Signature) -> dict[str, str]:
    """The C of the kernels: the contract (header) and the placeholder bodies."""
    ins, d = sig.inputs, ["d" + x for x in sig.inputs]
    sp, sa = sig.c_scalar_params(), sig.c_scalar_args()
    scale = sig.scale()
    squares = " + ".join(f"{x}_i * {x}_i" for x in ins)
    if not sig.reduce:
        fwd_params = f"float *y, {_ptrs(ins)}, int64_t n, int64_t y_s, {_strides(ins)}{sp}"
        bwd_params = f"{_ptrs(d, False)}, const float *dy, {_ptrs(ins)}, int64_t n, {_strides(d)}, int64_t dy_s, " \
                     f"{_strides(ins)}{sp}"
        contract = (f"    /* y[i * y_s] for i < n from {', '.join(f'{x}[i * {x}_s]' for x in ins)} */\n"
                    f"    void (*fwd)({fwd_params});\n"
                    f"    /* the gradients {', '.join(d)} from dy and the inputs */\n"
                    f"    void (*bwd)({bwd_params});\n")
        formula = f"{scale} * ({squares})" if scale else squares
        grads = ", ".join(f"d{x} = 2 {'* ' + scale + ' ' if scale else ''}* {x} * dy" for x in ins)
        loads = ", ".join(f"{x}_i = {x}[i * {x}_s]" for x in ins)
        ref = f"""{BEGIN}: the computation. Edit these two, the two in {sig.name}_avx2.c and reference.py. */

/* placeholder: y = {formula.replace('_i', '')} */
static void fwd_ref({fwd_params}) {{
{'    const float s = ' + scale + ';' + chr(10) if scale else ''}    for (int64_t i = 0; i < n; i++) {{
        const float {loads};
        y[i * y_s] = {'s * (' + squares + ')' if scale else squares};
    }}
}}

/* placeholder: {grads} */
static void bwd_ref({bwd_params}) {{
    const float s2 = 2.0f{' * (' + scale + ')' if scale else ''};
    for (int64_t i = 0; i < n; i++) {{
        const float g = dy[i * dy_s];
{''.join(f'        d{x}[i * d{x}_s] = s2 * {x}[i * {x}_s] * g;' + chr(10) for x in ins)}    }}
}}
{END}
"""
        unit = " && ".join(f"{x}_s == 1" for x in ["y"] + ins)
        vsq = [f"_mm256_mul_ps({x}_i, {x}_i)" for x in ins]
        vsum = vsq[0]
        for v in vsq[1:]:
            vsum = f"_mm256_add_ps({vsum}, {v})"
        vy = f"_mm256_mul_ps(s, {vsum})" if scale else vsum
        vloads = ", ".join(f"{x}_i = _mm256_loadu_ps({x} + i)" for x in ins)
        dunit = " && ".join(f"{x}_s == 1" for x in d + ["dy"] + ins)
        avx2 = f"""{BEGIN}: the computation, 8 floats at a time; other strides and the tail run the reference. */

static void fwd_avx2({fwd_params}) {{
    int64_t i = 0;
    if ({unit}) {{
{'        const __m256 s = _mm256_set1_ps(' + scale + ');' + chr(10) if scale else ''}        for (; i + 8 <= n; i += 8) {{
            const __m256 {vloads};
            _mm256_storeu_ps(y + i, {vy});
        }}
    }}
    {sig.name}_kernels_ref.fwd(y + i * y_s, {', '.join(f'{x} + i * {x}_s' for x in ins)}, n - i, y_s, \
{', '.join(f'{x}_s' for x in ins)}{sa});
}}

static void bwd_avx2({bwd_params}) {{
    int64_t i = 0;
    if ({dunit}) {{
        const __m256 s2 = _mm256_set1_ps(2.0f{' * (' + scale + ')' if scale else ''});
        for (; i + 8 <= n; i += 8) {{
            const __m256 g = _mm256_loadu_ps(dy + i);
{''.join(f'            _mm256_storeu_ps(d{x} + i, _mm256_mul_ps(_mm256_mul_ps(s2, _mm256_loadu_ps({x} + i)), g));' + chr(10) for x in ins)}        }}
    }}
    {sig.name}_kernels_ref.bwd({', '.join(f'd{x} + i * d{x}_s' for x in ins)}, dy + i * dy_s, \
{', '.join(f'{x} + i * {x}_s' for x in ins)}, n - i, {', '.join(f'd{x}_s' for x in ins)}, dy_s, \
{', '.join(f'{x}_s' for x in ins)}{sa});
}}
{END}
"""
    else:
        fwd_params = f"{_ptrs(ins)}, int64_t n, {_strides(ins)}{sp}"
        bwd_params = f"{_ptrs(d, False)}, float dy, {_ptrs(ins)}, int64_t n, {_strides(d)}, {_strides(ins)}{sp}"
        contract = (f"    /* one row: returns y for the n elements {', '.join(f'{x}[i * {x}_s]' for x in ins)} */\n"
                    f"    float (*fwd)({fwd_params});\n"
                    f"    /* one row: the gradients {', '.join(f'{g}[i * {g}_s]' for g in d)} from the row's dy */\n"
                    f"    void (*bwd)({bwd_params});\n")
        loads = ", ".join(f"{x}_i = {x}[i * {x}_s]" for x in ins)
        formula = f"{scale} * sum over the row of ({squares.replace('_i', '')})" if scale else \
            f"sum over the row of ({squares.replace('_i', '')})"
        ref = f"""{BEGIN}: the computation. Edit these two, the two in {sig.name}_avx2.c and reference.py. */

/* placeholder: y = {formula}, summed in float32 */
static float fwd_ref({fwd_params}) {{
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {{
        const float {loads};
        sum += {squares};
    }}
    return {'(' + scale + ') * sum' if scale else 'sum'};
}}

/* placeholder: {', '.join(f'd{x} = 2 {"* " + scale + " " if scale else ""}* dy * {x}' for x in ins)} */
static void bwd_ref({bwd_params}) {{
    const float g = 2.0f{' * (' + scale + ')' if scale else ''} * dy;
    for (int64_t i = 0; i < n; i++) {{
{''.join(f'        d{x}[i * d{x}_s] = g * {x}[i * {x}_s];' + chr(10) for x in ins)}    }}
}}
{END}
"""
        unit = " && ".join(f"{x}_s == 1" for x in ins)
        vsq = [f"_mm256_mul_ps({x}_i, {x}_i)" for x in ins]
        vsum = vsq[0]
        for v in vsq[1:]:
            vsum = f"_mm256_add_ps({vsum}, {v})"
        vloads = ", ".join(f"{x}_i = _mm256_loadu_ps({x} + i)" for x in ins)
        sloads = ", ".join(f"{x}_i = {x}[i]" for x in ins)
        dunit = " && ".join(f"{x}_s == 1" for x in d + ins)
        avx2 = f"""{BEGIN}: the computation, 8 floats at a time (8 partial sums, added at the end); other
 * strides run the reference, whose single running sum rounds differently. */

static float fwd_avx2({fwd_params}) {{
    if (!({unit})) return {sig.name}_kernels_ref.fwd({', '.join(ins)}, n, {', '.join(f'{x}_s' for x in ins)}{sa});
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {{
        const __m256 {vloads};
        acc = _mm256_add_ps(acc, {vsum});
    }}
    float sum = hsum8(acc);
    for (; i < n; i++) {{
        const float {sloads};
        sum += {squares};
    }}
    return {'(' + scale + ') * sum' if scale else 'sum'};
}}

static void bwd_avx2({bwd_params}) {{
    const float g = 2.0f{' * (' + scale + ')' if scale else ''} * dy;
    int64_t i = 0;
    if ({dunit}) {{
        const __m256 gv = _mm256_set1_ps(g);
        for (; i + 8 <= n; i += 8) {{
{''.join(f'            _mm256_storeu_ps(d{x} + i, _mm256_mul_ps(gv, _mm256_loadu_ps({x} + i)));' + chr(10) for x in ins)}        }}
    }}
    for (; i < n; i++) {{
{''.join(f'        d{x}[i * d{x}_s] = g * {x}[i * {x}_s];' + chr(10) for x in ins)}    }}
}}
{END}
"""
    return {"contract": contract, "ref": ref, "avx2": avx2}


# ---- the glue: checks, allocation, float32 copies of halves, iteration, descriptors ----------------------


def _unboxing(sig: Signature) -> dict[str, str]:
    """The C both glues of the op (CPU and CUDA) share: taking the stack's tensors and scalars, reading
    the inputs, the shape checks of grad, the outputs' allocation and return."""
    ins, N, first = sig.inputs, len(sig.inputs), sig.inputs[0]
    out = {
        "take": "".join(f"    OPF_ARG_TENSOR({x}, stack, {k});\n" for k, x in enumerate(ins)),
        "take_bwd": "    OPF_ARG_TENSOR(grad, stack, 0);\n" + "".join(
            f"    OPF_ARG_TENSOR({x}, stack, {k + 1});\n" for k, x in enumerate(ins)),
        "unpack_scalars": "".join(f"    const {SCALAR_TYPES[t][1]} {s} = {SCALAR_TYPES[t][2]}(stack[{N + k}]);\n"
                                  for k, (s, t) in enumerate(sig.scalars)),
        "unpack_scalars_bwd": "".join(
            f"    const {SCALAR_TYPES[t][1]} {s} = {SCALAR_TYPES[t][2]}(stack[{N + 1 + k}]);\n"
            for k, (s, t) in enumerate(sig.scalars)),
        "info": "".join(f"    const opf_tensor {x} = opf_tensor_info(OP, \"{x}\", {x}_h);\n" for x in ins),
        "check_params": ", ".join(f"const opf_tensor *{x}" for x in ins),
        "check_args": ", ".join(f"&{x}" for x in ins),
        "grad_allocs": "".join(f"    OPF_OWNED AtenTensorHandle d{x}_h = opf_empty_like(OP, &{x});\n"
                               f"    const opf_tensor d{x} = opf_tensor_info(OP, \"d{x}\", d{x}_h);\n" for x in ins),
        "grad_returns": "".join(f"    OPF_RETURN(stack, {k}, d{x}_h);\n" for k, x in enumerate(ins)),
    }
    if not sig.reduce:
        out["out_alloc"] = f"    OPF_OWNED AtenTensorHandle y_h = opf_empty_like(OP, &{first});\n"
        out["grad_check"] = f"    opf_check_same_shape(OP, \"grad\", &g, \"{first}\", &{first});\n"
    else:
        out["out_alloc"] = (f"    /* y: {first}'s sizes without the last (the shape rule [{first}[:-1]]); a 0-d {first} is "
                            "one row of one */\n"
                            f"    const int lead = {first}.ndim ? (int){first}.ndim - 1 : 0;\n"
                            f"    OPF_OWNED AtenTensorHandle y_h = opf_empty(OP, lead, {first}.sizes, {first}.dtype, "
                            f"&{first});\n")
        out["grad_check"] = f"""    const int lead = {first}.ndim ? (int){first}.ndim - 1 : 0;
    if (g.ndim != lead || (lead && memcmp(g.sizes, {first}.sizes, sizeof(int64_t) * (size_t)lead))) {{
        char want[256], got[256];
        opf_shape_str(want, sizeof want, &{first});
        opf_shape_str(got, sizeof got, &g);
        opf_fail(OP, "argument 'grad' must have the shape of '{first}' %s without its last dim, got %s", want, got);
    }}
"""
    return out


def _glue(sig: Signature) -> str:
    name, ins, N = sig.name, sig.inputs, len(sig.inputs)
    first = ins[0]
    sa_job = sig.c_scalar_args("j->")
    scalar_fields = "".join(f"    {SCALAR_TYPES[t][1]} {s};\n" for s, t in sig.scalars)
    scalar_init = "".join(f", {s}" for s, _ in sig.scalars)
    u = _unboxing(sig)
    checks = "".join(
        f"    check_device(op, \"{x}\", {x}, \"{first}\", {first});\n"
        f"    opf_check_same_dtype(op, \"{x}\", {x}, \"{first}\", {first});\n"
        f"    opf_check_same_shape(op, \"{x}\", {x}, \"{first}\", {first});\n" for x in ins[1:])
    copies = "".join(f"    OPF_OWNED AtenTensorHandle {x}32_h = NULL;\n"
                     f"    const opf_tensor {x}32 = float32_in(OP, &{x}, dt, &{x}32_h);\n" for x in ins)
    grad_f32 = "".join(f"    OPF_OWNED AtenTensorHandle d{x}32_h = NULL;\n"
                       f"    const opf_tensor d{x}32 = float32_out(OP, &d{x}, dt, &d{x}32_h);\n" for x in ins)
    grad_back = "".join(f"    float32_into(&d{x}, &d{x}32, dt);\n" for x in ins)
    grad_returns_meta = "    ".join(f"    OPF_RETURN(stack, {k}, d{x}_h);\n" for k, x in enumerate(ins))
    in_list = ", ".join(ins)
    tensors_fwd = ", ".join(ins + ["y"])
    tensors_bwd = ", ".join(["g"] + ins + ["d" + x for x in ins])
    job_in = ", ".join(f"{x}32.data" for x in ins)
    job_out_bwd = ", ".join(f"d{x}32.data" for x in ins)

    if not sig.reduce:
        fwd_strides = ", ".join(["y32.strides"] + [f"{x}32.strides" for x in ins])
        bwd_strides = ", ".join([f"d{x}32.strides" for x in ins] + ["g32.strides"] + [f"{x}32.strides" for x in ins])
        iterate_fwd = f"""    opf_nd nd;
    opf_nd_init(&nd, (int){first}.ndim, {first}.sizes, {N + 1}, (const int64_t *[]){{{fwd_strides}}});
    opf_nd_log(OP, &nd, GRAIN);
    opf_nd_parallel(&nd, GRAIN, fwd_run, &(job){{kernels(), {{y32.data}}, {{{job_in}}}{scalar_init}}});
"""
        iterate_bwd = f"""    opf_nd nd;
    opf_nd_init(&nd, (int){first}.ndim, {first}.sizes, {2 * N + 1}, (const int64_t *[]){{{bwd_strides}}});
    opf_nd_log(OP, &nd, GRAIN);
    opf_nd_parallel(&nd, GRAIN, bwd_run, &(job){{kernels(), {{{job_out_bwd}}}, {{g32.data, {job_in}}}{scalar_init}}});
"""
        pad = ",\n" + " " * 14
        fwd_call = (f"    j->k->fwd(j->out[0] + off[0], {', '.join(f'j->in[{k}] + off[{k + 1}]' for k in range(N))}, n"
                    f"{pad}{', '.join(f'st[{k}]' for k in range(N + 1))}{sa_job});\n")
        bwd_call = (f"    j->k->bwd({', '.join(f'j->out[{k}] + off[{k}]' for k in range(N))}, j->in[0] + off[{N}]{pad}"
                    f"{', '.join(f'j->in[{k + 1}] + off[{N + 1 + k}]' for k in range(N))}, n{pad}"
                    f"{', '.join(f'st[{k}]' for k in range(2 * N + 1))}{sa_job});\n")
        runs = f"""/* The runtime walks the tensors in runs of n elements along one dim (opf_nd): operand k
 * starts at element off[k] and steps by st[k]; operand 0 is the output. */
static void fwd_run(void *ctx, const int64_t *off, const int64_t *st, int64_t n) {{
    const job *j = ctx;
{fwd_call}}}

static void bwd_run(void *ctx, const int64_t *off, const int64_t *st, int64_t n) {{
    const job *j = ctx;
{bwd_call}}}
"""
        shape_fwd, shape_bwd = f"like:{first}", ";".join(f"like:{x}" for x in ins)
        layout = "Elementwise, any shape (all inputs the same, no broadcasting) and strides"
        grain = "#define GRAIN 32768 /* elements per parallel chunk at least: thread hand-offs cost microseconds */\n"
        cols = ""
    else:
        fwd_strides = ", ".join(["y32.strides"] + [f"{x}32.strides" for x in ins])
        bwd_strides = ", ".join([f"d{x}32.strides" for x in ins] + ["g32.strides"] + [f"{x}32.strides" for x in ins])
        col = f"const int64_t cols = {first}.ndim ? {first}.sizes[lead] : 1;\n"
        iterate_fwd = f"""    {col}    const int64_t grain = (ROW_GRAIN + cols) / (cols + 1); /* rows per parallel chunk at least */
    opf_nd nd; /* over the leading dims: runs of rows */
    opf_nd_init(&nd, lead, {first}.sizes, {N + 1}, (const int64_t *[]){{{fwd_strides}}});
    opf_nd_log(OP, &nd, grain);
    opf_nd_parallel(&nd, grain, fwd_rows,
                    &(job){{kernels(), {{y32.data}}, {{{job_in}}}, {{0, {', '.join(f'col_stride(&{x}32)' for x in ins)}}}, cols{scalar_init}}});
"""
        iterate_bwd = f"""    {col}    const int64_t grain = (ROW_GRAIN + cols) / (cols + 1);
    opf_nd nd;
    opf_nd_init(&nd, lead, {first}.sizes, {2 * N + 1}, (const int64_t *[]){{{bwd_strides}}});
    opf_nd_log(OP, &nd, grain);
    opf_nd_parallel(&nd, grain, bwd_rows,
                    &(job){{kernels(), {{{job_out_bwd}}}, {{g32.data, {job_in}}},
                           {{{', '.join(f'col_stride(&d{x}32)' for x in ins)}, 0, {', '.join(f'col_stride(&{x}32)' for x in ins)}}}, cols{scalar_init}}});
"""
        pad = ",\n" + " " * 18
        fwd_call = (f"        j->out[0][off[0] + r * st[0]] =\n            j->k->fwd("
                    f"{', '.join(f'j->in[{k}] + off[{k + 1}] + r * st[{k + 1}]' for k in range(N))}{pad}j->cols, "
                    f"{', '.join(f'j->cs[{k + 1}]' for k in range(N))}{sa_job});\n")
        bwd_call = (f"        j->k->bwd({', '.join(f'j->out[{k}] + off[{k}] + r * st[{k}]' for k in range(N))}{pad}"
                    f"j->in[0][off[{N}] + r * st[{N}]]{pad}"
                    f"{', '.join(f'j->in[{k + 1}] + off[{N + 1 + k}] + r * st[{N + 1 + k}]' for k in range(N))}{pad}"
                    f"j->cols, {', '.join(f'j->cs[{k}]' for k in range(N))}, "
                    f"{', '.join(f'j->cs[{N + 1 + k}]' for k in range(N))}{sa_job});\n")
        runs = f"""/* The runtime walks the leading dims in runs of rows (opf_nd): operand k's row r starts at
 * element off[k] + r * st[k]; along a row, operand k steps by cs[k]. Operand 0 is the output.
 * Each row is reduced whole, by one thread: results do not depend on the thread count. */
static void fwd_rows(void *ctx, const int64_t *off, const int64_t *st, int64_t rows) {{
    const job *j = ctx;
    for (int64_t r = 0; r < rows; r++)
{fwd_call}}}

static void bwd_rows(void *ctx, const int64_t *off, const int64_t *st, int64_t rows) {{
    const job *j = ctx;
    for (int64_t r = 0; r < rows; r++)
{bwd_call}}}

/* The step along the last dim (a 0-d tensor: one element). */
static int64_t col_stride(const opf_tensor *t) {{ return t->ndim ? t->strides[t->ndim - 1] : 1; }}
"""
        shape_fwd, shape_bwd = f"[{first}[:-1]]", ";".join(f"like:{x}" for x in ins)
        layout = f"Reduces the last dim: y has {first}'s shape without it (all inputs the same shape); any strides"
        grain = "#define ROW_GRAIN 32768 /* elements per parallel chunk at least: thread hand-offs cost microseconds */\n"
        cols = "    int64_t cs[OPF_MAX_OPERANDS]; /* each operand's step along a row */\n    int64_t cols;\n"

    bwd_args = ",".join(["grad0"] + ins + [s for s, _ in sig.scalars])
    schema = f"{name}({sig.schema_args()}) -> Tensor"
    bwd_schema = f"{name}_backward(Tensor grad, {sig.schema_args()}) -> {sig.grads_out()}"
    flops = f"{2 * N + 1}*numel({first})"
    return Template(_GLUE).substitute(
        name=name, layout=layout, grain=grain, cols=cols, scalar_fields=scalar_fields, runs=runs,
        first=first, checks=checks, copies=copies, iterate_fwd=iterate_fwd, iterate_bwd=iterate_bwd,
        tensors_fwd=tensors_fwd, tensors_bwd=tensors_bwd, grad_f32=grad_f32, **u,
        grad_back=grad_back, grad_returns_meta=grad_returns_meta, schema=schema, bwd_schema=bwd_schema, shape_fwd=shape_fwd,
        shape_bwd=shape_bwd, bwd_args=bwd_args, grads=",".join(ins), flops=flops, in_list=in_list,
        bwd_flops=f"{3 * N + 1}*numel({first})", nin_fwd_tensors=N + 1, nin_bwd_tensors=2 * N + 1,
        NAME=name.upper(), cuda_glue=_cuda_glue(sig), convert=CONVERT_C,
    )


_GLUE = r"""/* ---- the variant table: the reference, and the AVX2 variant where the CPU has it -------- */

const ${name}_kernels ${name}_kernels_ref = {"ref", OPF_ISA_REF, fwd_ref, bwd_ref};

/* A build without ${name}_avx2.c leaves this weak reference NULL; opf_variant_pick skips it. */
extern const ${name}_kernels ${name}_kernels_avx2 __attribute__((weak));
static const opf_variants variants = OPF_VARIANTS("${name}", &${name}_kernels_ref, &${name}_kernels_avx2);
OPF_KERNEL_FAMILIES(&variants) /* `opforge info --load` lists them */

/* The variant for the ISA in force (OPFORGE_ISA, opforge.set_isa); the log line names it. */
static const ${name}_kernels *kernels(void) { return opf_variant_pick(&variants, opf_isa_current()); }

/* ---- bfloat16 / float16: the kernels read float32 copies and write float32, converted back --- */

#define ACCEPTED (OPF_DTYPE_BIT(OPF_F32) | OPF_DTYPE_BIT(OPF_BF16) | OPF_DTYPE_BIT(OPF_F16))
${grain}
${convert}
/* t itself when float32, else a float32 copy of it (owned by *h). */
static opf_tensor float32_in(const char *op, const opf_tensor *t, opf_dtype dt, AtenTensorHandle *h) {
    if (dt == OPF_F32) return *t;
    *h = opf_empty(op, t->ndim, t->sizes, aoti_torch_dtype_float32(), t);
    opf_tensor c = opf_tensor_info(op, "float32 copy", *h);
    convert(&c, OPF_F32, t, dt);
    return c;
}

/* Where the kernels write out: out itself when float32, else a float32 buffer (owned by *h)
 * that float32_into converts into out. */
static opf_tensor float32_out(const char *op, const opf_tensor *out, opf_dtype dt, AtenTensorHandle *h) {
    if (dt == OPF_F32) return *out;
    *h = opf_empty(op, out->ndim, out->sizes, aoti_torch_dtype_float32(), out);
    return opf_tensor_info(op, "float32 result", *h);
}

static void float32_into(const opf_tensor *out, const opf_tensor *buf, opf_dtype dt) {
    if (dt != OPF_F32) convert(out, dt, buf, OPF_F32);
}

/* ---- glue: check, allocate, call ------------------------------------------------------------ */

typedef struct job {
    const ${name}_kernels *k;
    float *out[OPF_MAX_OPERANDS];
    const float *in[OPF_MAX_OPERANDS];
${cols}${scalar_fields}} job;

${runs}
/* Every input on the device check_device accepts (the CPU glue's: cpu, or meta: the fake kernel runs
 * this glue on meta stand-ins; the CUDA glue's: the GPU of ${first}), float32, bfloat16 or float16, all
 * of one dtype and shape. */
static opf_dtype check_inputs(const char *op, __typeof__(opf_check_device) *check_device, ${check_params}) {
    check_device(op, "${first}", ${first}, "${first}", ${first});
    const opf_dtype dt = opf_check_dtype(op, "${first}", ${first}, ACCEPTED);
${checks}    return dt;
}

/* ${schema} */
static void ${name}_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    static const char OP[] = "${name}::${name}";
${take}    const double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
${unpack_scalars}${info}    const opf_dtype dt = check_inputs(OP, opf_check_device, ${check_args});

${out_alloc}    const opf_tensor y = opf_tensor_info(OP, "y", y_h);
    if (opf_is_meta(&y)) { /* checked and allocated: all a fake kernel needs */
        OPF_RETURN(stack, 0, y_h);
        return;
    }
${copies}    OPF_OWNED AtenTensorHandle y32_h = NULL;
    const opf_tensor y32 = float32_out(OP, &y, dt, &y32_h);
${iterate_fwd}    float32_into(&y, &y32, dt);
    opf_log_call(OP, t0, ${nin_fwd_tensors}, (opf_tensor[]){${tensors_fwd}});
    OPF_RETURN(stack, 0, y_h);
}

/* ${bwd_schema} */
static void ${name}_backward_cpu(StableIValue *stack, uint64_t nin, uint64_t nout) {
    static const char OP[] = "${name}::${name}_backward";
${take_bwd}    const double t0 = opf_log_enabled(OPF_LOG_INFO) ? opf_now_us() : 0;
${unpack_scalars_bwd}    const opf_tensor g = opf_tensor_info(OP, "grad", grad_h);
${info}    const opf_dtype dt = check_inputs(OP, opf_check_device, ${check_args});
    opf_check_device(OP, "grad", &g, "${first}", &${first});
    opf_check_same_dtype(OP, "grad", &g, "${first}", &${first});
${grad_check}
${grad_allocs}    if (opf_is_meta(&g)) {
    ${grad_returns_meta}        return;
    }
    OPF_OWNED AtenTensorHandle g32_h = NULL;
    const opf_tensor g32 = float32_in(OP, &g, dt, &g32_h);
${copies}${grad_f32}${iterate_bwd}${grad_back}    opf_log_call(OP, t0, ${nin_bwd_tensors}, (opf_tensor[]){${tensors_bwd}});
${grad_returns}}

${cuda_glue}
/* ---- descriptors: the Python layer wires the fake kernel, autograd and autocast from these -- */

OPF_OP_TABLE(
    {.schema = "${schema}",
     .cpu = ${name}_cpu,
     .cuda = ${NAME}_CUDA,               /* the CUDA kernel (NAME.cu, opforge new --cuda), NULL without */
     .shape = "${shape_fwd}",            /* the output's shape and dtype (csrc/include/opforge/op.h) */
     .backward = "${name}_backward",
     .backward_args = "${bwd_args}",     /* what the backward is called with: grad of output 0, inputs, scalars */
     .backward_grads = "${grads}",       /* its outputs are the gradients of these */
     .autocast = OPF_AUTOCAST_LOWER,     /* under autocast: runs in its dtype (bfloat16 / float16) */
     .flops = "${flops}",               /* for torch.utils.flop_counter */
     .meta = 1},                         /* the glue takes meta tensors: compile refuses what eager refuses */
    {.schema = "${bwd_schema}",
     .cpu = ${name}_backward_cpu,
     .cuda = ${NAME}_BACKWARD_CUDA,
     .shape = "${shape_bwd}",
     .flops = "${bwd_flops}",
     .meta = 1})
"""


# ---- CUDA (opforge new --cuda) -----------------------------------------------------------------------


def _cuda_glue(sig: Signature) -> str:
    """The CUDA glue in NAME.c: built only with NAME.cu (OPF_WITH_CUDA); else the descriptors' .cuda
    slots are NULL."""
    name, ins, N, first, up = sig.name, sig.inputs, len(sig.inputs), sig.inputs[0], sig.name.upper()
    off = f"#define {up}_CUDA NULL\n#define {up}_BACKWARD_CUDA NULL\n"
    if not sig.cuda:
        return f"""/* No CUDA kernels (opforge new --cuda writes them). */
{off.replace(chr(92) + 'n', chr(10))}"""
    u = _unboxing(sig)
    take, take_bwd, info, check_args = u["take"], u["take_bwd"], u["info"], u["check_args"]
    unpack, unpack_bwd = u["unpack_scalars"], u["unpack_scalars_bwd"]
    grad_allocs, grad_returns, out_alloc, grad_check = u["grad_allocs"], u["grad_returns"], u["out_alloc"], u["grad_check"]
    sa = sig.c_scalar_args()
    sp = sig.c_scalar_params()
    in_data = ", ".join(f"{x}.data" for x in ins)
    dx_data = ", ".join(f"d{x}.data" for x in ins)
    tensors_fwd = ", ".join(ins + ["y"])
    tensors_bwd = ", ".join(["g"] + ins + ["d" + x for x in ins])
    if not sig.reduce:
        walk_fwd = (f"    opf_cuda_nd nd; /* the elementwise walk: operand 0 the output */\n"
                    f"    opf_cuda_nd_init(OP, &nd, (int){first}.ndim, {first}.sizes, {N + 1},\n"
                    f"                     (const int64_t *[]){{y.strides, {', '.join(f'{x}.strides' for x in ins)}}});\n")
        walk_bwd = (f"    opf_cuda_nd nd;\n"
                    f"    opf_cuda_nd_init(OP, &nd, (int){first}.ndim, {first}.sizes, {2 * N + 1},\n"
                    f"                     (const int64_t *[]){{{', '.join(f'd{x}.strides' for x in ins)}, g.strides, "
                    f"{', '.join(f'{x}.strides' for x in ins)}}});\n")
        call_fwd = f"{name}_cuda_fwd(dt, y.data, (const void *const[]){{{in_data}}}, &nd{sa}, call.stream)"
        call_bwd = (f"{name}_cuda_bwd(dt, (void *const[]){{{dx_data}}}, g.data, (const void *const[]){{{in_data}}}, "
                    f"&nd{sa}, call.stream)")
        decl = (f"unsigned {name}_cuda_fwd(opf_dtype dt, void *y, const void *const *in, const opf_cuda_nd *nd{sp},\n"
                f"                         void *stream);\n"
                f"unsigned {name}_cuda_bwd(opf_dtype dt, void *const *dx, const void *g, const void *const *in,\n"
                f"                         const opf_cuda_nd *nd{sp}, void *stream);\n")
    else:
        cs = lambda t: f"{t}.ndim ? {t}.strides[{t}.ndim - 1] : 1"  # noqa: E731
        walk_fwd = (f"    const int64_t cols = {first}.ndim ? {first}.sizes[lead] : 1;\n"
                    f"    opf_cuda_nd nd; /* the rows: the leading dims' walk, operand 0 the output */\n"
                    f"    opf_cuda_nd_init(OP, &nd, lead, {first}.sizes, {N + 1},\n"
                    f"                     (const int64_t *[]){{y.strides, {', '.join(f'{x}.strides' for x in ins)}}});\n"
                    f"    const int64_t cs[] = {{{', '.join(cs(x) for x in ins)}}}; /* each input's step along a row */\n")
        walk_bwd = (f"    const int64_t cols = {first}.ndim ? {first}.sizes[lead] : 1;\n"
                    f"    opf_cuda_nd nd;\n"
                    f"    opf_cuda_nd_init(OP, &nd, lead, {first}.sizes, {2 * N + 1},\n"
                    f"                     (const int64_t *[]){{{', '.join(f'd{x}.strides' for x in ins)}, g.strides, "
                    f"{', '.join(f'{x}.strides' for x in ins)}}});\n"
                    f"    const int64_t cs[] = {{{', '.join(cs('d' + x) for x in ins)}, {', '.join(cs(x) for x in ins)}}};\n")
        call_fwd = f"{name}_cuda_fwd(dt, y.data, (const void *const[]){{{in_data}}}, &nd, cols, cs{sa}, call.stream)"
        call_bwd = (f"{name}_cuda_bwd(dt, (void *const[]){{{dx_data}}}, g.data, (const void *const[]){{{in_data}}}, "
                    f"&nd, cols, cs{sa}, call.stream)")
        decl = (f"unsigned {name}_cuda_fwd(opf_dtype dt, void *y, const void *const *in, const opf_cuda_nd *nd, int64_t cols,\n"
                f"                         const int64_t *cs{sp}, void *stream);\n"
                f"unsigned {name}_cuda_bwd(opf_dtype dt, void *const *dx, const void *g, const void *const *in,\n"
                f"                         const opf_cuda_nd *nd, int64_t cols, const int64_t *cs{sp}, void *stream);\n")
    text = f"""/* ---- CUDA: the glue of {name}.cu's kernels (built when opforge.load is given {name}.cu) ----------- */

#ifdef OPF_WITH_CUDA
#include <opforge/cuda.h>

/* {name}.cu's launchers: they return the blocks they launched (0: nothing to do). */
{decl}
static void {name}_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {{
    static const char OP[] = "{name}::{name}";
{take}{unpack}{info}    OPF_CUDA_CALL(call, OP, &{first}, "{first}"); /* {first}'s GPU current, torch's stream there */
    const opf_dtype dt = check_inputs(OP, opf_check_cuda, {check_args});
{out_alloc}    const opf_tensor y = opf_tensor_info(OP, "y", y_h);
{walk_fwd}    const unsigned grid = {call_fwd};
    opf_cuda_done(&call, NULL, "{name}_fwd", grid, 256, {N + 1}, (opf_tensor[]){{{tensors_fwd}}});
    OPF_RETURN(stack, 0, y_h);
}}

static void {name}_backward_cuda(StableIValue *stack, uint64_t nin, uint64_t nout) {{
    static const char OP[] = "{name}::{name}_backward";
{take_bwd}{unpack_bwd}    const opf_tensor g = opf_tensor_info(OP, "grad", grad_h);
{info}    OPF_CUDA_CALL(call, OP, &{first}, "{first}");
    const opf_dtype dt = check_inputs(OP, opf_check_cuda, {check_args});
    opf_check_cuda(OP, "grad", &g, "{first}", &{first});
    opf_check_same_dtype(OP, "grad", &g, "{first}", &{first});
{grad_check}{grad_allocs}{walk_bwd}    const unsigned grid = {call_bwd};
    opf_cuda_done(&call, NULL, "{name}_bwd", grid, 256, {2 * N + 1}, (opf_tensor[]){{{tensors_bwd}}});
{grad_returns}}}

#define {up}_CUDA {name}_cuda
#define {up}_BACKWARD_CUDA {name}_backward_cuda
#else
{off}#endif
"""
    return text.replace(chr(92) + "n", chr(10))


def _cuda_file(sig: Signature) -> str:
    """NAME.cu: the placeholder's CUDA kernels and their launchers."""
    name, ins, N = sig.name, sig.inputs, len(sig.inputs)
    scale = sig.scale()
    sp = sig.c_scalar_params()
    sa = sig.c_scalar_args()
    loads = "".join(f"        const float {x}_i = opf_to_acc(in{k}[opf_cuda_offset(nd, {k + 1}, i)]);\n"
                    for k, x in enumerate(ins))
    squares = " + ".join(f"{x}_i * {x}_i" for x in ins)
    in_params = ", ".join(f"const T *__restrict__ in{k}" for k in range(N))
    in_casts = ", ".join(f"(const T *)in[{k}]" for k in range(N))
    dx_params = ", ".join(f"T *__restrict__ d{k}" for k in range(N))
    dx_casts = ", ".join(f"(T *)dx[{k}]" for k in range(N))
    s2 = f"2.0f{' * (' + scale + ')' if scale else ''}"
    if not sig.reduce:
        kernels = f"""/* >>> kernels: the computation, one thread per element (a grid-stride loop). Edit these two, the ones in
 * {name}.c and {name}_avx2.c, and reference.py. */

/* placeholder: y = {(scale + ' * ') if scale else ''}({squares.replace('_i', '')}) */
template <class T>
__global__ void __launch_bounds__(THREADS) fwd_kernel(T *__restrict__ y, {in_params}, opf_cuda_nd nd{sp}) {{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nd.numel; i += (int64_t)gridDim.x * blockDim.x) {{
{loads}        y[opf_cuda_offset(nd, 0, i)] = opf_from_acc<T>({(scale + ' * ') if scale else ''}({squares}));
    }}
}}

/* placeholder: d<input> = 2{(' * ' + scale) if scale else ''} * <input> * dy; operands: the gradients, dy, the inputs */
template <class T>
__global__ void __launch_bounds__(THREADS) bwd_kernel({dx_params}, const T *__restrict__ g, {in_params}, opf_cuda_nd nd{sp}) {{
    const float s2 = {s2};
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nd.numel; i += (int64_t)gridDim.x * blockDim.x) {{
        const float dy = opf_to_acc(g[opf_cuda_offset(nd, {N}, i)]);
{''.join(f'        d{k}[opf_cuda_offset(nd, {k}, i)] = opf_from_acc<T>(s2 * opf_to_acc(in{k}[opf_cuda_offset(nd, {N + 1 + k}, i)]) * dy);' + chr(92) + 'n' for k in range(N))}    }}
}}
/* <<< kernels */

template <class T>
static unsigned fwd_launch(void *y, const void *const *in, const opf_cuda_nd *nd{sp}, cudaStream_t s) {{
    const unsigned grid = opf_cuda_blocks(nd->numel, THREADS, MAX_BLOCKS);
    OPF_LAUNCH(fwd_kernel<T>, grid, THREADS, 0, s, (T *)y, {in_casts}, *nd{sa});
    return grid;
}}

template <class T>
static unsigned bwd_launch(void *const *dx, const void *g, const void *const *in, const opf_cuda_nd *nd{sp}, cudaStream_t s) {{
    const unsigned grid = opf_cuda_blocks(nd->numel, THREADS, MAX_BLOCKS);
    OPF_LAUNCH(bwd_kernel<T>, grid, THREADS, 0, s, {dx_casts}, (const T *)g, {in_casts}, *nd{sa});
    return grid;
}}

extern "C" unsigned {name}_cuda_fwd(opf_dtype dt, void *y, const void *const *in, const opf_cuda_nd *nd{sp}, void *stream) {{
    if (nd->numel == 0) return 0;
    cudaStream_t s = (cudaStream_t)stream;
    switch (dt) {{
    case OPF_F32: return fwd_launch<float>(y, in, nd{sa}, s);
    case OPF_BF16: return fwd_launch<__nv_bfloat16>(y, in, nd{sa}, s);
    case OPF_F16: return fwd_launch<__half>(y, in, nd{sa}, s);
    default: return 0;
    }}
}}

extern "C" unsigned {name}_cuda_bwd(opf_dtype dt, void *const *dx, const void *g, const void *const *in, const opf_cuda_nd *nd{sp},
                                 void *stream) {{
    if (nd->numel == 0) return 0;
    cudaStream_t s = (cudaStream_t)stream;
    switch (dt) {{
    case OPF_F32: return bwd_launch<float>(dx, g, in, nd{sa}, s);
    case OPF_BF16: return bwd_launch<__nv_bfloat16>(dx, g, in, nd{sa}, s);
    case OPF_F16: return bwd_launch<__half>(dx, g, in, nd{sa}, s);
    default: return 0;
    }}
}}
"""
        what = "one thread per element over any strides (the glue passes the merged walk)"
    else:
        rloads = "".join(f"            const float {x}_i = opf_to_acc(in{k}[b{k} + j * cs.s[{k}]]);\n"
                         for k, x in enumerate(ins))
        bases_fwd = "".join(f"        const int64_t b{k} = opf_cuda_offset(nd, {k + 1}, r);\n" for k in range(N))
        kernels = f"""/* >>> kernels: the computation, one block per row (a grid-stride loop over rows), the row's elements
 * spread over the block's threads and their float32 partial sums added by opf_block_sum. Edit these
 * two, the ones in {name}.c and {name}_avx2.c, and reference.py. */

/* placeholder: y = {(scale + ' * ') if scale else ''}sum over the row of ({squares.replace('_i', '')}) */
template <class T>
__global__ void __launch_bounds__(THREADS) fwd_kernel(T *__restrict__ y, {in_params}, opf_cuda_nd nd, int64_t cols,
                                                      Strides cs{sp}) {{
    __shared__ float scratch[32];
    for (int64_t r = blockIdx.x; r < nd.numel; r += gridDim.x) {{
{bases_fwd}        float acc = 0.0f;
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {{
{rloads}            acc += {squares};
        }}
        acc = opf_block_sum(acc, scratch);
        if (threadIdx.x == 0) y[opf_cuda_offset(nd, 0, r)] = opf_from_acc<T>({('(' + scale + ') * acc') if scale else 'acc'});
    }}
}}

/* placeholder: d<input> = 2{(' * ' + scale) if scale else ''} * dy * <input>; operands: the gradients, dy, the inputs */
template <class T>
__global__ void __launch_bounds__(THREADS) bwd_kernel({dx_params}, const T *__restrict__ g, {in_params}, opf_cuda_nd nd,
                                                      int64_t cols, Strides cs{sp}) {{
    for (int64_t r = blockIdx.x; r < nd.numel; r += gridDim.x) {{
        const float gr = {s2} * opf_to_acc(g[opf_cuda_offset(nd, {N}, r)]);
{''.join(f'        const int64_t db{k} = opf_cuda_offset(nd, {k}, r), b{k} = opf_cuda_offset(nd, {N + 1 + k}, r);' + chr(92) + 'n' for k in range(N))}        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {{
{''.join(f'            d{k}[db{k} + j * cs.s[{k}]] = opf_from_acc<T>(gr * opf_to_acc(in{k}[b{k} + j * cs.s[{N + k}]]));' + chr(92) + 'n' for k in range(N))}        }}
    }}
}}
/* <<< kernels */

template <class T>
static unsigned fwd_launch(void *y, const void *const *in, const opf_cuda_nd *nd, int64_t cols, const int64_t *cs{sp},
                           cudaStream_t s) {{
    Strides st;
    for (int k = 0; k < {N}; k++) st.s[k] = cs[k];
    const unsigned grid = opf_cuda_blocks(nd->numel, 1, MAX_BLOCKS);
    OPF_LAUNCH(fwd_kernel<T>, grid, THREADS, 0, s, (T *)y, {in_casts}, *nd, cols, st{sa});
    return grid;
}}

template <class T>
static unsigned bwd_launch(void *const *dx, const void *g, const void *const *in, const opf_cuda_nd *nd, int64_t cols,
                           const int64_t *cs{sp}, cudaStream_t s) {{
    Strides st;
    for (int k = 0; k < {2 * N}; k++) st.s[k] = cs[k];
    const unsigned grid = opf_cuda_blocks(nd->numel, 1, MAX_BLOCKS);
    OPF_LAUNCH(bwd_kernel<T>, grid, THREADS, 0, s, {dx_casts}, (const T *)g, {in_casts}, *nd, cols, st{sa});
    return grid;
}}

extern "C" unsigned {name}_cuda_fwd(opf_dtype dt, void *y, const void *const *in, const opf_cuda_nd *nd, int64_t cols,
                                 const int64_t *cs{sp}, void *stream) {{
    if (nd->numel == 0) return 0;
    cudaStream_t s = (cudaStream_t)stream;
    switch (dt) {{
    case OPF_F32: return fwd_launch<float>(y, in, nd, cols, cs{sa}, s);
    case OPF_BF16: return fwd_launch<__nv_bfloat16>(y, in, nd, cols, cs{sa}, s);
    case OPF_F16: return fwd_launch<__half>(y, in, nd, cols, cs{sa}, s);
    default: return 0;
    }}
}}

extern "C" unsigned {name}_cuda_bwd(opf_dtype dt, void *const *dx, const void *g, const void *const *in, const opf_cuda_nd *nd,
                                 int64_t cols, const int64_t *cs{sp}, void *stream) {{
    if (nd->numel == 0) return 0;
    cudaStream_t s = (cudaStream_t)stream;
    switch (dt) {{
    case OPF_F32: return bwd_launch<float>(dx, g, in, nd, cols, cs{sa}, s);
    case OPF_BF16: return bwd_launch<__nv_bfloat16>(dx, g, in, nd, cols, cs{sa}, s);
    case OPF_F16: return bwd_launch<__half>(dx, g, in, nd, cols, cs{sa}, s);
    default: return 0;
    }}
}}
"""
        what = "one block per row of the last dim, any strides"
    strides_struct = "/* each operand's step along a row, passed by value */\ntypedef struct Strides {\n    int64_t s[8];\n} Strides;\n\n" if sig.reduce else ""
    return (f"""/*
 * {name} on the GPU: C-style CUDA kernels ({what}) and their extern "C" launchers, which the CUDA glue in
 * {name}.c calls with torch's current stream. float32 compute; bfloat16 and float16 read and written
 * directly (no float32 copies). Built by
 *     opforge.load("{name}", ["{name}.c", "{name}_avx2.c", "{name}.cu"])
 * with nvcc; the kernels' logic can be tested on a CPU with opforge's CUDA emulation (-DOPF_CUDA_EMULATE).
 */
#include <opforge/cuda_kernel.cuh>

#define THREADS 256
#define MAX_BLOCKS 8192 /* the grid-stride loops cover the rest */

""" + strides_struct + kernels).replace(chr(92) + "n", chr(10))


def _c_file(sig: Signature, kernels: dict[str, str]) -> str:
    glue = _glue(sig)
    kind = ("the last dim reduced: y = " + sig.inputs[0] + ".shape[:-1]") if sig.reduce else "elementwise"
    return f"""/*
 * {sig.name}({sig.schema_args()}) -> Tensor, {kind}.
 *
 * This file: the scalar reference kernels (the oracle: keep them), the variant table, the glue
 * that checks arguments, allocates outputs and calls a kernel, and the descriptors. The kernels
 * compute in float32; bfloat16 and float16 inputs are converted to float32 copies first and the
 * result is rounded back once (the copies cost memory: a kernel reading halves directly avoids them).
 * {sig.name}_avx2.c holds the vectorised variant. Load with
 *     opforge.load("{sig.name}", ["{sig.name}.c", "{sig.name}_avx2.c"])
 */
#include <string.h>

#include <opforge/op.h>

#include "{sig.name}.h"

{kernels['ref']}
{glue}"""


def _header(sig: Signature, kernels: dict[str, str]) -> str:
    up = sig.name.upper()
    return f"""/* {sig.name}: the kernel contract shared by the scalar reference ({sig.name}.c) and the ISA
 * variants ({sig.name}_avx2.c). float32 on raw pointers; strides (the _s arguments) in elements.
 * {'One row at a time: the glue calls fwd once per row of the last dim.' if sig.reduce else 'One strided run of n elements at a time.'} */
#ifndef {up}_H
#define {up}_H

#include <stdint.h>

#include <opforge/runtime.h>

typedef struct {sig.name}_kernels {{
    OPF_VARIANT_HEAD; /* "avx2" and the ISA it needs: opf_variant_pick chooses by them */
{kernels['contract']}}} {sig.name}_kernels;

extern const {sig.name}_kernels {sig.name}_kernels_ref;

#endif
"""


def _avx2_file(sig: Signature, kernels: dict[str, str]) -> str:
    hsum = """
/* The sum of v's 8 lanes. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
""" if sig.reduce else ""
    return f"""/*
 * {sig.name}, AVX2. Built with -mavx2 -mfma -mf16c because of the _avx2.c suffix, and run only on
 * CPUs that have AVX2 (opf_variant_pick). Options: -ffp-contract=off, so a + b * c rounds as the
 * reference's does unless you write an FMA.
 */
#include <immintrin.h>

#include "{sig.name}.h"
{hsum}
{kernels['avx2']}
const {sig.name}_kernels {sig.name}_kernels_avx2 = {{"avx2", OPF_ISA_AVX2, fwd_avx2, bwd_avx2}};
"""


def _reference(sig: Signature) -> str:
    params = ", ".join(sig.inputs + [s for s, _ in sig.scalars])
    squares = " + ".join(f"{x} * {x}" for x in sig.inputs)
    parts = [s for s, t in sig.scalars if t != "bool"]
    expr = f"{' * '.join(parts)} * ({squares})" if parts else (f"({squares})" if sig.reduce else squares)
    if sig.reduce:
        expr = f"{expr}.sum(-1)"
    return f'''"""The PyTorch reference of {sig.name}: what the C kernels must compute."""


def {sig.name}({params}):
    return {expr}
'''


def _substitute(text: str, sig: Signature) -> str:
    scalars = {s: {"float": 0.75, "int": 3, "bool": True}[t] for s, t in sig.scalars}
    return (text.replace("{name}", sig.name).replace("{INPUTS}", repr(sig.inputs))
            .replace("{SCALARS}", repr(scalars)).replace("{REDUCE}", repr(sig.reduce))
            .replace("{SIGNATURE}", f"{sig.name}({sig.schema_args()})")
            .replace("{FIRST}", sig.inputs[0])
            .replace("{SHAPE_RULE}", f"[{sig.inputs[0]}[:-1]]" if sig.reduce else f"like:{sig.inputs[0]}")
            .replace("{KIND}", f"reduces the last dim ({sig.inputs[0]}.shape[:-1])" if sig.reduce else "elementwise")
            .replace("{SHAPE_ARGS}", " ".join(f"--shape {x}=64,512" for x in sig.inputs) if sig.reduce else "")
            .replace("{RTOL}", " --rtol 1e-5" if sig.reduce else ""))


def _templates() -> str:
    spec = importlib.util.find_spec("opforge")
    return os.path.join(os.path.dirname(spec.origin), "templates")


# template file -> file name in the new project
TEMPLATES = {
    "ops.py": "ops.py",
    "test_op.py": "test_{name}.py",
    "bench_op.py": "bench_{name}.py",
    "README.md": "README.md",
}


def files(sig: Signature) -> dict[str, str]:
    """The project's files: name -> text."""
    k = _kernels(sig)
    out = {f"{sig.name}.c": _c_file(sig, k), f"{sig.name}.h": _header(sig, k), f"{sig.name}_avx2.c": _avx2_file(sig, k),
           "reference.py": _reference(sig)}
    if sig.cuda:
        out[f"{sig.name}.cu"] = _cuda_file(sig)
    for template, target in TEMPLATES.items():
        with open(os.path.join(_templates(), template)) as f:
            out[target.replace("{name}", sig.name)] = _substitute(f.read(), sig)
    return out


def new(sig: Signature, directory: str | None = None) -> str:
    """Writes the project into DIR/NAME (never over a non-empty folder); returns its path."""
    refuse_used_name(sig, files)
    return write_project(sig.name, files(sig), directory)


_PROBE_NAME = "opforge_name_probe"


def _identifiers(file: str, text: str) -> set[str]:
    """The names a generated file's code uses (Python: names, functions, arguments and imports; C: identifiers
    outside comments and strings)."""
    if file.endswith(".py"):
        out = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Name):
                out.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                out.update((a.asname or a.name).split(".")[0] for a in node.names)
                if isinstance(node, ast.ImportFrom) and node.module:  # `from ops import NAME`: NAME beside ops
                    out.add(node.module.split(".")[0])
        return out
    if file.endswith((".c", ".h", ".cu")):
        code = re.sub(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', " ", text, flags=re.S)
        return set(re.findall(r"\b[A-Za-z_]\w*\b", code))
    return set()


def refuse_used_name(sig, render) -> None:
    """Both scaffolds' check of NAME against the project itself: rendered under another name, no generated
    file may use NAME (a module the tests import, a helper, a local of the kernels), which the op's own
    name would shadow or be shadowed by (`opforge new torch`, `ops`, `reference`, `n`)."""
    probe = copy.copy(sig)
    probe.name = _PROBE_NAME
    for file, text in render(probe).items():
        if sig.name in _identifiers(file, text):
            raise SystemExit(f"opforge new: NAME {sig.name!r} is a name the generated project uses itself (in "
                             f"{file.replace(_PROBE_NAME, sig.name)}); pick another")


def write_project(name: str, texts: dict[str, str], directory: str | None = None) -> str:
    """texts (file name -> text) into DIR/NAME, never over a non-empty folder; returns its path. Both
    scaffolds' `new`."""
    dest = os.path.join(directory or os.getcwd(), name)
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise SystemExit(f"opforge new: {dest} exists and is not a folder")
    if os.path.exists(dest) and os.listdir(dest):
        raise SystemExit(f"opforge new: {dest} exists and is not empty")
    os.makedirs(dest, exist_ok=True)
    for target, text in texts.items():
        with open(os.path.join(dest, target), "w") as f:
            f.write(text)
    return dest


def splice(text: str, body: str) -> str:
    """text with the part between its `>>> kernels` and `<<< kernels` lines replaced by body
    (which may carry its own markers): what a walk-through's "replace the kernels" does."""
    begin, end = text.index(BEGIN), text.index(END) + len(END)
    if BEGIN in body:
        body = body[body.index(BEGIN):body.index(END) + len(END)]
    return text[:begin] + body.strip("\n") + text[end:]
