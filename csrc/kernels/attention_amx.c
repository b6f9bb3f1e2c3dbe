/*
 * Attention on AMX-BF16 tiles: the block products of bfloat16 inputs
 * (S = Q K^T, O += P V and the backward's dP, dV, dK, dQ: mm_bf16, operands
 * rounded to bfloat16 to nearest even, float32 sums) on tiles; the online
 * softmax, probabilities and score gradients are the AVX-512 kernels', and so
 * are float32 inputs' products.
 *
 * A product C (m x n) (+)= A (m x k) B (k x n) runs on operands packed into
 * bfloat16 pairs: A's rows of 16-pair tiles, B's 32-column slivers of pair
 * rows (two tiles of 16 columns), K padded with zero pairs to whole tiles. A
 * 32 x 32 block of C sums in tmm0-3 over the K tiles (two A tiles, two B
 * tiles, four TDPBF16PS per step), then goes into C (through a buffer where C
 * is added or the block is partial). mm_bf16 (mm_amx) packs its float32
 * operands per product, K in chunks of KP pairs and rows in chunks of MC, so
 * the packed operands stay on the stack.
 *
 * That per-product packing is the path of the shapes the driver does not pack once (strided rows, head
 * dims past 256). The packed path (packing_amx, below) feeds the tiles from operands packed once per
 * task, as the AVX512-BF16 table does; on a 2-core Xeon with AMX it made the bfloat16 forward
 * (B1 H8 N1024 D64) 2.1-2.5x faster and the forward+backward 1.9x.
 *
 * `make ctest` also runs the attention tests over the C model of the tile instructions
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

/* C's block (mb x nb <= 32 x 32, row stride ldc) = (acc ? C : 0) + the block's sums, left in buf (32 x
 * 32, the rows and columns past mb and nb unread) */
static void block_into_c(const float *buf, float *c, int64_t ldc, int64_t mb, int64_t nb, int acc) {
    const __mmask16 m0 = tail16(nb), m1 = tail16(nb - 16);
    for (int64_t r = 0; r < mb; r++) {
        float *cr = c + r * ldc;
        __m512 v0 = _mm512_maskz_loadu_ps(m0, buf + r * 32), v1 = _mm512_maskz_loadu_ps(m1, buf + r * 32 + 16);
        if (acc) {
            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, cr));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, cr + 16));
        }
        _mm512_mask_storeu_ps(cr, m0, v0);
        _mm512_mask_storeu_ps(cr + 16, m1, v1);
    }
}

/* ---- the same products on operands packed once (attention_bf16_packing in attention.h) ----------------
 *
 * The tile unit reads the packed operands in place: an A tile is 16 of its rows of 16 pairs (A along its
 * rows, row stride ATTENTION_PACK_KP; along its columns, this table's form is rows too, of
 * attention_packed_pairs(k) pairs), a B tile 16 pair rows of a 32-column sliver's 16 columns. So this
 * table pads K with zero pairs to whole tiles (attention_packed_pairs) in A's rows and B's slivers, and
 * packs P and dS "along their columns" into rows by 16 x 16 transposes. The sums are mm_amx's, tile for
 * tile: zeroed accumulators, the K tiles in order, then C added. */

/* The 16-bit elements k0 .. k of a row, as 16 pairs (zeros past k) */
static inline __m512i row_pairs16(const uint16_t *row, int64_t k0, int64_t k) {
    const int64_t left = k - k0;
    const __mmask32 m = left <= 0 ? 0 : left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1);
    return _mm512_maskz_loadu_epi16(m, row + k0);
}

static void a_rows16_amx(uint32_t *ap, const uint16_t *a, int64_t rs, int64_t rows, int64_t k) {
    const int64_t kp16 = attention_packed_pairs(k);
    for (int64_t r = 0; r < rows; r++) /* a row's pairs are its own 16-bit elements, two to a word */
        for (int64_t q = 0; q < kp16; q += 16)
            _mm512_storeu_si512(ap + r * ATTENTION_PACK_KP + q, row_pairs16(a + r * rs, 2 * q, k));
}

static void a_rows32_amx(uint32_t *ap, const float *a, int64_t rs, int64_t rows, int64_t k) {
    const int64_t kp = (k + 1) / 2, kp16 = attention_packed_pairs(k);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t q = 0; q < kp16; q += 16) /* zeros past k */
            _mm512_storeu_si512(ap + r * ATTENTION_PACK_KP + q,
                                q < kp ? pairs_of32(a + r * rs + 2 * q, k - 2 * q) : _mm512_setzero_si512());
}

/* v[i] lane j becomes v[j] lane i */
static inline void transpose16(__m512i v[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* v[4g + e]'s 128-bit block b now holds element 4b + e of rows 4g .. 4g + 3: gather the blocks */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        v[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        v[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* A(r, p) = a[r + p * cs] (float32, rounded) into rows of pairs: row r's pair q at
 * ap[r * attention_packed_pairs(k) + q] */
static void a_cols32_amx(uint32_t *ap, const float *a, int64_t cs, int64_t rows, int64_t k) {
    const int64_t kp16 = attention_packed_pairs(k);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const __mmask16 m = tail16(rows - r0);
        for (int64_t q0 = 0; q0 < kp16; q0 += 16) {
            __m512i v[16];
            for (int64_t q = 0; q < 16; q++) { /* lanes: rows r0.., pair q0 + q */
                const int64_t p = 2 * (q0 + q);
                const __m512i lo =
                    p < k ? bf16_lanes(_mm512_maskz_loadu_ps(m, a + r0 + p * cs)) : _mm512_setzero_si512();
                const __m512i hi =
                    p + 1 < k ? bf16_lanes(_mm512_maskz_loadu_ps(m, a + r0 + (p + 1) * cs)) : _mm512_setzero_si512();
                v[q] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
            }
            transpose16(v);
            for (int64_t i = 0; i < 16 && r0 + i < rows; i++) _mm512_storeu_si512(ap + (r0 + i) * kp16 + q0, v[i]);
        }
    }
}

/* B (k x n) as 32-column slivers of attention_packed_pairs(k) pair rows (zeros past k and n) */
static void b16_amx(uint32_t *bp, const uint16_t *b, int64_t rs, int64_t k, int64_t n) {
    b16_slivers(bp, b, rs, k, n, attention_packed_pairs(k));
}

/* B(p, j) = b[j * rs + p]: column j of a sliver is row j of b, its words (pairs) in order; 16 x 16
 * blocks of words transposed */
static void bt16_amx(uint32_t *bp, const uint16_t *b, int64_t rs, int64_t k, int64_t n) {
    const int64_t kp16 = attention_packed_pairs(k);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        uint32_t *sliver = bp + j0 / 32 * kp16 * 32 + j0 % 32;
        for (int64_t q0 = 0; q0 < kp16; q0 += 16) {
            __m512i v[16];
            for (int64_t c = 0; c < 16; c++) /* lanes: pairs q0.. of row j0 + c (zeros past k and n) */
                v[c] = j0 + c < n ? row_pairs16(b + (j0 + c) * rs, 2 * q0, k) : _mm512_setzero_si512();
            transpose16(v);
            for (int64_t q = 0; q < 16; q++) _mm512_storeu_si512(sliver + (q0 + q) * 32, v[q]);
        }
    }
    if (n % 32 > 0 && n % 32 <= 16) /* the last sliver's second half: zero columns */
        for (int64_t q = 0; q < kp16; q++) memset(bp + n / 32 * kp16 * 32 + q * 32 + 16, 0, 16 * sizeof *bp);
}

static void mm_packed_amx(int64_t m, int64_t n, int64_t k, const uint32_t *ap, int a_rows, const uint32_t *packed_b,
                          float *c, int64_t ldc, int acc) {
    const int64_t kp16 = attention_packed_pairs(k), kt = kp16 / TP, lda = a_rows ? ATTENTION_PACK_KP : kp16;
    if (k == 0 || m == 0 || n == 0) {
        for (int64_t i = 0; i < m && !acc; i++) memset(c + i * ldc, 0, (size_t)n * sizeof *c);
        return;
    }
    _Alignas(64) float buf[32 * 32];
    TILE_CONFIG();
    for (int64_t j = 0; j < n; j += 32) {
        const int64_t nb = n - j < 32 ? n - j : 32;
        const uint32_t *sliver = packed_b + j / 32 * kp16 * 32;
        for (int64_t r0 = 0; r0 < m; r0 += 32) {
            const int64_t mb = m - r0 < 32 ? m - r0 : 32;
            TILE_ZERO(0);
            TILE_ZERO(1);
            TILE_ZERO(2);
            TILE_ZERO(3);
            for (int64_t t = 0; t < kt; t++) { /* a partial block's missing half is neither loaded nor multiplied */
                const uint32_t *a0 = ap + r0 * lda + t * TP, *bt = sliver + t * TP * 32;
                TILE_LOAD(4, a0, lda * 4);
                TILE_LOAD(6, bt, 32 * 4);
                TILE_DP(0, 4, 6);
                if (nb > 16) {
                    TILE_LOAD(7, bt + 16, 32 * 4);
                    TILE_DP(1, 4, 7);
                }
                if (mb > 16) {
                    TILE_LOAD(5, a0 + 16 * lda, lda * 4);
                    TILE_DP(2, 5, 6);
                    if (nb > 16) TILE_DP(3, 5, 7);
                }
            }
            if (!acc && mb == 32 && nb == 32) { /* straight into C */
                float *cb = c + r0 * ldc + j;
                TILE_STORE(0, cb, ldc * 4);
                TILE_STORE(1, cb + 16, ldc * 4);
                TILE_STORE(2, cb + 16 * ldc, ldc * 4);
                TILE_STORE(3, cb + 16 * ldc + 16, ldc * 4);
                continue;
            }
            TILE_STORE(0, buf, 32 * 4);
            if (nb > 16) TILE_STORE(1, buf + 16, 32 * 4);
            if (mb > 16) {
                TILE_STORE(2, buf + 16 * 32, 32 * 4);
                if (nb > 16) TILE_STORE(3, buf + 16 * 32 + 16, 32 * 4);
            }
            block_into_c(buf, c + r0 * ldc + j, ldc, mb, nb, acc);
        }
    }
    tiles_release();
}

/* ---- mm_bf16: float32 operands rounded to bfloat16 per product (the shapes the driver does not pack
 * once), in chunks of K and rows, on the packed path's tiles ---- */

/* A(r, p) = a[r * rsa + p * csa], r < mc, p < kc, rounded into the rows a_rows32_amx writes */
static void pack_a_rows(uint32_t *ap, const float *a, int64_t rsa, int64_t csa, int64_t mc, int64_t kc) {
    if (csa == 1) {
        a_rows32_amx(ap, a, rsa, mc, kc);
        return;
    }
    const int64_t kp16 = attention_packed_pairs(kc);
    for (int64_t r = 0; r < mc; r++)
        for (int64_t q = 0; q < kp16; q++) {
            const float *x = a + r * rsa + 2 * q * csa;
            const float x0 = 2 * q < kc ? x[0] : 0.0f, x1 = 2 * q + 1 < kc ? x[csa] : 0.0f;
            ap[r * ATTENTION_PACK_KP + q] = (uint32_t)opf_f32_to_bf16(x0) | (uint32_t)opf_f32_to_bf16(x1) << 16;
        }
}

static void mm_amx(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                   int64_t ldb, float *c, int64_t ldc, int acc) {
    if (k == 0) { /* no product: C = 0 (+ C) */
        mm_packed_amx(m, n, 0, NULL, 1, NULL, c, ldc, acc);
        return;
    }
    _Alignas(64) uint32_t ap[MC * ATTENTION_PACK_KP], bp[KP * 32];
    for (int64_t k0 = 0; k0 < k; k0 += 2 * KP) {
        const int64_t kc = k - k0 < 2 * KP ? k - k0 : 2 * KP, kp = (kc + 1) / 2, kp16 = attention_packed_pairs(kc);
        const int accum = acc || k0 > 0;
        for (int64_t i0 = 0; i0 < m; i0 += MC) {
            const int64_t mc = m - i0 < MC ? m - i0 : MC;
            pack_a_rows(ap, a + i0 * rsa + k0 * csa, rsa, csa, mc, kc);
            for (int64_t j = 0; j < n; j += 32) {
                const int64_t nb = n - j < 32 ? n - j : 32;
                attention_pack_b_bf16(bp, b + k0 * ldb + j, ldb, kc, nb); /* then zero pairs up to whole tiles */
                memset(bp + kp * 32, 0, (size_t)((kp16 - kp) * 32) * sizeof *bp);
                mm_packed_amx(mc, nb, kc, ap, 1, bp, c + i0 * ldc + j, ldc, accum);
            }
        }
    }
}

static const attention_bf16_packing packing_amx = {.a_rows16 = a_rows16_amx,
                                                   .a_rows32 = a_rows32_amx,
                                                   .a_cols32 = a_cols32_amx,
                                                   .b16 = b16_amx,
                                                   .bt16 = bt16_amx,
                                                   .mm = mm_packed_amx};

const attention_kernels attention_kernels_amx = {.name = "amx",
                                                 .isa = OPF_ISA_AMX,
                                                 .cvt = &convert_kernels_avx512,
                                                 .mm = attention_mm_avx512,
                                                 .mm_bf16 = mm_amx,
                                                 .packing = &packing_amx,
                                                 .fwd_bk = 128,
                                                 .softmax_cols = attention_softmax_cols_avx512,
                                                 .probs = attention_probs_avx512,
                                                 .fwd_bk_plain = 256,
                                                 .dscores = attention_dscores_avx512,
                                                 .transpose = attention_transpose_avx512,
                                                 .scale_rows = attention_scale_rows_avx512};
