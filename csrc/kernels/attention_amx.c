/*
 * Attention on AMX-BF16 tiles: the block products of bfloat16 inputs
 * (S = Q K^T, O += P V and the backward's dP, dV, dK, dQ: mm_bf16, operands
 * rounded to bfloat16 to nearest even, float32 sums) on tiles; the online
 * softmax, probabilities and score gradients are the AVX-512 kernels', and so
 * are float32 inputs' products.
 *
 * A product C (m x n) (+)= A (m x k) B (k x n): A is packed into tile rows
 * (16 rows x 16 K pairs, 64 bytes a row) -- a vector conversion where A's
 * rows run along K (csa = 1: a pair is two consecutive floats), pair by pair
 * otherwise -- and B a 32-column block at a time into pair rows by the
 * AVX512-BF16 kernel's packing (a K pair's 32 columns side by side, 128
 * bytes: two tiles of 16 columns); both padded
 * with zero pairs to whole tiles. A 32 x 32 block of C sums in tmm0-3 over
 * the K tiles (two A tiles, two B tiles, four TDPBF16PS per step), then goes
 * through a buffer into C, masked to the m x n that exist. K runs in chunks
 * of KP pairs, rows in chunks of MC, so the packed operands stay on the stack.
 *
 * Untuned: no AMX CPU was at hand when it was written. `make ctest` runs the
 * attention tests over the C model of the tile instructions
 * (test_attention_amx_emulated).
 */
#include <immintrin.h>

#include "amx_tiles.h"
#include "attention.h"
#include "attention_avx512.h"
#include "half_avx512.h"
#include "rows_avx512.h"

#define TP 16  /* pairs per tile row */
#define KP 128 /* K pairs per chunk: 256 of K */
#define MC 64  /* rows per chunk */

/* A(r, p) = a[r*rsa + p*csa], r < mc, p < kc, as tile rows: at[(t * MC32 + r) * TP + q] holds the
 * pair (A(r, 2(16t+q)), A(r, 2(16t+q)+1)); rows up to mc32 and pairs up to kt tiles are zero */
static void pack_a(uint32_t *at, const float *a, int64_t rsa, int64_t csa, int64_t mc, int64_t mc32, int64_t kc,
                   int64_t kt) {
    memset(at, 0, (size_t)(kt * mc32 * TP) * sizeof *at);
    for (int64_t r = 0; r < mc; r++) {
        const float *ar = a + r * rsa;
        if (csa == 1) { /* consecutive floats: 16 of them are 8 pairs in order */
            for (int64_t p0 = 0; p0 < kc; p0 += 16) {
                const __mmask16 m = tail16(kc - p0);
                const __m256i w = _mm512_cvtepi32_epi16(bf16_lanes(_mm512_maskz_loadu_ps(m, ar + p0)));
                const int64_t q = p0 / 2; /* the first pair */
                uint32_t *dst = at + ((q / TP) * mc32 + r) * TP + q % TP;
                _mm256_storeu_si256((__m256i *)dst, w); /* 8 pairs; a tile row holds 16, so never straddles */
            }
        } else {
            for (int64_t q = 0; 2 * q < kc; q++) {
                const float x0 = ar[2 * q * csa], x1 = 2 * q + 1 < kc ? ar[(2 * q + 1) * csa] : 0.0f;
                at[((q / TP) * mc32 + r) * TP + q % TP] = (uint32_t)opf_f32_to_bf16(x0) | (uint32_t)opf_f32_to_bf16(x1)
                                                                                              << 16;
            }
        }
    }
}

static void mm_amx(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                   int64_t ldb, float *c, int64_t ldc, int acc) {
    if (k == 0 || m == 0 || n == 0) { /* no product: C = 0 (+ C) */
        attention_mm_avx512(m, n, k, a, rsa, csa, b, ldb, c, ldc, acc);
        return;
    }
    _Alignas(64) uint32_t at[(KP / TP) * MC * TP], bp[KP * 32];
    _Alignas(64) float buf[32 * 32];
    TILE_CONFIG();
    for (int64_t k0 = 0; k0 < k; k0 += 2 * KP) {
        const int64_t kc = k - k0 < 2 * KP ? k - k0 : 2 * KP, kt = ((kc + 1) / 2 + TP - 1) / TP;
        const int accum = acc || k0 > 0;
        for (int64_t i0 = 0; i0 < m; i0 += MC) {
            const int64_t mc = m - i0 < MC ? m - i0 : MC, mc32 = (mc + 31) / 32 * 32;
            pack_a(at, a + i0 * rsa + k0 * csa, rsa, csa, mc, mc32, kc, kt);
            for (int64_t j = 0; j < n; j += 32) {
                const int64_t nb = n - j < 32 ? n - j : 32;
                attention_pack_b_bf16(bp, b + k0 * ldb + j, ldb, kc, nb); /* then zero pairs up to whole tiles */
                memset(bp + (kc + 1) / 2 * 32, 0, (size_t)(kt * TP - (kc + 1) / 2) * 32 * sizeof *bp);
                for (int64_t r0 = 0; r0 < mc; r0 += 32) {
                    TILE_ZERO(0);
                    TILE_ZERO(1);
                    TILE_ZERO(2);
                    TILE_ZERO(3);
                    for (int64_t t = 0; t < kt; t++) {
                        const uint32_t *a0 = at + (t * mc32 + r0) * TP, *bt = bp + t * TP * 32;
                        TILE_LOAD(4, a0, TP * 4);
                        TILE_LOAD(5, a0 + 16 * TP, TP * 4);
                        TILE_LOAD(6, bt, 32 * 4);
                        TILE_LOAD(7, bt + 16, 32 * 4);
                        TILE_DP(0, 4, 6);
                        TILE_DP(1, 4, 7);
                        TILE_DP(2, 5, 6);
                        TILE_DP(3, 5, 7);
                    }
                    TILE_STORE(0, buf, 32 * 4);
                    TILE_STORE(1, buf + 16, 32 * 4);
                    TILE_STORE(2, buf + 16 * 32, 32 * 4);
                    TILE_STORE(3, buf + 16 * 32 + 16, 32 * 4);
                    const __mmask16 m0 = tail16(nb), m1 = tail16(nb - 16);
                    for (int64_t r = 0; r < 32 && r0 + r < mc; r++) {
                        float *cr = c + (i0 + r0 + r) * ldc + j;
                        __m512 v0 = _mm512_load_ps(buf + r * 32), v1 = _mm512_load_ps(buf + r * 32 + 16);
                        if (accum) {
                            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, cr));
                            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, cr + 16));
                        }
                        _mm512_mask_storeu_ps(cr, m0, v0);
                        _mm512_mask_storeu_ps(cr + 16, m1, v1);
                    }
                }
            }
        }
    }
    tiles_release();
}

const attention_kernels attention_kernels_amx = {.name = "amx",
                                                 .isa = OPF_ISA_AMX,
                                                 .cvt = &convert_kernels_avx512,
                                                 .mm = attention_mm_avx512,
                                                 .mm_bf16 = mm_amx,
                                                 .softmax_cols = attention_softmax_cols_avx512,
                                                 .probs = attention_probs_avx512,
                                                 .dscores = attention_dscores_avx512};
