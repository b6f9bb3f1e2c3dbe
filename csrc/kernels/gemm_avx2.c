/*
 * GEMM micro-kernel, AVX2 + FMA: 6 x 16 floats of C in 12 ymm accumulators,
 * one broadcast of A and two loads of B per k (15 of 16 registers). Full tiles
 * run the epilogue (beta, bias, pre-activation store, activation) in
 * registers; partial tiles go through the scalar epilogue.
 *
 * Blocks (Zen 3 / Skylake-class): a B sliver KC x 16 = 16 KiB stays in L1,
 * an A block MC x KC = 120 KiB in L2, a B panel KC x NC = 3 MiB in L3.
 */
#include <immintrin.h>

#include "gemm.h"
#include "half_avx2.h"
#include "act_avx2.h"

static inline void st16(uint16_t *p, __m256 v, opf_dtype dt) {
    if (dt == OPF_BF16)
        st_bf16(p, v);
    else
        st_f16(p, v);
}

/* 8 columns of one row: c / pre are float32 (NULL when unused), c16 / pre16 16-bit */
static inline void store8(float *c, float *pre, uint16_t *c16, uint16_t *pre16, __m256 v, const gemm_tile *t,
                          const float *bias_n, float bias_m) {
    if (t->alpha) v = _mm256_mul_ps(v, _mm256_set1_ps(*t->alpha));
    if (t->load_c) v = _mm256_fmadd_ps(_mm256_set1_ps(t->beta), _mm256_loadu_ps(c), v);
    if (bias_n) v = _mm256_add_ps(v, _mm256_loadu_ps(bias_n));
    if (t->bias_m) v = _mm256_add_ps(v, _mm256_set1_ps(bias_m));
    if (pre) _mm256_storeu_ps(pre, v);
    if (pre16) st16(pre16, v, t->dt16);
    if (c16)
        st16(c16, act8(t->act, v), t->dt16);
    else
        _mm256_storeu_ps(c, act8(t->act, v));
}

#define MR 6
#define NR 16

/* the epilogue of a tile from its accumulators: in registers for a tile of full rows (any number of them:
 * a product's last rows, a skinny product's few), through the scalar epilogue for one with partial rows */
static inline void finish_tile(__m256 acc[MR][2], float *c, int64_t rsc, int m, int n, const gemm_tile *t) {
    if (n == NR) {
        for (int i = 0; i < m; i++) {
            float *ci = t->c16 && !t->load_c ? NULL : c + i * rsc, *pre = t->pre ? t->pre + i * t->rsp : NULL;
            uint16_t *c16 = t->c16 ? t->c16 + i * rsc : NULL, *pre16 = t->pre16 ? t->pre16 + i * t->rsp : NULL;
            float bm = t->bias_m ? t->bias_m[i] : 0.0f;
            store8(ci, pre, c16, pre16, acc[i][0], t, t->bias_n, bm);
            store8(ci ? ci + 8 : NULL, pre ? pre + 8 : NULL, c16 ? c16 + 8 : NULL, pre16 ? pre16 + 8 : NULL, acc[i][1],
                   t, t->bias_n ? t->bias_n + 8 : NULL, bm);
        }
        return;
    }
    float buf[MR * NR];
    for (int i = 0; i < MR; i++) {
        _mm256_storeu_ps(buf + i * NR, acc[i][0]);
        _mm256_storeu_ps(buf + i * NR + 8, acc[i][1]);
    }
    gemm_tile_store(buf, NR, c, rsc, m, n, t);
}

static void ukernel_avx2_6x16(int64_t depth, const float *ap, const float *bp, float *c, int64_t rsc, int m, int n,
                              const gemm_tile *t) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int i = 0; i < m; i++) { /* the tile is read or written after the loop: start fetching it now */
        if (t->c16) _mm_prefetch((const char *)(t->c16 + i * rsc), _MM_HINT_T0);
        if (t->c16 && !t->load_c) continue;
        _mm_prefetch((const char *)(c + i * rsc), _MM_HINT_T0);
        _mm_prefetch((const char *)(c + i * rsc + 15), _MM_HINT_T0);
    }
    for (int64_t p = 0; p < depth; p++, ap += MR, bp += NR) {
        __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8), a;
        a = _mm256_broadcast_ss(ap + 0);
        c00 = _mm256_fmadd_ps(a, b0, c00);
        c01 = _mm256_fmadd_ps(a, b1, c01);
        a = _mm256_broadcast_ss(ap + 1);
        c10 = _mm256_fmadd_ps(a, b0, c10);
        c11 = _mm256_fmadd_ps(a, b1, c11);
        a = _mm256_broadcast_ss(ap + 2);
        c20 = _mm256_fmadd_ps(a, b0, c20);
        c21 = _mm256_fmadd_ps(a, b1, c21);
        a = _mm256_broadcast_ss(ap + 3);
        c30 = _mm256_fmadd_ps(a, b0, c30);
        c31 = _mm256_fmadd_ps(a, b1, c31);
        a = _mm256_broadcast_ss(ap + 4);
        c40 = _mm256_fmadd_ps(a, b0, c40);
        c41 = _mm256_fmadd_ps(a, b1, c41);
        a = _mm256_broadcast_ss(ap + 5);
        c50 = _mm256_fmadd_ps(a, b0, c50);
        c51 = _mm256_fmadd_ps(a, b1, c51);
    }
    __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    finish_tile(acc, c, rsc, m, n, t);
}

/* the epilogue alone, from an accumulator in memory (gemm_finish) */
static void store_avx2(const float *buf, float *c, int64_t rsc, int m, int n, const gemm_tile *t) {
    if (n != NR) {
        gemm_tile_store(buf, NR, c, rsc, m, n, t);
        return;
    }
    __m256 acc[MR][2];
    for (int i = 0; i < MR; i++) { /* rows past m: not read (gemm_finish fills only the tile's rows) */
        acc[i][0] = i < m ? _mm256_loadu_ps(buf + i * NR) : _mm256_setzero_ps();
        acc[i][1] = i < m ? _mm256_loadu_ps(buf + i * NR + 8) : _mm256_setzero_ps();
    }
    finish_tile(acc, c, rsc, m, n, t);
}

/* ---- the skinny product (gemm_skinny_fn): R rows of A x 2 columns of B as 2R dot products ---------------- */

/* 8 elements of a B row from element off (bfloat16 widened exactly) */
static inline __attribute__((always_inline)) __m256 skinny_b(const void *b, const int b16, int64_t off) {
    return b16 ? ld_bf16((const uint16_t *)b + off) : _mm256_loadu_ps((const float *)b + off);
}

static inline __attribute__((always_inline)) float skinny_b1(const void *b, const int b16, int64_t off) {
    return b16 ? opf_bf16_to_f32(((const uint16_t *)b)[off]) : ((const float *)b)[off];
}

/* rows 0..R-1 of a (R <= 4) by columns j, j+1 (cn of them real: the other repeats column j, computed and
 * not stored); 8 lanes per step, then the K tail one element at a time, each sum in one fixed order; R and
 * b16 are constants of each instantiation */
static inline __attribute__((always_inline)) void skinny_block(const int R, const int b16, int64_t k, const float *a,
                                                               const void *b, int64_t ldb, int64_t j, int cn,
                                                               float *out, int64_t ldo) {
    const int64_t o[2] = {j * ldb, (cn > 1 ? j + 1 : j) * ldb}, kv = k & ~(int64_t)7;
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < kv; kk += 8) {
        const __m256 b0 = skinny_b(b, b16, o[0] + kk), b1 = skinny_b(b, b16, o[1] + kk);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256 av = _mm256_loadu_ps(a + r * k + kk);
            acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        for (int q = 0; q < cn; q++) {
            float sum = hsum8(acc[r][q]);
            for (int64_t kk = kv; kk < k; kk++) sum += a[r * k + kk] * skinny_b1(b, b16, o[q] + kk);
            out[r * ldo + j + q] = sum;
        }
}

static inline __attribute__((always_inline)) void skinny_rows(const int b16, int64_t m, int64_t k, const float *a,
                                                              const void *b, int64_t ldb, int64_t j0, int64_t j1,
                                                              float *out, int64_t ldo) {
#define ROW(i) (a + (i)*k)
#define BLOCK(R, ai, oi) skinny_block(R, b16, k, ai, b, ldb, j, cn, oi, ldo)
    GEMM_SKINNY_ROWS(2, BLOCK, ROW)
#undef ROW
#undef BLOCK
}

static void skinny_avx2(int64_t m, int64_t k, const float *a, const void *b, int b16, int64_t ldb, int64_t j0,
                        int64_t j1, float *out, int64_t ldo) {
    if (b16)
        skinny_rows(1, m, k, a, b, ldb, j0, j1, out, ldo);
    else
        skinny_rows(0, m, k, a, b, ldb, j0, j1, out, ldo);
}

const gemm_kernels gemm_kernels_avx2 = {.name = "avx2_6x16",
                                        .isa = OPF_ISA_AVX2,
                                        .mr = MR,
                                        .nr = NR,
                                        .mc = 120,
                                        .kc = 384,
                                        .nc = 3072,
                                        .ukernel = ukernel_avx2_6x16,
                                        .cvt = &convert_kernels_avx2,
                                        .act = &act_kernels_avx2,
                                        .store = store_avx2,
                                        .skinny = skinny_avx2,
                                        .skinny_name = "avx2_skinny_4x2"};
