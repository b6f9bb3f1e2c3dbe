/*
 * Element access of the attention drivers (attention.c, attention_decode.c)
 * and their oracles: an element's offset in a 4-d (b, h, i, d) array, and a
 * row of n elements between any dtype at any stride and float32, through the
 * ISA's conversions (cvt) where the row is contiguous and 16-bit.
 */
#ifndef OPFORGE_KERNELS_ATTENTION_ROWS_H
#define OPFORGE_KERNELS_ATTENTION_ROWS_H

#include <stdint.h>
#include <string.h>

#include "convert.h"
#include "opforge/half.h"

/* element (b, h, i, d) of a 4-d array of strides st */
static inline int64_t off4(const int64_t *st, int64_t b, int64_t h, int64_t i, int64_t d) {
    return b * st[0] + h * st[1] + i * st[2] + d * st[3];
}

/* Out of line (noinline; unused: not every includer calls both). Inlined into the drivers' workers
 * they grew them by a third (fwd_worker 6.3 -> 8.8 KB) and the forward ran 3-4% slower (B8 H8 N256
 * D64 causal float32, 1 thread, 6 pinned alternating runs each way): as calls they are what
 * attention.c had before they moved here. */

/* n elements from src[off + e*stride] into float32 dst */
__attribute__((noinline, unused)) static void load_row(const convert_kernels *cvt, float *dst, const void *src,
                                                       int64_t off, int64_t stride, int64_t n, opf_dtype dt) {
    if (dt == OPF_F32) {
        const float *s = (const float *)src + off;
        if (stride == 1)
            memcpy(dst, s, sizeof(float) * (size_t)n);
        else
            for (int64_t e = 0; e < n; e++) dst[e] = s[e * stride];
        return;
    }
    if (stride == 1) {
        cvt->to_f32(dst, (const uint16_t *)src + off, dt, n);
        return;
    }
    for (int64_t e = 0; e < n; e++) dst[e] = (float)opf_load_elem(src, off + e * stride, dt);
}

/* float32 src into n elements of dst[off + e*stride], rounded to nearest even */
__attribute__((noinline, unused)) static void store_row(const convert_kernels *cvt, void *dst, int64_t off,
                                                        int64_t stride, const float *src, int64_t n, opf_dtype dt) {
    if (dt == OPF_F32) {
        float *d = (float *)dst + off;
        if (stride == 1)
            memcpy(d, src, sizeof(float) * (size_t)n);
        else
            for (int64_t e = 0; e < n; e++) d[e * stride] = src[e];
        return;
    }
    if (stride == 1) {
        cvt->from_f32((uint16_t *)dst + off, src, dt, n);
        return;
    }
    for (int64_t e = 0; e < n; e++) opf_store_elem(dst, off + e * stride, dt, src[e]);
}

#endif
