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

/* the epilogue of a tile from its accumulators: in registers for a full
 * tile, through the scalar epilogue for a partial one */
static inline void finish_tile(__m512 acc[MR][2], float *c, int64_t rsc, int m, int n, const gemm_tile *t) {
    if (m == MR && n == NR) {
#pragma GCC unroll 12
        for (int i = 0; i < MR; i++) store_row32(c, rsc, i, acc[i][0], acc[i][1], t);
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
    if (m != MR || n != NR) {
        gemm_tile_store(buf, NR, c, rsc, m, n, t);
        return;
    }
    __m512 acc[MR][2];
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
        acc[i][0] = _mm512_loadu_ps(buf + i * NR);
        acc[i][1] = _mm512_loadu_ps(buf + i * NR + 16);
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
                                          .store = store_avx512};

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
                                               .store = store_avx512};
