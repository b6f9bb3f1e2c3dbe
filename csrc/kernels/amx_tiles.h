/*
 * AMX-BF16 tiles as the kernels use them: one configuration of eight tiles of
 * 16 rows x 64 bytes, and the five instructions as macros (TILE_CONFIG,
 * TILE_ZERO, TILE_LOAD, TILE_STORE, TILE_DP) plus tiles_release. Included by
 * the *_amx.c files only (built with -mamx-tile -mamx-bf16), each getting its
 * own static copy.
 *
 * OPF_AMX_EMULATE builds the same macros over a C model of the instructions
 * (the Intel SDM's operation, denormals flushed), so the kernels' packing,
 * padding and epilogues are tested on CPUs without AMX.
 */
#ifndef OPFORGE_KERNELS_AMX_TILES_H
#define OPFORGE_KERNELS_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "opforge/half.h"

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

#endif
