/*
 * Activations and their derivatives, float32 and float64, for the GEMM
 * epilogue and the linear backward:
 *     relu(x)      = max(x, 0)                      (NaN passes, as torch.relu)
 *     gelu(x)      = 0.5 x (1 + erf(x / sqrt 2))
 *     gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
 *     silu(x)      = x / (1 + exp(-x))
 * and the backward's first steps over rows: g' = g * act'(pre), with the
 * column sums of g' (a bias gradient) fused or on their own.
 *
 * Every variant evaluates these formulas as float32 does at infinite and
 * huge x too, as torch's kernels do: gelu'(inf) = 1 + inf x 0 = NaN,
 * gelu'(-1e30) = 0. Derivatives at NaN are NaN, but relu'(NaN) = 1: torch's
 * relu backward passes the gradient there.
 */
#ifndef OPFORGE_KERNELS_ACT_H
#define OPFORGE_KERNELS_ACT_H

#include <stdint.h>

#include "convert.h"
#include "opforge/half.h"
#include "opforge/runtime.h"

typedef enum act_kind { ACT_NONE = 0, ACT_RELU, ACT_GELU, ACT_GELU_TANH, ACT_SILU, ACT_COUNT } act_kind;
/* act_kind's values by name, in order: the value list of the linear ops' `str activation` (the
 * index opf_arg_enum gives is the code). */
#define ACT_NAMES "none|relu|gelu|gelu_tanh|silu"

/* Scalar activation and its derivative (also the tail path of the ISA files). */
float act_f32(act_kind act, float x);
float act_grad_f32(act_kind act, float x);
/* float64, from libm: the oracle's and the float64 path's */
double act_f64(act_kind act, double x);
double act_grad_f64(act_kind act, double x);

/* out[i] = g[i] * act'(pre[i]) for n elements */
typedef void (*act_grad_fn)(float *out, const float *g, const float *pre, int64_t n, act_kind act);

typedef struct act_kernels {
    OPF_VARIANT_HEAD;
    act_grad_fn grad;
} act_kernels;

extern const act_kernels act_kernels_ref;
extern const act_kernels act_kernels_avx2; /* act_avx2.c: 8 lanes, also what the AVX-512 GEMMs pair with */
extern const opf_variants act_variants;

const act_kernels *act_kernels_for(opf_isa isa);

/* Row blocks of g' = g * act'(pre) over (m, n) matrices of type dt (float32,
 * bfloat16 or float16; 16-bit ones computed in float32 through cvt and
 * rounded once) with row strides, threaded. out may be pre (in place). With
 * db (optional, n floats) also db[j] = sum_i g'[i, j] of g' as stored, in the
 * same pass: what colsum_f32 gives, without reading g' again. threads: the
 * caller's plan's thread count, which decides whether threads split the
 * columns (each summing its own) or the rows (the sums after); the same bits
 * either way. */
void act_grad_rows(const act_kernels *kern, const convert_kernels *cvt, opf_dtype dt, void *out, int64_t rso,
                   const void *g, int64_t rsg, const void *pre, int64_t rsp, int64_t m, int64_t n, act_kind act,
                   float *db, int64_t threads);
/* db[j] = (beta ? db[j] : 0) + sum_i g[i, j] in float32 over g of type dt; threaded over columns. */
void colsum_f32(const convert_kernels *cvt, float *db, const void *g, opf_dtype dt, int64_t rsg, int64_t m, int64_t n,
                int beta);

#endif
