/*
 * Attention kernels, AVX-512 (F, BW, VL, DQ): the 16-lane twins of
 * attention_avx2.c. The block matmul keeps up to 12 x 32 floats of C in 24
 * zmm accumulators (A broadcast from any strides, two B vectors per step);
 * the column-wise online softmax takes 16 queries per vector, and every tail
 * (columns of C, queries of a column group, keys of a row) is a lane mask,
 * never a scalar loop. exp is exp2_16z (math_avx512.h).
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attention.h"
#include "attention_avx512.h"
#include "math_avx512.h"
#include "rows_avx512.h"

/* the lanes at or above `from` (0 <= from), as a mask: none when from >= 16 */
static inline __mmask16 lanes_from(int64_t from) { return from >= 16 ? 0 : (__mmask16)(0xffffu << from); }

/* C[0..mr) x [0..16*nv) (+)= the accumulators, lanes outside m0 / m1 left alone */
static inline __attribute__((always_inline)) void store_tile(const int mr, const int nv, __m512 *c0, __m512 *c1,
                                                             float *c, int64_t ldc, int acc, __mmask16 m0,
                                                             __mmask16 m1) {
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
        float *cr = c + r * ldc;
        if (acc) c0[r] = _mm512_add_ps(c0[r], _mm512_maskz_loadu_ps(m0, cr));
        _mm512_mask_storeu_ps(cr, m0, c0[r]);
        if (nv == 2) {
            if (acc) c1[r] = _mm512_add_ps(c1[r], _mm512_maskz_loadu_ps(m1, cr + 16));
            _mm512_mask_storeu_ps(cr + 16, m1, c1[r]);
        }
    }
}

/* C[0..mr) x [0..16*nv) (+)= A B, lanes outside m0 / m1 neither read nor written; mr and nv constants at each call */
static inline __attribute__((always_inline)) void tile(const int mr, const int nv, int64_t k, const float *a,
                                                       int64_t rsa, int64_t csa, const float *b, int64_t ldb, float *c,
                                                       int64_t ldc, int acc, __mmask16 m0, __mmask16 m1) {
    __m512 c0[12], c1[12];
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) c0[r] = c1[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k; p++, a += csa, b += ldb) {
        const __m512 b0 = _mm512_maskz_loadu_ps(m0, b);
        const __m512 b1 = nv == 2 ? _mm512_maskz_loadu_ps(m1, b + 16) : b0;
#pragma GCC unroll 12
        for (int r = 0; r < mr; r++) {
            const __m512 av = _mm512_set1_ps(a[r * rsa]);
            c0[r] = _mm512_fmadd_ps(av, b0, c0[r]);
            if (nv == 2) c1[r] = _mm512_fmadd_ps(av, b1, c1[r]);
        }
    }
    store_tile(mr, nv, c0, c1, c, ldc, acc, m0, m1);
}

#define ROWS(NV)                                                                      \
    for (int64_t i = 0; i < m; i += 12) {                                             \
        const float *ai = a + i * rsa;                                                \
        float *ci = c + i * ldc + j;                                                  \
        switch (m - i < 12 ? m - i : 12) {                                            \
        case 12: tile(12, NV, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break; \
        case 11: tile(11, NV, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break; \
        case 10: tile(10, NV, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break; \
        case 9: tile(9, NV, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;   \
        case 8: tile(8, NV, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;   \
        case 7: tile(7, NV, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;   \
        case 6: tile(6, NV, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;   \
        case 5: tile(5, NV, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;   \
        case 4: tile(4, NV, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;   \
        case 3: tile(3, NV, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;   \
        case 2: tile(2, NV, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;   \
        default: tile(1, NV, k, ai, rsa, csa, bj, ldb, ci, ldc, acc, m0, m1); break;  \
        }                                                                             \
    }

void attention_mm_avx512(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                         int64_t ldb, float *c, int64_t ldc, int acc) {
    for (int64_t j = 0; j < n; j += 32) { /* one 32-column sliver of B stays in L1 across the rows */
        const int64_t nb = n - j < 32 ? n - j : 32;
        const float *bj = b + j;
        const __mmask16 m0 = tail16(nb), m1 = tail16(nb - 16);
        if (nb > 16) {
            ROWS(2)
        } else {
            ROWS(1)
        }
    }
}

/* ---- the same product on bfloat16 pairs (AVX512-BF16), for bfloat16 inputs ---------------------------- */

/* vdpbf16ps takes a K pair of bfloat16 in each 32-bit lane: A's pairs are
 * packed as ap[p2 * MC + r] (row r, pair p2), B's as bp[p2 * 32 + j] (32
 * columns of a sliver, zeros past n and past an odd k), both per chunk of
 * KC2 pairs, on the stack (48 KiB). Rounding is to nearest even: exact for
 * operands that came from bfloat16 (Q, K, V, dO), one rounding for P and dS. */
enum { KC2 = ATTENTION_PACK_KP, MC = ATTENTION_PACK_MC };

#ifndef OPF_EMULATE_AVX512
#define TARGET_BF16 __attribute__((target("avx512bf16")))
#else
#define TARGET_BF16 /* tests/emu: the instruction is emulated */
#endif

/* the pairs (r0[j], r1[j]) of 16 columns, r1 NULL for zeros; lanes outside m are zero */
static inline __m512i pairs16(const float *r0, const float *r1, __mmask16 m) {
    const __m512i lo = bf16_lanes(_mm512_maskz_loadu_ps(m, r0));
    const __m512i hi = r1 ? bf16_lanes(_mm512_maskz_loadu_ps(m, r1)) : _mm512_setzero_si512();
    return _mm512_maskz_mov_epi32(m, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
}

static inline uint32_t pair1(float x0, float x1) {
    return (uint32_t)opf_f32_to_bf16(x0) | (uint32_t)opf_f32_to_bf16(x1) << 16;
}

/* A (rows x k) into pairs along its rows (row r's pair q at ap[r * KC2 + q], 16 pairs a vector) or along
 * its columns (at ap[q * MC + r], 16 rows a vector, from A(r, p) = a[r + p * cs]): attention_bf16_packing's */
static void a_rows32(uint32_t *ap, const float *a, int64_t rs, int64_t rows, int64_t k) {
    const int64_t kp = (k + 1) / 2;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t q = 0; q < kp; q += 16)
            _mm512_mask_storeu_epi32(ap + r * KC2 + q, tail16(kp - q), pairs_of32(a + r * rs + 2 * q, k - 2 * q));
}

static void a_cols32(uint32_t *ap, const float *a, int64_t cs, int64_t rows, int64_t k) {
    for (int64_t q = 0; q < (k + 1) / 2; q++) {
        const float *a0 = a + 2 * q * cs, *a1 = 2 * q + 1 < k ? a0 + cs : NULL;
        for (int64_t r = 0; r < rows; r += 16) {
            const __mmask16 m = tail16(rows - r);
            _mm512_mask_storeu_epi32(ap + q * MC + r, m, pairs16(a0 + r, a1 ? a1 + r : NULL, m));
        }
    }
}

/* A(r, p) = a[r*rsa + p*csa] for r < mc, p < kc, as pairs, in one of two layouts: row r's pair p2 at
 * ap[r * KC2 + p2] (*ars = KC2) or at ap[p2 * MC + r] (*ars = 1). Rows along K (csa = 1: the K, Q, dO and
 * dS rows) take the first, 16 pairs a vector; columns along K (rsa = 1: P^T, dS^T) the second, 16 rows a
 * vector; any other strides the second, element by element. */
static void pack_a(uint32_t *ap, const float *a, int64_t rsa, int64_t csa, int64_t mc, int64_t kc, int64_t *ars) {
    if (csa == 1 && rsa != 1) {
        *ars = KC2;
        a_rows32(ap, a, rsa, mc, kc);
        return;
    }
    *ars = 1;
    if (rsa == 1) {
        a_cols32(ap, a, csa, mc, kc);
        return;
    }
    for (int64_t p2 = 0; p2 < (kc + 1) / 2; p2++) {
        const float *a0 = a + 2 * p2 * csa, *a1 = 2 * p2 + 1 < kc ? a0 + csa : NULL;
        for (int64_t r = 0; r < mc; r++) ap[p2 * MC + r] = pair1(a0[r * rsa], a1 ? a1[r * rsa] : 0.0f);
    }
}

/* B(p, j) = b[p*ldb + j] for p < kc, j < nb (<= 32), into bp[p2 * 32 + j], zeros past nb */
void attention_pack_b_bf16(uint32_t *bp, const float *b, int64_t ldb, int64_t kc, int64_t nb) {
    const __mmask16 m0 = tail16(nb), m1 = tail16(nb - 16);
    for (int64_t p2 = 0; p2 < (kc + 1) / 2; p2++) {
        const float *b0 = b + 2 * p2 * ldb, *b1 = 2 * p2 + 1 < kc ? b0 + ldb : NULL;
        _mm512_storeu_si512(bp + p2 * 32, pairs16(b0, b1, m0));
        _mm512_storeu_si512(bp + p2 * 32 + 16, pairs16(b0 + 16, b1 ? b1 + 16 : NULL, m1));
    }
}

static inline __attribute__((always_inline)) TARGET_BF16 void tile_bf16(const int mr, const int nv, int64_t kp,
                                                                        const int rows_along_k, const uint32_t *ap,
                                                                        const uint32_t *bp, float *c, int64_t ldc,
                                                                        int acc, __mmask16 m0, __mmask16 m1) {
    const int64_t ars = rows_along_k ? KC2 : 1, aps = rows_along_k ? 1 : MC; /* constants: immediate offsets */
    __m512 c0[12], c1[12];
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) c0[r] = c1[r] = _mm512_setzero_ps();
    for (int64_t p2 = 0; p2 < kp; p2++, ap += aps, bp += 32) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp), b1 = (__m512bh)_mm512_loadu_si512(bp + 16);
#pragma GCC unroll 12
        for (int r = 0; r < mr; r++) {
            const __m512bh av = (__m512bh)_mm512_set1_epi32((int)ap[r * ars]);
            c0[r] = _mm512_dpbf16_ps(c0[r], av, b0);
            if (nv == 2) c1[r] = _mm512_dpbf16_ps(c1[r], av, b1);
        }
    }
    store_tile(mr, nv, c0, c1, c, ldc, acc, m0, m1);
}

#define ROWS_BF16(NV, RK)                                                          \
    for (int64_t i = 0; i < mc; i += 12) {                                         \
        const uint32_t *ai = ap + i * (RK ? KC2 : 1);                              \
        float *ci = c + (i0 + i) * ldc + j;                                        \
        switch (mc - i < 12 ? mc - i : 12) {                                       \
        case 12: tile_bf16(12, NV, kp, RK, ai, bp, ci, ldc, accum, m0, m1); break; \
        case 11: tile_bf16(11, NV, kp, RK, ai, bp, ci, ldc, accum, m0, m1); break; \
        case 10: tile_bf16(10, NV, kp, RK, ai, bp, ci, ldc, accum, m0, m1); break; \
        case 9: tile_bf16(9, NV, kp, RK, ai, bp, ci, ldc, accum, m0, m1); break;   \
        case 8: tile_bf16(8, NV, kp, RK, ai, bp, ci, ldc, accum, m0, m1); break;   \
        case 7: tile_bf16(7, NV, kp, RK, ai, bp, ci, ldc, accum, m0, m1); break;   \
        case 6: tile_bf16(6, NV, kp, RK, ai, bp, ci, ldc, accum, m0, m1); break;   \
        case 5: tile_bf16(5, NV, kp, RK, ai, bp, ci, ldc, accum, m0, m1); break;   \
        case 4: tile_bf16(4, NV, kp, RK, ai, bp, ci, ldc, accum, m0, m1); break;   \
        case 3: tile_bf16(3, NV, kp, RK, ai, bp, ci, ldc, accum, m0, m1); break;   \
        case 2: tile_bf16(2, NV, kp, RK, ai, bp, ci, ldc, accum, m0, m1); break;   \
        default: tile_bf16(1, NV, kp, RK, ai, bp, ci, ldc, accum, m0, m1); break;  \
        }                                                                          \
    }

TARGET_BF16 static void mm_avx512bf16(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa,
                                      const float *b, int64_t ldb, float *c, int64_t ldc, int acc) {
    _Alignas(64) uint32_t ap[KC2 * MC], bp[KC2 * 32];
    if (k == 0) { /* no chunk to run: C = 0 (+ C) */
        attention_mm_avx512(m, n, k, a, rsa, csa, b, ldb, c, ldc, acc);
        return;
    }
    for (int64_t k0 = 0; k0 < k; k0 += 2 * KC2) {
        const int64_t kc = k - k0 < 2 * KC2 ? k - k0 : 2 * KC2, kp = (kc + 1) / 2;
        const int accum = acc || k0 > 0;
        for (int64_t i0 = 0; i0 < m; i0 += MC) {
            const int64_t mc = m - i0 < MC ? m - i0 : MC;
            int64_t ars;
            pack_a(ap, a + i0 * rsa + k0 * csa, rsa, csa, mc, kc, &ars);
            for (int64_t j = 0; j < n; j += 32) {
                const int64_t nb = n - j < 32 ? n - j : 32;
                const __mmask16 m0 = tail16(nb), m1 = tail16(nb - 16);
                attention_pack_b_bf16(bp, b + k0 * ldb + j, ldb, kc, nb);
                if (nb > 16 && ars != 1) {
                    ROWS_BF16(2, 1)
                } else if (nb > 16) {
                    ROWS_BF16(2, 0)
                } else if (ars != 1) {
                    ROWS_BF16(1, 1)
                } else {
                    ROWS_BF16(1, 0)
                }
            }
        }
    }
}


/* ---- the same products on operands packed once (attention_bf16_packing in attention.h) ---------------- */

static void a_rows16(uint32_t *ap, const uint16_t *a, int64_t rs, int64_t rows, int64_t k) {
    for (int64_t r = 0; r < rows; r++) { /* a row's pairs are its own 16-bit elements, two to a word */
        const uint16_t *ar = a + r * rs;
        uint32_t *dst = ap + r * KC2;
        memcpy(dst, ar, (size_t)(k / 2) * sizeof *dst);
        if (k % 2) dst[k / 2] = ar[k - 1];
    }
}

static void b16(uint32_t *bp, const uint16_t *b, int64_t rs, int64_t k, int64_t n) {
    b16_slivers(bp, b, rs, k, n, (k + 1) / 2);
}

static void bt16(uint32_t *bp, const uint16_t *b, int64_t rs, int64_t k, int64_t n) {
    const int64_t kp = (k + 1) / 2;
    for (int64_t j = 0; j < n; j += 32) {
        uint32_t *sliver = bp + j / 32 * kp * 32;
        for (int64_t c = 0; c < 32; c++) { /* column c of the sliver is row j + c of b, its words in order */
            if (j + c >= n) {
                for (int64_t q = 0; q < kp; q++) sliver[q * 32 + c] = 0;
                continue;
            }
            const uint16_t *row = b + (j + c) * rs;
            for (int64_t q = 0; q < k / 2; q++)
                sliver[q * 32 + c] = (uint32_t)row[2 * q] | (uint32_t)row[2 * q + 1] << 16;
            if (k % 2) sliver[k / 2 * 32 + c] = row[k - 1];
        }
    }
}

TARGET_BF16 static void mm_packed(int64_t m, int64_t n, int64_t k, const uint32_t *ap, int a_rows,
                                  const uint32_t *packed_b, float *c, int64_t ldc, int acc) {
    const int64_t kp = (k + 1) / 2, mc = m, i0 = 0;
    const int accum = acc;
    if (kp == 0) {
        for (int64_t i = 0; i < m && !acc; i++) memset(c + i * ldc, 0, (size_t)n * sizeof *c);
        return;
    }
    for (int64_t j = 0; j < n; j += 32) {
        const int64_t nb = n - j < 32 ? n - j : 32;
        const __mmask16 m0 = tail16(nb), m1 = tail16(nb - 16);
        const uint32_t *bp = packed_b + j / 32 * kp * 32;
        if (nb > 16 && a_rows) {
            ROWS_BF16(2, 1)
        } else if (nb > 16) {
            ROWS_BF16(2, 0)
        } else if (a_rows) {
            ROWS_BF16(1, 1)
        } else {
            ROWS_BF16(1, 0)
        }
    }
}

static const attention_bf16_packing packing_avx512bf16 = {
    .a_rows16 = a_rows16, .a_rows32 = a_rows32, .a_cols32 = a_cols32, .b16 = b16, .bt16 = bt16, .mm = mm_packed};

/* The keep-mask of key row j for the 16 queries starting at i (query i keeps key j when j <= i + diag) */
static inline __mmask16 keep16(int64_t i, int64_t j, int64_t diag) {
    return lanes_from(j - diag - i < 0 ? 0 : j - diag - i);
}

/* Columns in groups of 16 queries, up to 4 groups at a time, walked row by row
 * (consecutive addresses, as the AVX2 kernel); the last group's missing
 * queries are masked lanes. */
void attention_softmax_cols_avx512(float *st, int64_t ld, int64_t bk, int64_t bq, float scale, float *m, float *l,
                                   float *alpha, int64_t diag) {
    const __m512 vs = _mm512_set1_ps(scale), vs2 = _mm512_set1_ps(scale * LOG2E), log2e = _mm512_set1_ps(LOG2E);
    const __m512 ninf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps();
    for (int64_t i0 = 0; i0 < bq; i0 += 64) {
        const int ng = (int)((bq - i0 + 15) / 16 < 4 ? (bq - i0 + 15) / 16 : 4);
        const int64_t jfull = i0 + diag; /* rows j <= jfull keep every query of the chunk */
        __mmask16 lanes[4];
        __m512 mx[4], base2[4], sum[4];
        for (int g = 0; g < ng; g++) {
            lanes[g] = tail16(bq - i0 - 16 * g);
            mx[g] = _mm512_mask_loadu_ps(ninf, lanes[g], m + i0 + 16 * g);
            sum[g] = zero;
        }
        for (int64_t j = 0; j < bk; j++) {
            const float *row = st + j * ld + i0;
            for (int g = 0; g < ng; g++) {
                const __mmask16 keep = j <= jfull ? lanes[g] : lanes[g] & keep16(i0 + 16 * g, j, diag);
                mx[g] = _mm512_mask_max_ps(mx[g], keep, mx[g],
                                           _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, row + 16 * g), vs));
            }
        }
        for (int g = 0; g < ng; g++) /* a column with no key yet: base 0, so that exp(-inf - 0) = 0 */
            base2[g] = _mm512_mul_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mx[g], ninf, _CMP_NEQ_UQ), mx[g]), log2e);
        for (int64_t j = 0; j < bk; j++) { /* exp(x scale - base) = 2^(x scale log2e - base log2e) */
            float *row = st + j * ld + i0;
            for (int g = 0; g < ng; g++) {
                const __mmask16 keep = j <= jfull ? lanes[g] : lanes[g] & keep16(i0 + 16 * g, j, diag);
                __m512 e = exp2_16z(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(lanes[g], row + 16 * g), vs2, base2[g]));
                e = _mm512_maskz_mov_ps(keep, e);
                _mm512_mask_storeu_ps(row + 16 * g, lanes[g], e);
                sum[g] = _mm512_add_ps(sum[g], e);
            }
        }
        for (int g = 0; g < ng; g++) {
            float *mg = m + i0 + 16 * g, *lg = l + i0 + 16 * g;
            const __m512 a =
                exp2_16z(_mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes[g], mg), log2e), base2[g]));
            _mm512_mask_storeu_ps(alpha + i0 + 16 * g, lanes[g], a);
            _mm512_mask_storeu_ps(lg, lanes[g], _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes[g], lg), a, sum[g]));
            _mm512_mask_storeu_ps(mg, lanes[g], mx[g]);
        }
    }
}

static inline int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : v > hi ? hi : v; }

void attention_probs_avx512(float *scores, int64_t ld, int64_t bq, int64_t bk, float scale, const float *lse,
                            int64_t diag) {
    const __m512 vs2 = _mm512_set1_ps(scale * LOG2E);
    for (int64_t i = 0; i < bq; i++) {
        float *row = scores + i * ld;
        const int64_t keys = lse[i] == -INFINITY ? 0 : clamp64(i + diag + 1, 0, bk); /* the rest are 0 */
        const __m512 vl = _mm512_set1_ps(lse[i] * LOG2E);
        for (int64_t j = 0; j < bk; j += 16) {
            const __mmask16 valid = tail16(bk - j), keep = tail16(keys - j);
            const __m512 e = exp2_16z(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(keep, row + j), vs2, vl));
            _mm512_mask_storeu_ps(row + j, valid, _mm512_maskz_mov_ps(keep, e));
        }
    }
}

void attention_dscores_avx512(float *dp, const float *p, int64_t ld, int64_t bq, int64_t bk, const float *delta,
                              float scale) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < bq; i++) {
        float *d = dp + i * ld;
        const float *pr = p + i * ld;
        const __m512 vd = _mm512_set1_ps(delta[i]);
        for (int64_t j = 0; j < bk; j += 16) {
            const __mmask16 valid = tail16(bk - j);
            const __m512 g = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, d + j), vd), vs);
            _mm512_mask_storeu_ps(d + j, valid, _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, pr + j), g));
        }
    }
}

/* 16 x 16 blocks in registers (unpack, shuffle within 128-bit lanes, then two rounds of lane shuffles), the
 * edges of a block masked */
void attention_transpose_avx512(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols) {
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
        const __mmask16 mr = tail16(nr);
        for (int64_t c0 = 0; c0 < cols; c0 += 16) {
            const int64_t nc = cols - c0 < 16 ? cols - c0 : 16;
            const __mmask16 mc = tail16(nc);
            __m512 x[16], t[16];
            for (int i = 0; i < 16; i++)
                x[i] = i < nr ? _mm512_maskz_loadu_ps(mc, src + (r0 + i) * lds + c0) : _mm512_setzero_ps();
            for (int i = 0; i < 8; i++) {
                t[2 * i] = _mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]);
                t[2 * i + 1] = _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]);
            }
            for (int i = 0; i < 4; i++) { /* x[4i + j], lane L: column 4L + j of rows 4i .. 4i + 3 */
                x[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
                x[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
                x[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
                x[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
            }
            for (int j = 0; j < 4; j++) { /* column 4L + j: lane L of x[j], x[4 + j], x[8 + j], x[12 + j] */
                const __m512 a = _mm512_shuffle_f32x4(x[j], x[4 + j], 0x88),
                             b = _mm512_shuffle_f32x4(x[j], x[4 + j], 0xdd);
                const __m512 c = _mm512_shuffle_f32x4(x[8 + j], x[12 + j], 0x88),
                             d = _mm512_shuffle_f32x4(x[8 + j], x[12 + j], 0xdd);
                t[j] = _mm512_shuffle_f32x4(a, c, 0x88);
                t[8 + j] = _mm512_shuffle_f32x4(a, c, 0xdd);
                t[4 + j] = _mm512_shuffle_f32x4(b, d, 0x88);
                t[12 + j] = _mm512_shuffle_f32x4(b, d, 0xdd);
            }
            for (int64_t j = 0; j < nc; j++) _mm512_mask_storeu_ps(dst + (c0 + j) * ldd + r0, mr, t[j]);
        }
    }
}

void attention_scale_rows_avx512(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols,
                                 const float *f) {
    for (int64_t r = 0; r < rows; r++) {
        const __m512 vf = _mm512_set1_ps(f[r]);
        for (int64_t c = 0; c < cols; c += 16) {
            const __mmask16 m = tail16(cols - c);
            _mm512_mask_storeu_ps(dst + r * ldd + c, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, src + r * lds + c), vf));
        }
    }
}

/* fwd_bk_plain = 256 (the AMX table's too): float32 forwards in key blocks of 256, measured on the Xeon
 * with AMX (2 threads, no mask, D 64-128, N 256-4096, alternating in one process, two runs): against blocks
 * of 64 1.03-1.17x on most shapes, against 128 0.97-1.08x; one run had N = 2048 at 0.95x / 0.97x. On the
 * AVX2 table (the same machine) the three were within 2%. */
const attention_kernels attention_kernels_avx512 = {.name = "avx512",
                                                    .isa = OPF_ISA_AVX512,
                                                    .cvt = &convert_kernels_avx512,
                                                    .mm = attention_mm_avx512,
                                                    .softmax_cols = attention_softmax_cols_avx512,
                                                    .probs = attention_probs_avx512,
                                                    .fwd_bk_plain = 256,
                                                    .dscores = attention_dscores_avx512,
                                                    .transpose = attention_transpose_avx512,
                                                    .scale_rows = attention_scale_rows_avx512};

/* bfloat16 inputs multiply on bfloat16 pairs; float32 ones keep the float32 product */
const attention_kernels attention_kernels_avx512_bf16 = {.name = "avx512_bf16",
                                                         .isa = OPF_ISA_AVX512_BF16,
                                                         .cvt = &convert_kernels_avx512,
                                                         .mm = attention_mm_avx512,
                                                         .mm_bf16 = mm_avx512bf16,
                                                         .packing = &packing_avx512bf16,
                                                         .softmax_cols = attention_softmax_cols_avx512,
                                                         .probs = attention_probs_avx512,
                                                         .fwd_bk_plain = 256,
                                                         .dscores = attention_dscores_avx512,
                                                         .transpose = attention_transpose_avx512,
                                                         .scale_rows = attention_scale_rows_avx512};
