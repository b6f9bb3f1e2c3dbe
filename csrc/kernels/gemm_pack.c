/*
 * GEMM packing: A into MR-tall and B into NR-wide slivers of one K slice,
 * float32 (converted from 16-bit types on the way) or bfloat16 pairs, in the
 * layouts of gemm.h. The driver (gemm.c) says which slice and which slivers.
 */
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <xmmintrin.h> /* every x86-64 CPU: the packing's 4 x 4 transposes */
#endif

#include "gemm_pack.h"

static inline float load_elem(const void *p, int64_t i, opf_dtype dt) { return (float)opf_load_elem(p, i, dt); }

/* dst[p*w + r] = src[r*rs + p] (rows along K, contiguous), zero for rows <= r < w.
 * K goes in blocks of 64: the part of dst being written stays in L1 while each
 * row is read along K; a whole-K pass per row would miss L1 on every store,
 * and reading the rows side by side (rows often 4 KiB apart) thrashes L1 sets. */
static void pack_rows_f32(float *dst, const float *src, int64_t rs, int64_t rows, int64_t depth, int w) {
    enum { PB = 64 };
    for (int64_t p0 = 0; p0 < depth; p0 += PB) {
        int64_t pe = depth - p0 < PB ? depth : p0 + PB;
#ifdef __SSE2__
        if (rows == w && w % 4 == 0) { /* 4 x 4 transposes: 8 memory operations per 16 elements, not 32 */
            int64_t pv = p0 + (pe - p0) / 4 * 4;
            for (int r = 0; r < w; r += 4) {
                const float *r0 = src + r * rs, *r1 = r0 + rs, *r2 = r1 + rs, *r3 = r2 + rs;
                for (int64_t p = p0; p < pv; p += 4) {
                    __m128 x0 = _mm_loadu_ps(r0 + p), x1 = _mm_loadu_ps(r1 + p), x2 = _mm_loadu_ps(r2 + p),
                           x3 = _mm_loadu_ps(r3 + p);
                    _MM_TRANSPOSE4_PS(x0, x1, x2, x3);
                    _mm_storeu_ps(dst + p * w + r, x0);
                    _mm_storeu_ps(dst + (p + 1) * w + r, x1);
                    _mm_storeu_ps(dst + (p + 2) * w + r, x2);
                    _mm_storeu_ps(dst + (p + 3) * w + r, x3);
                }
                for (int64_t p = pv; p < pe; p++)
                    for (int i = 0; i < 4; i++) dst[p * w + r + i] = src[(r + i) * rs + p];
            }
            continue;
        }
#endif
        for (int r = 0; r < w; r++) {
            const float *row = src + (r < rows ? r : 0) * rs;
            for (int64_t p = p0; p < pe; p++) dst[p * w + r] = r < rows ? row[p] : 0.0f;
        }
    }
}

/* Rows [0, rows) of an operand (row stride rs, K stride cs) over a K slice of
 * depth -> dst[p*w + r] as float32, zero past rows. A packs its rows (w = MR), B
 * its columns (w = NR: rs is B's column stride, cs its row stride), as
 * pack_pairs does for bfloat16 pairs. */
static void pack_sliver(const gemm_kernels *kern, float *dst, const void *src, opf_dtype dt, int64_t rs, int64_t cs,
                        int64_t rows, int64_t depth, int w) {
    if (cs == 1 && dt == OPF_F32) { /* rows along K: A, or nn.Linear's weight as B */
        pack_rows_f32(dst, src, rs, rows, depth, w);
        return;
    }
    if (cs == 1 && depth <= 1024) { /* 16-bit rows along K: vector conversion, then interleave */
        float row[1024];
        for (int r = 0; r < w; r++) {
            if (r < rows) kern->cvt->to_f32(row, (const uint16_t *)src + r * rs, dt, depth);
            for (int64_t p = 0; p < depth; p++) dst[p * w + r] = r < rows ? row[p] : 0.0f;
        }
        return;
    }
    if (rs == 1 && rows == w && dt != OPF_F32) { /* a full 16-bit line of w per K step (float32: pack_lines_f32) */
        for (int64_t p = 0; p < depth; p++) kern->cvt->to_f32(dst + p * w, (const uint16_t *)src + p * cs, dt, w);
        return;
    }
    if (dt == OPF_F32) {
        const float *a = src;
        for (int64_t p = 0; p < depth; p++)
            for (int r = 0; r < w; r++) dst[p * w + r] = r < rows ? a[r * rs + p * cs] : 0.0f;
        return;
    }
    for (int64_t p = 0; p < depth; p++)
        for (int r = 0; r < w; r++) dst[p * w + r] = r < rows ? load_elem(src, r * rs + p * cs, dt) : 0.0f;
}

/* bfloat16 bits of element i of a bfloat16 or float32 array */
static inline uint32_t bf16_bits(const void *p, int64_t i, opf_dtype dt) {
    return dt == OPF_BF16 ? ((const uint16_t *)p)[i] : opf_f32_to_bf16(((const float *)p)[i]);
}

/* Rows [0, rows) of a (row stride rs, K stride cs; bfloat16 or float32) over
 * a K slice of depth -> dst[p*w + r] = a(r, 2p) | a(r, 2p+1) << 16, zero past
 * rows and past depth. A packs its rows (w = MR), B its columns (w = NR: rs is
 * B's column stride, cs its row stride). */
static void pack_pairs(uint32_t *dst, const void *a, opf_dtype dt, int64_t rs, int64_t cs, int64_t rows, int64_t depth,
                       int w) {
    const int64_t kp = (depth + 1) / 2, full = depth / 2;
    if (dt == OPF_BF16 && cs == 1 && rows == w && w % 4 == 0 && rs % 2 == 0 && (uintptr_t)a % 4 == 0) {
        /* full pairs are 32-bit words along 4-byte aligned rows: pack_rows_f32's 4 x 4 transposes move them
         * bit for bit (as floats, never computed on); an odd K's last pair alone */
        pack_rows_f32((float *)dst, (const float *)a, rs / 2, rows, full, w);
        for (int r = 0; kp > full && r < w; r++) dst[full * w + r] = ((const uint16_t *)a)[r * rs + depth - 1];
        return;
    }
    if (dt == OPF_BF16 && cs == 1) { /* pairs are adjacent: one 32-bit copy each, in K blocks as pack_rows_f32 */
        enum { PB = 64 };
        for (int64_t p0 = 0; p0 < kp; p0 += PB) {
            int64_t pe = kp - p0 < PB ? kp : p0 + PB, fe = pe < full ? pe : full;
            for (int r = 0; r < w; r++) {
                if (r >= rows) {
                    for (int64_t p = p0; p < pe; p++) dst[p * w + r] = 0;
                    continue;
                }
                const uint16_t *row = (const uint16_t *)a + r * rs;
                for (int64_t p = p0; p < fe; p++)
                    dst[p * w + r] = (uint32_t)row[2 * p] | (uint32_t)row[2 * p + 1] << 16;
                if (pe > full) dst[full * w + r] = row[depth - 1];
            }
        }
        return;
    }
    for (int64_t p = 0; p < kp; p++)
        for (int r = 0; r < w; r++) {
            uint32_t lo = r < rows ? bf16_bits(a, r * rs + 2 * p * cs, dt) : 0;
            uint32_t hi = r < rows && 2 * p + 1 < depth ? bf16_bits(a, r * rs + (2 * p + 1) * cs, dt) : 0;
            dst[p * w + r] = lo | hi << 16;
        }
}

/* Float32 lines along the slivers' rows (rs == 1: B as stored, or a
 * transposed A): slivers [0, ceil(rows / w)) of the K slice at once, K step
 * outermost. Each step reads one run of `rows` adjacent floats; sliver by
 * sliver it would be w floats from every K line, lines that are often a
 * multiple of 4 KiB apart, where the hardware prefetchers do not follow. */
static void pack_lines_f32(float *dst, const float *src, int64_t cs, int64_t rows, int64_t depth, int w) {
    enum { AHEAD = 8 }; /* K lines fetched ahead */
    const int64_t slivers = (rows + w - 1) / w;
    for (int64_t p = 0; p < depth; p++) {
        const float *line = src + p * cs;
        if (p + AHEAD < depth)
            for (int64_t r = 0; r < rows; r += 16) __builtin_prefetch(line + AHEAD * cs + r);
        for (int64_t s = 0; s < slivers; s++) {
            float *d = dst + s * w * depth + p * w;
            const float *l = line + s * w;
            int64_t n = rows - s * w < w ? rows - s * w : w;
            for (int r = 0; r < n; r++) d[r] = l[r];
            for (int r = (int)n; r < w; r++) d[r] = 0.0f;
        }
    }
}

/* Pairs [kp, kps) of each of `slivers` slivers (stride w * kps): zero */
static void zero_pairs(uint32_t *dst, int64_t slivers, int w, int64_t kp, int64_t kps) {
    for (int64_t s = 0; kp < kps && s < slivers; s++)
        memset(dst + s * w * kps + kp * w, 0, sizeof(uint32_t) * w * (kps - kp));
}

/* The same for bfloat16 pairs (pack_pairs' layout) from bfloat16 or float32
 * lines: K lines 2p and 2p + 1 are read side by side, one run of `rows`
 * each, and interleaved into the slivers; zero past depth, and pairs [kp, kps)
 * zero where the sliver stride w * kps is deeper (tile_pairs). */
static void pack_lines_pairs(uint32_t *dst, const void *src, opf_dtype dt, int64_t cs, int64_t rows, int64_t depth,
                             int w, int64_t kps) {
    enum { AHEAD = 4 }; /* pairs of K lines fetched ahead */
    const int64_t slivers = (rows + w - 1) / w, kp = (depth + 1) / 2, es = opf_dtype_size(dt);
    for (int64_t p = 0; p < kp; p++) {
        const char *lo = (const char *)src + 2 * p * cs * es, *hi = lo + cs * es;
        const int odd = 2 * p + 1 == depth;
        if (p + AHEAD < kp)
            for (int64_t b = 0; b < rows * es; b += 64) {
                __builtin_prefetch(lo + 2 * AHEAD * cs * es + b);
                __builtin_prefetch(hi + 2 * AHEAD * cs * es + b);
            }
        for (int64_t s = 0; s < slivers; s++) {
            uint32_t *d = dst + s * w * kps + p * w;
            int64_t r0 = s * w, n = rows - r0 < w ? rows - r0 : w;
            if (dt == OPF_BF16) {
                const uint16_t *l = (const uint16_t *)lo + r0, *h = (const uint16_t *)hi + r0;
                if (odd)
                    for (int r = 0; r < n; r++) d[r] = l[r];
                else
                    for (int r = 0; r < n; r++) d[r] = (uint32_t)l[r] | (uint32_t)h[r] << 16;
            } else {
                const float *l = (const float *)lo + r0, *h = (const float *)hi + r0;
                for (int r = 0; r < n; r++)
                    d[r] = opf_f32_to_bf16(l[r]) | (odd ? 0u : (uint32_t)opf_f32_to_bf16(h[r]) << 16);
            }
            for (int r = (int)n; r < w; r++) d[r] = 0;
        }
    }
    zero_pairs(dst, slivers, w, kp, kps);
}

/* Slivers of `rows` rows of an operand (row stride rs, K stride cs) over `depth` of the K slice from src,
 * w rows each (the last zero padded), into dst: sliver s at dst + s * w * kps, float32 or pairs (kps:
 * words per sliver row, the pairs from depth's up to kps zero; float32: kps == depth where rows > w) */
static void pack_slivers(const gemm_job *job, float *dst, const void *src, opf_dtype dt, int64_t rs, int64_t cs,
                         int64_t rows, int w, int64_t depth, int64_t kps) {
    if (rs == 1 && cs != 1 && (job->pairs || dt == OPF_F32)) { /* pairs come from bfloat16 or float32 */
        if (job->pairs)
            pack_lines_pairs((uint32_t *)dst, src, dt, cs, rows, depth, w, kps);
        else
            pack_lines_f32(dst, src, cs, rows, depth, w);
        return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += w) {
        const void *s0 = elem_ptr(src, r0 * rs, dt);
        int64_t n = rows - r0 < w ? rows - r0 : w;
        float *d = dst + r0 / w * w * kps;
        if (job->pairs) {
            pack_pairs((uint32_t *)d, s0, dt, rs, cs, n, depth, w);
            zero_pairs((uint32_t *)d, 1, w, (depth + 1) / 2, kps);
        } else {
            pack_sliver(job->kern, d, s0, dt, rs, cs, n, depth, w);
        }
    }
}

/* A's slivers for a tile pair kernel (gemm_kernels.tile_pairs), a block of
 * tp pairs at a time (row r: its tp pairs side by side). bfloat16 rows along
 * K are already in that order: a copy per row. Otherwise the block is packed
 * as pack_slivers packs a slice of 2 tp, then transposed into tile rows. */
static void pack_tile_rows(const gemm_job *job, float *dst, const void *src, opf_dtype dt, int64_t rs, int64_t cs,
                           int64_t rows) {
    enum { TP_MAX = 16, MR_MAX = 32 };
    const int w = job->kern->mr, tp = job->kern->tile_pairs;
    uint32_t blk[TP_MAX * MR_MAX];
    if (w > MR_MAX || tp > TP_MAX) abort(); /* a table this scratch was not sized for */
    for (int64_t r0 = 0; r0 < rows; r0 += w) {
        int64_t n = rows - r0 < w ? rows - r0 : w;
        uint32_t *d = (uint32_t *)dst + r0 / w * w * job->kp;
        for (int64_t p0 = 0; p0 < job->kp; p0 += tp, d += w * tp) {
            int64_t k0 = 2 * p0, tile_depth = job->depth - k0 < 2 * tp ? job->depth - k0 : 2 * tp;
            if (dt == OPF_BF16 && cs == 1 && tile_depth == 2 * tp) { /* bfloat16 rows along K: a tile row is a copy */
                for (int r = 0; r < w; r++) {
                    if (r < n)
                        memcpy(d + r * tp, (const uint16_t *)src + (r0 + r) * rs + k0, sizeof(uint32_t) * tp);
                    else
                        memset(d + r * tp, 0, sizeof(uint32_t) * tp);
                }
                continue;
            }
            memset(blk, 0, sizeof(uint32_t) * w * tp);
            if (tile_depth > 0) {
                const void *s0 = elem_ptr(src, r0 * rs + k0 * cs, dt);
                if (rs == 1 && cs != 1)
                    pack_lines_pairs(blk, s0, dt, cs, n, tile_depth, w, tp);
                else
                    pack_pairs(blk, s0, dt, rs, cs, n, tile_depth, w);
            }
            for (int r = 0; r < w; r++)
                for (int q = 0; q < tp; q++) d[r * tp + q] = blk[q * w + r];
        }
    }
}

void gemm_pack_a(const gemm_job *job, float *dst, int64_t base, int64_t begin, int64_t end) {
    const int mr = job->kern->mr;
    int64_t i0 = begin * mr, i1 = end * mr < job->m ? end * mr : job->m;
    const void *src = elem_ptr(job->a, i0 * job->rsa + job->pc * job->csa, job->ta);
    if (job->pairs && job->kern->tile_pairs)
        pack_tile_rows(job, dst + (begin - base) * mr * job->kp, src, job->ta, job->rsa, job->csa, i1 - i0);
    else
        pack_slivers(job, dst + (begin - base) * mr * job->kp, src, job->ta, job->rsa, job->csa, i1 - i0, mr,
                     job->depth, job->kp);
}

void gemm_pack_a_range(int64_t begin, int64_t end, void *ctx) {
    const gemm_job *job = ctx;
    gemm_pack_a(job, job->ap, 0, begin, end);
}

/* B's columns are the slivers' rows */
void gemm_pack_b_range(int64_t begin, int64_t end, void *ctx) {
    const gemm_job *job = ctx;
    const int nr = job->kern->nr;
    int64_t j0 = begin * nr, j1 = end * nr < job->nc ? end * nr : job->nc;
    pack_slivers(job, job->bp + begin * nr * job->kp,
                 elem_ptr(job->b, job->pc * job->rsb + (job->jc + j0) * job->csb, job->tb), job->tb, job->csb, job->rsb,
                 j1 - j0, nr, job->depth, job->kp);
}

/* Task t: part t % b_parts of B's sliver t / b_parts, a run of its K slice (whole pairs; the last part
 * also writes the zero pairs up to kp): the words the whole sliver's packing writes there */
void gemm_pack_b_parts_range(int64_t begin, int64_t end, void *ctx) {
    const gemm_job *job = ctx;
    const int nr = job->kern->nr;
    const int64_t parts = job->b_parts, units = job->pairs ? (job->depth + 1) / 2 : job->depth;
    for (int64_t t = begin; t < end; t++) {
        const int64_t s = t / parts, part = t % parts, j0 = s * nr, cols = job->nc - j0 < nr ? job->nc - j0 : nr;
        const int64_t u0 = units * part / parts, u1 = units * (part + 1) / parts;
        const int64_t k0 = job->pairs ? 2 * u0 : u0, k1 = job->pairs ? 2 * u1 : u1;
        pack_slivers(job, job->bp + (s * job->kp + u0) * nr,
                     elem_ptr(job->b, (job->pc + k0) * job->rsb + (job->jc + j0) * job->csb, job->tb), job->tb,
                     job->csb, job->rsb, cols, nr, (k1 < job->depth ? k1 : job->depth) - k0, /* an odd K: a half pair */
                     part == parts - 1 ? job->kp - u0 : u1 - u0);
    }
}
