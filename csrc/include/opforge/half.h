/*
 * Element types of opforge kernels and scalar conversions of the two 16-bit
 * float formats. Half types are always computed in fp32 and rounded once,
 * round-to-nearest-even, NaN kept a (positive, quiet) NaN as torch does.
 */
#ifndef OPFORGE_KERNELS_HALF_H
#define OPFORGE_KERNELS_HALF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef enum opf_dtype { OPF_F32 = 0, OPF_F64, OPF_BF16, OPF_F16, OPF_DTYPE_COUNT } opf_dtype;

/* Bytes per element of each opf_dtype. */
static inline size_t opf_dtype_size(opf_dtype dt) { return dt == OPF_F64 ? 8 : dt == OPF_F32 ? 4 : 2; }

static inline float opf_bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t opf_f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float opf_bf16_to_f32(uint16_t h) { return opf_bits_to_f32((uint32_t)h << 16); }

static inline uint16_t opf_f32_to_bf16(float f) {
    if (f != f) return 0x7fc0;
    uint32_t u = opf_f32_to_bits(f);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float opf_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return opf_bits_to_f32(sign | 0x7f800000 | (man << 13)); /* inf / nan */
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24 is exact in fp32 */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return opf_bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}

static inline uint16_t opf_f32_to_f16(float f) {
    uint32_t u = opf_f32_to_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffff;
    if (a > 0x7f800000) return (uint16_t)(sign | 0x7e00);  /* nan */
    if (a >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* rounds to inf */
    if (a < 0x38800000) {                                  /* subnormal or zero */
        /* adding 0.5 (2^-1) aligns the 2^-24 quantum to the low mantissa bits and
         * lets the FPU round to nearest even */
        float v = opf_bits_to_f32(a) + 0.5f;
        return (uint16_t)(sign | (uint16_t)(opf_f32_to_bits(v) - 0x3f000000));
    }
    uint32_t r = a + 0xfff + ((a >> 13) & 1) - (112u << 23);
    return (uint16_t)(sign | (uint16_t)(r >> 13));
}

/* Element i of p (any opf_dtype) as double, and back (16-bit types rounded
 * through float32): for strided, scalar and reference paths. */
static inline double opf_load_elem(const void *p, int64_t i, opf_dtype dt) {
    switch (dt) {
    case OPF_F64: return ((const double *)p)[i];
    case OPF_BF16: return opf_bf16_to_f32(((const uint16_t *)p)[i]);
    case OPF_F16: return opf_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline void opf_store_elem(void *p, int64_t i, opf_dtype dt, double v) {
    switch (dt) {
    case OPF_F64: ((double *)p)[i] = v; break;
    case OPF_BF16: ((uint16_t *)p)[i] = opf_f32_to_bf16((float)v); break;
    case OPF_F16: ((uint16_t *)p)[i] = opf_f32_to_f16((float)v); break;
    default: ((float *)p)[i] = (float)v;
    }
}

#endif
