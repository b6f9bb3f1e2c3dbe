/*
 * Conversions between float32 and the 16-bit float types (bfloat16, float16),
 * rounded to nearest even as opforge/half.h rounds (NaN -> 0x7fc0 for
 * bfloat16): per-ISA vector loops over contiguous runs, and threaded whole
 * arrays of any of the three float32-computed types.
 */
#ifndef OPFORGE_KERNELS_CONVERT_H
#define OPFORGE_KERNELS_CONVERT_H

#include <stdint.h>

#include "opforge/half.h"
#include "opforge/runtime.h"

/* n contiguous elements between float32 and a 16-bit type (dt: OPF_BF16 / OPF_F16) */
typedef void (*convert_to_f32_fn)(float *dst, const uint16_t *src, opf_dtype dt, int64_t n);
typedef void (*convert_from_f32_fn)(uint16_t *dst, const float *src, opf_dtype dt, int64_t n);

typedef struct convert_kernels {
    OPF_VARIANT_HEAD;
    convert_to_f32_fn to_f32;
    convert_from_f32_fn from_f32;
} convert_kernels;

extern const convert_kernels convert_kernels_ref;
extern const convert_kernels convert_kernels_avx2;   /* convert_avx2.c: F16C, 8 lanes */
extern const convert_kernels convert_kernels_avx512; /* convert_avx512.c: 16 lanes, masked tails */
extern const opf_variants convert_variants;

const convert_kernels *convert_kernels_for(opf_isa isa);

/* dst[i] = src[i * stride] converted to float32 / from float32 (rounded to
 * nearest even) for float32, bfloat16 and float16; contiguous runs use the
 * ISA's vector conversions and threads. */
void convert_load_f32(const convert_kernels *kern, float *dst, const void *src, opf_dtype dt, int64_t n,
                      int64_t stride);
void convert_store_f32(const convert_kernels *kern, void *dst, opf_dtype dt, const float *src, int64_t n);

#endif
