/*
 * GEMM micro-kernel, AVX-512 (F, BW, VL, DQ): 12 x 32 floats of C in 24 zmm
 * accumulators; per k two 16-wide loads of B and 12 broadcasts of A, each
 * feeding two FMAs (27 of 32 registers). Twice the work of the AVX2 6 x 16
 * kernel per load, so the FMA pipes stay fed where AVX2 runs out of load
 * slots. Full tiles run the epilogue in registers (the activations are the
 * AVX2 ones, applied to each 8-wide half); partial tiles go through the scalar
 * epilogue.
 *
 * Blocks (Zen 4 / Ice Lake-class, 1-2 MiB L2): an A block MC x KC = 480 KiB
 * and the B sliver KC x 32 = 128 KiB it meets sit in L2 (one sliver of B is
 * 128 bytes per 24 FMAs: L2 keeps up), a B panel KC x NC = 4 MiB in L3. A
 * deep KC means C is read and written once per 1024 of K: measured against
 * KC 256-768 and MC 240 at 1024^3, 2048^3 and 4096 x 1024 x 4096, 1 and 2
 * threads, it was the best or within noise of it.
 */
#include <immintrin.h>

#include "act_avx2.h"
#include "gemm.h"
#include "gemm_avx512.h"

#define MR 12
#define NR 32

/* the epilogue of a tile from its accumulators: in registers for a tile of full rows (any number of them:
 * a product's last rows, a skinny product's few), through the scalar epilogue for one with partial rows */
static inline void finish_tile(__m512 acc[MR][2], float *c, int64_t rsc, int m, int n, const gemm_tile *t) {
    if (n == NR) {
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++)
            if (i < m) store_row32(c, rsc, i, acc[i][0], acc[i][1], t);
        return;
    }
    float buf[MR * NR];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
        _mm512_storeu_ps(buf + i * NR, acc[i][0]);
        _mm512_storeu_ps(buf + i * NR + 16, acc[i][1]);
    }
    gemm_tile_store(buf, NR, c, rsc, m, n, t);
}

/* the epilogue alone, from an accumulator in memory (gemm_finish) */
static void store_avx512(const float *buf, float *c, int64_t rsc, int m, int n, const gemm_tile *t) {
    if (n != NR) {
        gemm_tile_store(buf, NR, c, rsc, m, n, t);
        return;
    }
    __m512 acc[MR][2];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) { /* rows past m: not read (gemm_finish fills only the tile's rows) */
        acc[i][0] = i < m ? _mm512_loadu_ps(buf + i * NR) : _mm512_setzero_ps();
        acc[i][1] = i < m ? _mm512_loadu_ps(buf + i * NR + 16) : _mm512_setzero_ps();
    }
    finish_tile(acc, c, rsc, m, n, t);
}

static void ukernel_avx512_12x32(int64_t depth, const float *ap, const float *bp, float *c, int64_t rsc, int m, int n,
                                 const gemm_tile *t) {
    __m512 acc[MR][2];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    prefetch_tile(c, rsc, m, t);
    for (int64_t p = 0; p < depth; p++, ap += MR, bp += NR) {
        __m512 b0 = _mm512_loadu_ps(bp), b1 = _mm512_loadu_ps(bp + 16);
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            __m512 a = _mm512_set1_ps(ap[i]);
            acc[i][0] = _mm512_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    finish_tile(acc, c, rsc, m, n, t);
}

/* The same tile from bfloat16 pairs: per pair two 32-column loads of B and
 * 12 broadcasts of an A pair, each feeding two dot products (vdpbf16ps: 64
 * FLOP per instruction, twice an FMA's). Built for AVX512-BF16 alone; runs
 * only where the CPU has it (the avx512_bf16 ISA). */
#ifndef OPF_EMULATE_AVX512
__attribute__((target("avx512bf16")))
#endif
static void
ukernel_avx512bf16_12x32(int64_t kp, const uint32_t *ap, const uint32_t *bp, float *c, int64_t rsc, int m, int n,
                         const gemm_tile *t) {
    __m512 acc[MR][2];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    prefetch_tile(c, rsc, m, t);
    for (int64_t p = 0; p < kp; p++, ap += MR, bp += NR) {
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp), b1 = (__m512bh)_mm512_loadu_si512(bp + 16);
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)ap[i]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
        }
    }
    finish_tile(acc, c, rsc, m, n, t);
}

/* the activation gradient is the AVX2 one: the epilogue's activations are the AVX2 ones too */
/* ---- the skinny product (gemm_skinny_fn): R rows of A x 4 columns of B as 4R dot products ---------------- */

/* 16 elements of a B row from element off (bfloat16 widened exactly), lanes past the mask zero */
static inline __attribute__((always_inline)) __m512 skinny_b(const void *b, const int b16, int64_t off,
                                                             __mmask16 mask) {
    return b16 ? bf16_widen16(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)b + off))
               : _mm512_maskz_loadu_ps(mask, (const float *)b + off);
}

/* the 4 sums of x0..x3 (lane q: the sum of xq's 16 lanes), in one fixed order */
static inline __m128 reduce4(__m512 x0, __m512 x1, __m512 x2, __m512 x3) {
    const __m256 y0 = _mm256_add_ps(_mm512_castps512_ps256(x0), _mm512_extractf32x8_ps(x0, 1));
    const __m256 y1 = _mm256_add_ps(_mm512_castps512_ps256(x1), _mm512_extractf32x8_ps(x1, 1));
    const __m256 y2 = _mm256_add_ps(_mm512_castps512_ps256(x2), _mm512_extractf32x8_ps(x2, 1));
    const __m256 y3 = _mm256_add_ps(_mm512_castps512_ps256(x3), _mm512_extractf32x8_ps(x3, 1));
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(y0, y1), _mm256_hadd_ps(y2, y3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* the first cn of v's 4 lanes to dst */
static inline void store4(float *dst, int cn, __m128 v) {
    if (cn == 4) {
        _mm_storeu_ps(dst, v);
        return;
    }
    float t[4];
    _mm_storeu_ps(t, v);
    for (int q = 0; q < cn; q++) dst[q] = t[q];
}

/* The 4 x 4 block's start: B's column offsets (columns past cn repeat column j: computed, not stored) and
 * the accumulators zeroed; its end: the sums reduced and the cn real columns of R rows stored. */
#define SKINNY_BEGIN                                                                                        \
    const int64_t o[4] = {j * ldb, (cn > 1 ? j + 1 : j) * ldb, (cn > 2 ? j + 2 : j) * ldb,                  \
                          (cn > 3 ? j + 3 : j) * ldb};                                                      \
    __m512 acc[4][4];                                                                                       \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) \
        acc[r][q] = _mm512_setzero_ps();                                                                    \
    int64_t kk = 0
#define SKINNY_END                                      \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) \
        store4(out + r * ldo + j, cn, reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]))

/* the K steps from kk on (16 lanes each; mask: the last, partial one) into acc */
#define SKINNY_STEP(mask)                                                                                          \
    do {                                                                                                           \
        __m512 bv[4];                                                                                              \
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) bv[q] = skinny_b(b, B16, o[q] + kk, mask);             \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                      \
            const __m512 av = _mm512_maskz_loadu_ps(mask, a + r * k + kk);                                         \
            _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) acc[r][q] = _mm512_fmadd_ps(av, bv[q], acc[r][q]); \
        }                                                                                                          \
    } while (0)

/* rows 0..R-1 of a (R <= 4) by columns j..j+3, cn of them real; R and B16 are constants of each
 * instantiation */
static inline __attribute__((always_inline)) void skinny_block(const int R, const int B16, int64_t k, const float *a,
                                                               const void *b, int64_t ldb, int64_t j, int cn,
                                                               float *out, int64_t ldo) {
    SKINNY_BEGIN;
    for (; kk + 16 <= k; kk += 16) SKINNY_STEP((__mmask16)0xffff);
    if (kk < k) SKINNY_STEP((__mmask16)((1u << (k - kk)) - 1));
    SKINNY_END;
}

static inline __attribute__((always_inline)) void skinny_rows(const int B16, int64_t m, int64_t k, const float *a,
                                                              const void *b, int64_t ldb, int64_t j0, int64_t j1,
                                                              float *out, int64_t ldo) {
#define F32_ROW(i) (a + (i)*k)
#define F32_BLOCK(R, ai, oi) skinny_block(R, B16, k, ai, b, ldb, j, cn, oi, ldo)
    GEMM_SKINNY_ROWS(4, F32_BLOCK, F32_ROW)
#undef F32_ROW
#undef F32_BLOCK
}

void gemm_skinny_avx512(int64_t m, int64_t k, const float *a, const void *b, int b16, int64_t ldb, int64_t j0,
                        int64_t j1, float *out, int64_t ldo) {
    if (b16)
        skinny_rows(1, m, k, a, b, ldb, j0, j1, out, ldo);
    else
        skinny_rows(0, m, k, a, b, ldb, j0, j1, out, ldo);
}

/* the pair form (gemm_skinny_pairs_fn, AVX512-BF16): 32 elements of K per step, 16 pairs per vdpbf16ps; a
 * B row's last element, when k is odd, pairs with a zero (the mask) */
#define SKINNY_PAIR_STEP(mask)                                                                                      \
    do {                                                                                                            \
        __m512bh bv[4];                                                                                             \
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) bv[q] =                                                 \
            (__m512bh)_mm512_maskz_loadu_epi16(mask, b + o[q] + kk);                                                \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                       \
            const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + r * lda + kk);                         \
            _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], av, bv[q]); \
        }                                                                                                           \
    } while (0)

__attribute__((target("avx512bf16"))) static inline __attribute__((always_inline)) void
skinny_pair_block(const int R, int64_t k, const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, int64_t j,
                  int cn, float *out, int64_t ldo) {
    SKINNY_BEGIN;
    for (; kk + 32 <= k; kk += 32) SKINNY_PAIR_STEP((__mmask32)0xffffffffu);
    if (kk < k) SKINNY_PAIR_STEP((__mmask32)((1ull << (k - kk)) - 1));
    SKINNY_END;
}

__attribute__((target("avx512bf16"))) void gemm_skinny_avx512bf16(int64_t m, int64_t k, const uint16_t *a16,
                                                                  int64_t lda, const uint16_t *b, int64_t ldb,
                                                                  int64_t j0, int64_t j1, float *out, int64_t ldo) {
#define PAIR_ROW(i) (a16 + (i)*lda)
#define PAIR_BLOCK(R, ai, oi) skinny_pair_block(R, k, ai, lda, b, ldb, j, cn, oi, ldo)
    GEMM_SKINNY_ROWS(4, PAIR_BLOCK, PAIR_ROW)
#undef PAIR_ROW
#undef PAIR_BLOCK
}

const gemm_kernels gemm_kernels_avx512 = {.name = "avx512_12x32",
                                          .isa = OPF_ISA_AVX512,
                                          .mr = MR,
                                          .nr = NR,
                                          .mc = 120,
                                          .kc = 1024,
                                          .nc = 1024,
                                          .ukernel = ukernel_avx512_12x32,
                                          .cvt = &convert_kernels_avx512,
                                          .act = &act_kernels_avx2,
                                          .store = store_avx512,
                                          .skinny = gemm_skinny_avx512,
                                          .skinny_name = "avx512_skinny_4x4"};

const gemm_kernels gemm_kernels_avx512_bf16 = {.name = "avx512bf16_12x32",
                                               .isa = OPF_ISA_AVX512_BF16,
                                               .mr = MR,
                                               .nr = NR,
                                               .mc = 120,
                                               .kc = 1024,
                                               .nc = 1024,
                                               .ukernel = ukernel_avx512_12x32,
                                               .ukernel_pairs = ukernel_avx512bf16_12x32,
                                               .cvt = &convert_kernels_avx512,
                                               .act = &act_kernels_avx2,
                                               .f32 = &gemm_kernels_avx512,
                                               .store = store_avx512,
                                               .skinny_pairs = gemm_skinny_avx512bf16,
                                               .skinny_pairs_name = "avx512bf16_skinny_4x4"};
