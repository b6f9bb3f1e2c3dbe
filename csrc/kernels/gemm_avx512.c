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

#define MR 12
#define NR 32

/* 16 floats rounded to bfloat16 / float16 as opforge/half.h rounds */
static inline __m256i round16x16(__m512 v, int dt) {
    if (dt != OPF_BF16) return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

/* 16 columns of one row: c / pre are float32 (NULL when unused), c16 / pre16 16-bit */
static inline void store16(float *c, float *pre, uint16_t *c16, uint16_t *pre16, __m512 v, const gemm_tile *t,
                           const float *bias_n, float bias_m) {
    if (t->load_c) v = _mm512_fmadd_ps(_mm512_set1_ps(t->beta), _mm512_loadu_ps(c), v);
    if (bias_n) v = _mm512_add_ps(v, _mm512_loadu_ps(bias_n));
    if (t->bias_m) v = _mm512_add_ps(v, _mm512_set1_ps(bias_m));
    if (pre) _mm512_storeu_ps(pre, v);
    if (pre16) _mm256_storeu_si256((__m256i *)pre16, round16x16(v, t->dt16));
    if (t->act != GEMM_ACT_NONE)
        v = _mm512_insertf32x8(_mm512_castps256_ps512(act8(t->act, _mm512_castps512_ps256(v))),
                               act8(t->act, _mm512_extractf32x8_ps(v, 1)), 1);
    if (c16) _mm256_storeu_si256((__m256i *)c16, round16x16(v, t->dt16));
    else _mm512_storeu_ps(c, v);
}

/* the tile is read or written after the K loop: start fetching it now */
static inline void prefetch_tile(const float *c, int64_t rsc, int m, const gemm_tile *t) {
    for (int i = 0; i < m; i++) {
        if (t->c16) {
            _mm_prefetch((const char *)(t->c16 + i * rsc), _MM_HINT_T0);
            _mm_prefetch((const char *)(t->c16 + i * rsc + 31), _MM_HINT_T0);
        }
        if (!t->c16 || t->load_c) {
            _mm_prefetch((const char *)(c + i * rsc), _MM_HINT_T0);
            _mm_prefetch((const char *)(c + i * rsc + 31), _MM_HINT_T0);
        }
    }
}

/* the epilogue of a tile from its accumulators: in registers for a full
 * tile, through the scalar epilogue for a partial one */
static inline void finish_tile(__m512 acc[MR][2], float *c, int64_t rsc, int m, int n, const gemm_tile *t) {
    if (m == MR && n == NR) {
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) {
            float *ci = t->c16 && !t->load_c ? NULL : c + i * rsc, *pre = t->pre ? t->pre + i * t->rsp : NULL;
            uint16_t *c16 = t->c16 ? t->c16 + i * rsc : NULL, *pre16 = t->pre16 ? t->pre16 + i * t->rsp : NULL;
            float bm = t->bias_m ? t->bias_m[i] : 0.0f;
            store16(ci, pre, c16, pre16, acc[i][0], t, t->bias_n, bm);
            store16(ci ? ci + 16 : NULL, pre ? pre + 16 : NULL, c16 ? c16 + 16 : NULL, pre16 ? pre16 + 16 : NULL,
                    acc[i][1], t, t->bias_n ? t->bias_n + 16 : NULL, bm);
        }
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

static void ukernel_avx512_12x32(int64_t kc, const float *ap, const float *bp, float *c, int64_t rsc, int m, int n,
                                 const gemm_tile *t) {
    __m512 acc[MR][2];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    prefetch_tile(c, rsc, m, t);
    for (int64_t p = 0; p < kc; p++, ap += MR, bp += NR) {
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
__attribute__((target("avx512bf16"))) static void ukernel_avx512bf16_12x32(int64_t kp, const uint32_t *ap,
                                                                           const uint32_t *bp, float *c, int64_t rsc,
                                                                           int m, int n, const gemm_tile *t) {
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

/* conversions: 16 lanes, masked tails (rounding as opforge/half.h) */
static void to_f32_avx512(float *dst, const uint16_t *src, int dt, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m256i h = _mm256_maskz_loadu_epi16(m, src + i);
        __m512 v = dt == OPF_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                  : _mm512_cvtph_ps(h);
        _mm512_mask_storeu_ps(dst + i, m, v);
    }
}

static void from_f32_avx512(uint16_t *dst, const float *src, int dt, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        _mm256_mask_storeu_epi16(dst + i, m, round16x16(_mm512_maskz_loadu_ps(m, src + i), dt));
    }
}

const gemm_kernels gemm_kernels_avx512 = {.name = "avx512_12x32", .mr = MR, .nr = NR, .mc = 120, .kc = 1024,
                                          .nc = 1024, .ukernel = ukernel_avx512_12x32, .act_grad = act_grad_8wide,
                                          .to_f32 = to_f32_avx512, .from_f32 = from_f32_avx512};

const gemm_kernels gemm_kernels_avx512_bf16 = {.name = "avx512bf16_12x32", .mr = MR, .nr = NR, .mc = 120,
                                               .kc = 1024, .nc = 1024, .ukernel = ukernel_avx512_12x32,
                                               .ukernel_pairs = ukernel_avx512bf16_12x32,
                                               .act_grad = act_grad_8wide, .to_f32 = to_f32_avx512,
                                               .from_f32 = from_f32_avx512};
