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
 * The driver calls the strip kernel (strip_amx_32x32: up to GEMM_STRIP_MAX
 * slivers of A against one B sliver, every product before any epilogue);
 * ukernel_amx_32x32 is the one-sliver kernel of the table's contract.
 * The tile configuration is loaded at each call: another library in this
 * thread (oneDNN) may have loaded its own in between. The accumulators go
 * through a 4 KiB buffer per sliver to the AVX-512 epilogue.
 *
 * OPF_AMX_EMULATE builds the same kernel over a C model of the five tile
 * instructions (the Intel SDM's operation, denormals flushed), so the packing,
 * padding and epilogue are tested on CPUs without AMX.
 */
#include <string.h>

#include "amx_tiles.h"
#include "gemm.h"
#include "gemm_avx512.h"

#define MR 32
#define NR 32
#define TP 16 /* pairs per tile row */


/* kp pairs of one A sliver against the B sliver into accumulators tmm0-3: two A tiles (tmm4-5),
 * two B tiles (tmm6-7), four products per step of TP pairs */
static inline void tile_steps(const uint32_t *ap, const uint32_t *bp, int64_t kp) {
    for (int64_t p = 0; p < kp; p += TP) { /* a whole number of tiles */
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
}

static void zero_acc(void) {
    TILE_ZERO(0);
    TILE_ZERO(1);
    TILE_ZERO(2);
    TILE_ZERO(3);
}

static void store_acc(float *acc) {
    TILE_STORE(0, acc, NR * 4);
    TILE_STORE(1, acc + 16, NR * 4);
    TILE_STORE(2, acc + 16 * NR, NR * 4);
    TILE_STORE(3, acc + 16 * NR + 16, NR * 4);
}

/* the epilogue of one sliver's m x n tile from its accumulators */
static void finish(const float *acc, float *c, int64_t rsc, int m, int n, const gemm_tile *t) {
    if (m < MR || n < NR) {
        gemm_tile_store(acc, NR, c, rsc, m, n, t);
        return;
    }
    for (int i = 0; i < MR; i++)
        store_row32(c, rsc, i, _mm512_loadu_ps(acc + i * NR), _mm512_loadu_ps(acc + i * NR + 16), t);
}

static void ukernel_amx_32x32(int64_t kp, const uint32_t *ap, const uint32_t *bp, float *c, int64_t rsc, int m, int n,
                              const gemm_tile *t) {
    _Alignas(64) float acc[MR * NR];
    prefetch_tile(c, rsc, m, t);
    TILE_CONFIG();
    zero_acc();
    tile_steps(ap, bp, kp);
    store_acc(acc);
    finish(acc, c, rsc, m, n, t);
}

/* The same 32 x 32 tiles over a strip of A slivers against one B sliver: every sliver's products run,
 * into its own 4 KiB of accumulators, before any epilogue does; one tile configuration per strip. On a
 * 2-core Xeon with AMX (one thread, one process, best of 8 interleaved) that ran 1.08-1.22x the sliver
 * at a time at 2048 x 512 x 2048, 4096 x 1024 x 4096 and 2048 x 512 x 8192, and 1.08x at 512 x 4096 x
 * 512; blocking K inside the strip (B's block kept in L1 between the slivers, the accumulators stored
 * and reloaded) measured no faster with blocks of 64-256 pairs, and slower with 32. */
static void strip_amx_32x32(int64_t kp, const uint32_t *ap, int count, int64_t m, const uint32_t *bp, float *c,
                            int64_t rsc, int n, const gemm_tile *tiles) {
    _Alignas(64) float acc[GEMM_STRIP_MAX][MR * NR];
    TILE_CONFIG();
    for (int s = 0; s < count; s++) {
        zero_acc();
        tile_steps(ap + s * MR * kp, bp, kp);
        store_acc(acc[s]);
    }
    for (int s = 0; s < count; s++)
        finish(acc[s], c ? c + s * MR * rsc : NULL, rsc, (int)(m - s * MR < MR ? m - s * MR : MR), n, tiles + s);
}

/* MC 128 x KC 1024 pairs: an A block of 512 KiB, a B sliver of 128 KiB in a
 * 2 MiB L2; as first sized, without an AMX CPU at hand (the strip kernel
 * above is what has been measured on one). */
const gemm_kernels gemm_kernels_amx = {.name = "amx_32x32",
                                       .isa = OPF_ISA_AMX,
                                       .mr = MR,
                                       .nr = NR,
                                       .mc = 128,
                                       .kc = 1024,
                                       .nc = 1024,
                                       .ukernel = NULL,
                                       .ukernel_pairs = ukernel_amx_32x32,
                                       .ukernel_strip = strip_amx_32x32,
                                       .cvt = &convert_kernels_avx512,
                                       .act = &act_kernels_avx2,
                                       .tile_pairs = TP,
                                       .f32 = &gemm_kernels_avx512,
                                       .release = tiles_release,
                                       .store = finish,
                                       .skinny_pairs = gemm_skinny_avx512bf16,
                                       .skinny_pairs_name = "avx512bf16_skinny_4x4"};
