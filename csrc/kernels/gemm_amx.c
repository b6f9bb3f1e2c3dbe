/*
 * GEMM pair kernel on AMX-BF16 tiles (Sapphire Rapids and later): a 32 x 32
 * float32 tile of C in four 16 x 16 tile registers (tmm0-3), per step of 16
 * K pairs two A tiles (tmm4-5: 16 rows x 16 pairs each) and two B tiles
 * (tmm6-7: 16 pairs x 16 columns), four TDPBF16PS. Float32 products run on
 * the AVX-512 12 x 32 kernel (gemm_kernels.f32).
 *
 * Layouts (gemm.h, tile_pairs = 16): A slivers are packed tile by tile, row
 * r's 16 pairs side by side, so a tile loads with a 64-byte stride; B keeps
 * the pair layout of the AVX512-BF16 kernel (a K pair's 32 columns side by
 * side), so a tile is 16 of those rows, 16 columns wide, loaded with a
 * 128-byte stride. The packed depth is a whole number of tiles (zero pairs).
 *
 * The tile configuration is loaded at each call: another library in this
 * thread (oneDNN) may have loaded its own in between. The accumulators go
 * through a 4 KiB buffer to the AVX-512 epilogue.
 *
 * OPF_AMX_EMULATE builds the same kernel over a C model of the five tile
 * instructions (the Intel SDM's operation, denormals flushed), so the packing,
 * padding and epilogue are tested on CPUs without AMX.
 */
#include <string.h>

#include "gemm.h"
#include "gemm_avx512.h"

#define MR 32
#define NR 32
#define TP 16 /* pairs per tile row */

typedef struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

_Static_assert(sizeof(tile_config) == 64, "the tile configuration is 64 bytes");

/* eight tiles of 16 rows x 64 bytes */
static const _Alignas(64) tile_config config = {
    .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

#ifdef OPF_AMX_EMULATE
#include <float.h>
#include <math.h>

typedef struct emu_tile {
    int rows, colsb;
    uint32_t w[16][16];
} emu_tile;
static _Thread_local emu_tile emu[8];

static void emu_config(const tile_config *c) {
    for (int t = 0; t < 8; t++) emu[t].rows = c->rows[t], emu[t].colsb = c->colsb[t];
}
static void emu_load(int t, const void *base, int64_t stride) {
    for (int r = 0; r < emu[t].rows; r++) memcpy(emu[t].w[r], (const char *)base + r * stride, emu[t].colsb);
}
static void emu_store(int t, void *base, int64_t stride) {
    for (int r = 0; r < emu[t].rows; r++) memcpy((char *)base + r * stride, emu[t].w[r], emu[t].colsb);
}
static void emu_zero(int t) { memset(emu[t].w, 0, sizeof emu[t].w); }
/* denormals read as zero and written as zero, as the tile unit does */
static float flush(float f) { return fabsf(f) < FLT_MIN ? 0.0f * f : f; }
static float bf16_lo(uint32_t w) { return flush(opf_bf16_to_f32((uint16_t)w)); }
static float bf16_hi(uint32_t w) { return flush(opf_bf16_to_f32((uint16_t)(w >> 16))); }
/* The SDM's operation: per dst element an even and an odd float32 sum over
 * the K pairs (a.row[m].bf16[2k] * b.row[k].bf16[2n], and the 2k+1 / 2n+1
 * halves), each step one fused multiply-add, then both added to dst. */
static void emu_dp(int d, int a, int b) {
    for (int m = 0; m < emu[d].rows; m++)
        for (int n = 0; n < emu[d].colsb / 4; n++) {
            float acc, even = 0.0f, odd = 0.0f;
            for (int k = 0; k < emu[a].colsb / 4; k++) {
                even = flush(fmaf(bf16_lo(emu[a].w[m][k]), bf16_lo(emu[b].w[k][n]), even));
                odd = flush(fmaf(bf16_hi(emu[a].w[m][k]), bf16_hi(emu[b].w[k][n]), odd));
            }
            memcpy(&acc, &emu[d].w[m][n], 4);
            acc = flush(flush(acc + even) + odd);
            memcpy(&emu[d].w[m][n], &acc, 4);
        }
}
#define TILE_CONFIG() emu_config(&config)
#define TILE_ZERO(t) emu_zero(t)
#define TILE_LOAD(t, base, stride) emu_load(t, base, stride)
#define TILE_STORE(t, base, stride) emu_store(t, base, stride)
#define TILE_DP(d, a, b) emu_dp(d, a, b)
static void tiles_release(void) {}
#else
/* The compiler's tile loads are asm statements that do not declare the
 * memory they read (its tile store declares a clobber, one version and not
 * another): a barrier on each side keeps the packing's stores before the
 * loads and the epilogue's loads after the stores. _tile_loadconfig declares
 * only 8 of the 64 bytes it reads; `config` is a constant object, so no store
 * to it can be pending (a configuration built on the stack would need a
 * barrier first). */
#define TILE_CONFIG() _tile_loadconfig(&config)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, base, stride)         \
    do {                                   \
        __asm__ volatile("" ::: "memory"); \
        _tile_loadd(t, base, stride);      \
    } while (0)
#define TILE_STORE(t, base, stride)        \
    do {                                   \
        _tile_stored(t, base, stride);     \
        __asm__ volatile("" ::: "memory"); \
    } while (0)
#define TILE_DP(d, a, b) _tile_dpbf16ps(d, a, b)
/* back to the initial tile state: signal frames and context switches no
 * longer carry the 8 KiB of tile data, and no stale configuration is left to
 * code in this thread that assumes its own is still loaded */
static void tiles_release(void) { _tile_release(); }
#endif

static void ukernel_amx_32x32(int64_t kp, const uint32_t *ap, const uint32_t *bp, float *c, int64_t rsc, int m, int n,
                              const gemm_tile *t) {
    _Alignas(64) float acc[MR * NR];
    prefetch_tile(c, rsc, m, t);
    TILE_CONFIG();
    TILE_ZERO(0);
    TILE_ZERO(1);
    TILE_ZERO(2);
    TILE_ZERO(3);
    for (int64_t p = 0; p < kp; p += TP) { /* kp: a whole number of tiles */
        const uint32_t *a = ap + p * MR, *b = bp + p * NR;
        TILE_LOAD(4, a, TP * 4);
        TILE_LOAD(5, a + 16 * TP, TP * 4);
        TILE_LOAD(6, b, NR * 4);
        TILE_LOAD(7, b + 16, NR * 4);
        TILE_DP(0, 4, 6);
        TILE_DP(1, 4, 7);
        TILE_DP(2, 5, 6);
        TILE_DP(3, 5, 7);
    }
    TILE_STORE(0, acc, NR * 4);
    TILE_STORE(1, acc + 16, NR * 4);
    TILE_STORE(2, acc + 16 * NR, NR * 4);
    TILE_STORE(3, acc + 16 * NR + 16, NR * 4);
    if (m < MR || n < NR) {
        gemm_tile_store(acc, NR, c, rsc, m, n, t);
        return;
    }
    for (int i = 0; i < MR; i++)
        store_row32(c, rsc, i, _mm512_load_ps(acc + i * NR), _mm512_load_ps(acc + i * NR + 16), t);
}

/* MC 128 x KC 1024 pairs: an A block of 512 KiB, a B sliver of 128 KiB in a
 * 2 MiB L2; untuned (no AMX CPU was at hand when it was written). */
const gemm_kernels gemm_kernels_amx = {.name = "amx_32x32",
                                       .isa = OPF_ISA_AMX,
                                       .mr = MR,
                                       .nr = NR,
                                       .mc = 128,
                                       .kc = 1024,
                                       .nc = 1024,
                                       .ukernel = NULL,
                                       .ukernel_pairs = ukernel_amx_32x32,
                                       .cvt = &convert_kernels_avx512,
                                       .act = &act_kernels_avx2,
                                       .tile_pairs = TP,
                                       .f32 = &gemm_kernels_avx512,
                                       .release = tiles_release};
