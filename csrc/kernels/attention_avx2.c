/*
 * Attention kernels, AVX2 + FMA: the block matmul (up to 6 x 16 floats of C
 * in 12 ymm accumulators, A broadcast from any strides, B rows loaded in
 * place, masked loads/stores on the last columns), the column-wise online
 * softmax (8 queries per vector) and the backward's elementwise steps, all
 * with exp2_8z (math_avx2.h).
 */
#include <immintrin.h>
#include <math.h>

#include "attention.h"
#include "math_avx2.h"

/* C[0..mr) x [0..8*nv) (+)= A B; masked: lanes beyond the mask are neither
 * read from B or C nor written. mr, nv and masked are constants at each call. */
static inline __attribute__((always_inline)) void tile(const int mr, const int nv, const int masked, int64_t k,
                                                       const float *a, int64_t rsa, int64_t csa, const float *b,
                                                       int64_t ldb, float *c, int64_t ldc, int acc, __m256i m0,
                                                       __m256i m1) {
    __m256 c0[6], c1[6];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) c0[r] = c1[r] = _mm256_setzero_ps();
    for (int64_t p = 0; p < k; p++, a += csa, b += ldb) {
        __m256 b0 = masked ? _mm256_maskload_ps(b, m0) : _mm256_loadu_ps(b);
        __m256 b1 = nv == 2 ? (masked ? _mm256_maskload_ps(b + 8, m1) : _mm256_loadu_ps(b + 8)) : b0;
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            __m256 av = _mm256_broadcast_ss(a + r * rsa);
            c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
            if (nv == 2) c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        float *cr = c + r * ldc;
        if (masked) {
            if (acc) c0[r] = _mm256_add_ps(c0[r], _mm256_maskload_ps(cr, m0));
            _mm256_maskstore_ps(cr, m0, c0[r]);
            if (nv == 2) {
                if (acc) c1[r] = _mm256_add_ps(c1[r], _mm256_maskload_ps(cr + 8, m1));
                _mm256_maskstore_ps(cr + 8, m1, c1[r]);
            }
        } else {
            if (acc) c0[r] = _mm256_add_ps(c0[r], _mm256_loadu_ps(cr));
            _mm256_storeu_ps(cr, c0[r]);
            if (nv == 2) {
                if (acc) c1[r] = _mm256_add_ps(c1[r], _mm256_loadu_ps(cr + 8));
                _mm256_storeu_ps(cr + 8, c1[r]);
            }
        }
    }
}

#define ROWS(NV, MASKED)                                                                     \
    for (int64_t i = 0; i < m; i += 6) {                                                     \
        const float *ai = a + i * rsa;                                                       \
        float *ci = c + i * ldc + j;                                                         \
        switch (m - i < 6 ? m - i : 6) {                                                     \
        case 6: tile(6, NV, MASKED, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;  \
        case 5: tile(5, NV, MASKED, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;  \
        case 4: tile(4, NV, MASKED, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;  \
        case 3: tile(3, NV, MASKED, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;  \
        case 2: tile(2, NV, MASKED, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;  \
        default: tile(1, NV, MASKED, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break; \
        }                                                                                    \
    }

static void mm_avx2(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                    int64_t ldb, float *c, int64_t ldc, int acc) {
    for (int64_t j = 0; j < n; j += 16) { /* one 16-column sliver of B stays in L1 across the rows */
        const int64_t nb = n - j < 16 ? n - j : 16;
        const float *bj = b + j;
        __m256i m0 = lanes_below(nb), m1 = lanes_below(nb - 8);
        if (nb == 16) {
            ROWS(2, 0)
        } else if (nb > 8) {
            ROWS(2, 1)
        } else if (nb == 8) {
            ROWS(1, 0)
        } else {
            ROWS(1, 1)
        }
    }
}


/* The keep-mask of key row j for the 8 queries starting at i (query i keeps key
 * j when j <= i + diag): all, none, or a lane compare. */
static inline __m256 keep8(int64_t i, int64_t j, int64_t diag) {
    if (j <= i + diag) return _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    if (j >= i + 8 + diag) return _mm256_setzero_ps();
    const __m256i q = _mm256_add_epi32(_mm256_set1_epi32((int)i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(q, _mm256_set1_epi32((int)(j - diag - 1))));
}

/* Columns in groups of 8 queries, up to 8 groups at a time, walked row by row:
 * consecutive addresses (a column walk would hit each row 4 KiB apart and stall
 * on 4K-aliasing between its stores and the next loads). */
static void softmax_cols_avx2(float *st, int64_t ld, int64_t bk, int64_t bq, float scale, float *m, float *l,
                              float *alpha, int64_t diag) {
    const __m256 vs = _mm256_set1_ps(scale), vs2 = _mm256_set1_ps(scale * LOG2E), log2e = _mm256_set1_ps(LOG2E);
    const __m256 ninf = _mm256_set1_ps(-INFINITY), zero = _mm256_setzero_ps();
    int64_t i0 = 0;
    for (; i0 + 8 <= bq; i0 += 64) {
        const int ng = (int)((bq - i0) / 8 < 8 ? (bq - i0) / 8 : 8);
        const int64_t jfull = i0 + diag; /* rows j <= jfull keep every query of the chunk */
        __m256 mx[8], base2[8], sum[8];
        for (int g = 0; g < ng; g++) mx[g] = _mm256_loadu_ps(m + i0 + 8 * g), sum[g] = zero;
        for (int64_t j = 0; j < bk; j++) {
            const float *row = st + j * ld + i0;
            if (j <= jfull) {
                for (int g = 0; g < ng; g++)
                    mx[g] = _mm256_max_ps(mx[g], _mm256_mul_ps(_mm256_loadu_ps(row + 8 * g), vs));
            } else {
                for (int g = 0; g < ng; g++) {
                    __m256 x = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(row + 8 * g), vs),
                                                keep8(i0 + 8 * g, j, diag));
                    mx[g] = _mm256_max_ps(mx[g], x);
                }
            }
        }
        for (int g = 0; g < ng; g++) /* a column with no key yet: base 0, so that exp(-inf - 0) = 0 */
            base2[g] = _mm256_mul_ps(_mm256_blendv_ps(mx[g], zero, _mm256_cmp_ps(mx[g], ninf, _CMP_EQ_OQ)), log2e);
        for (int64_t j = 0; j < bk; j++) { /* exp(x scale - base) = 2^(x scale log2e - base log2e) */
            float *row = st + j * ld + i0;
            for (int g = 0; g < ng; g++) {
                __m256 e = exp2_8z(_mm256_fmsub_ps(_mm256_loadu_ps(row + 8 * g), vs2, base2[g]));
                if (j > jfull) e = _mm256_and_ps(e, keep8(i0 + 8 * g, j, diag));
                _mm256_storeu_ps(row + 8 * g, e);
                sum[g] = _mm256_add_ps(sum[g], e);
            }
        }
        for (int g = 0; g < ng; g++) {
            float *mg = m + i0 + 8 * g, *lg = l + i0 + 8 * g;
            __m256 a = exp2_8z(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(mg), log2e), base2[g]));
            _mm256_storeu_ps(alpha + i0 + 8 * g, a);
            _mm256_storeu_ps(lg, _mm256_fmadd_ps(_mm256_loadu_ps(lg), a, sum[g]));
            _mm256_storeu_ps(mg, mx[g]);
        }
        if (ng < 8) {
            i0 += 8 * ng;
            break;
        }
    }
    if (i0 < bq)
        attention_kernels_ref.softmax_cols(st + i0, ld, bk, bq - i0, scale, m + i0, l + i0, alpha + i0, diag + i0);
}

static inline int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : v > hi ? hi : v; }

static void probs_avx2(float *scores, int64_t ld, int64_t bq, int64_t bk, float scale, const float *lse, int64_t diag) {
    const __m256 vs2 = _mm256_set1_ps(scale * LOG2E);
    for (int64_t i = 0; i < bq; i++) {
        float *row = scores + i * ld;
        const int64_t keys = lse[i] == -INFINITY ? 0 : clamp64(i + diag + 1, 0, bk); /* the rest are 0 */
        const __m256 vl = _mm256_set1_ps(lse[i] * LOG2E);
        int64_t j = 0;
        for (; j + 8 <= keys; j += 8)
            _mm256_storeu_ps(row + j, exp2_8z(_mm256_fmsub_ps(_mm256_loadu_ps(row + j), vs2, vl)));
        if (j < bk) attention_kernels_ref.probs(row + j, ld, 1, bk - j, scale, lse + i, i + diag - j);
    }
}

static void dscores_avx2(float *dp, const float *p, int64_t ld, int64_t bq, int64_t bk, const float *delta,
                         float scale) {
    const __m256 vs = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < bq; i++) {
        float *d = dp + i * ld;
        const float *pr = p + i * ld;
        const __m256 vd = _mm256_set1_ps(delta[i]);
        int64_t j = 0;
        for (; j + 8 <= bk; j += 8) {
            __m256 g = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(d + j), vd), vs);
            _mm256_storeu_ps(d + j, _mm256_mul_ps(_mm256_loadu_ps(pr + j), g));
        }
        if (j < bk) attention_kernels_ref.dscores(d + j, pr + j, ld, 1, bk - j, delta + i, scale);
    }
}

/* whole 8 x 8 blocks in registers (unpack, shuffle, then swap the 128-bit halves), the edges element by element */
static void transpose_avx2(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols) {
    const int64_t r8 = rows / 8 * 8, c8 = cols / 8 * 8;
    for (int64_t r0 = 0; r0 < r8; r0 += 8)
        for (int64_t c0 = 0; c0 < c8; c0 += 8) {
            __m256 x[8], t[8];
            for (int i = 0; i < 8; i++) x[i] = _mm256_loadu_ps(src + (r0 + i) * lds + c0);
            for (int i = 0; i < 4; i++) {
                t[2 * i] = _mm256_unpacklo_ps(x[2 * i], x[2 * i + 1]);
                t[2 * i + 1] = _mm256_unpackhi_ps(x[2 * i], x[2 * i + 1]);
            }
            for (int i = 0; i < 2; i++) { /* x[4i + j]: column j (low half) and 4 + j (high half) of rows 4i.. */
                x[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
                x[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
                x[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
                x[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
            }
            for (int j = 0; j < 4; j++) {
                _mm256_storeu_ps(dst + (c0 + j) * ldd + r0, _mm256_permute2f128_ps(x[j], x[4 + j], 0x20));
                _mm256_storeu_ps(dst + (c0 + 4 + j) * ldd + r0, _mm256_permute2f128_ps(x[j], x[4 + j], 0x31));
            }
        }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = r < r8 ? c8 : 0; c < cols; c++) dst[c * ldd + r] = src[r * lds + c];
}

static void scale_rows_avx2(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols,
                            const float *f) {
    for (int64_t r = 0; r < rows; r++) {
        const __m256 vf = _mm256_set1_ps(f[r]);
        float *d = dst + r * ldd;
        const float *s = src + r * lds;
        int64_t c = 0;
        for (; c + 8 <= cols; c += 8) _mm256_storeu_ps(d + c, _mm256_mul_ps(_mm256_loadu_ps(s + c), vf));
        for (; c < cols; c++) d[c] = s[c] * f[r];
    }
}

const attention_kernels attention_kernels_avx2 = {.name = "avx2",
                                                  .isa = OPF_ISA_AVX2,
                                                  .cvt = &convert_kernels_avx2,
                                                  .mm = mm_avx2,
                                                  .softmax_cols = softmax_cols_avx2,
                                                  .probs = probs_avx2,
                                                  .dscores = dscores_avx2,
                                                  .transpose = transpose_avx2,
                                                  .scale_rows = scale_rows_avx2};
