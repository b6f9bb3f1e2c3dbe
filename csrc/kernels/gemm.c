/*
 * GEMM: the oracle (gemm_ref_f32), the scalar micro-kernel, packing and the
 * blocked, threaded driver. Contract and blocking in gemm.h.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <xmmintrin.h> /* every x86-64 CPU: the packing's 4 x 4 transposes */
#endif

#include "gemm.h"

/* ---- activations -------------------------------------------------------------------- */

#define GELU_K 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_C 0.044715f

float gemm_act_f32(int act, float x) {
    switch (act) {
    case GEMM_ACT_RELU: return x < 0.0f ? 0.0f : x; /* NaN passes, as torch.relu */
    case GEMM_ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case GEMM_ACT_GELU_TANH: return 0.5f * x * (1.0f + tanhf(GELU_K * (x + GELU_C * x * x * x)));
    case GEMM_ACT_SILU: return x / (1.0f + expf(-x));
    default: return x;
    }
}

float gemm_act_grad_f32(int act, float x) {
    switch (act) {
    case GEMM_ACT_RELU: return x > 0.0f ? 1.0f : 0.0f;
    case GEMM_ACT_GELU: {
        float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
        float pdf = expf(-0.5f * x * x) * 0.3989422804014327f;
        return cdf + x * pdf;
    }
    case GEMM_ACT_GELU_TANH: {
        float t = tanhf(GELU_K * (x + GELU_C * x * x * x));
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * GELU_K * (1.0f + 3.0f * GELU_C * x * x);
    }
    case GEMM_ACT_SILU: {
        float s = 1.0f / (1.0f + expf(-x));
        return s * (1.0f + x * (1.0f - s));
    }
    default: return 1.0f;
    }
}

static inline uint16_t round16(float v, int dt) { return dt == OPF_BF16 ? opf_f32_to_bf16(v) : opf_f32_to_f16(v); }

void gemm_tile_store(const float *acc, int nr, float *c, int64_t rsc, int m, int n, const gemm_tile *t) {
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < n; j++) {
            float v = acc[i * nr + j];
            if (t->load_c) v += t->beta == 1.0f ? c[i * rsc + j] : t->beta * c[i * rsc + j];
            if (t->bias_n) v += t->bias_n[j];
            if (t->bias_m) v += t->bias_m[i];
            if (t->pre) t->pre[i * t->rsp + j] = v;
            if (t->pre16) t->pre16[i * t->rsp + j] = round16(v, t->dt16);
            if (t->c16) t->c16[i * rsc + j] = round16(gemm_act_f32(t->act, v), t->dt16);
            else c[i * rsc + j] = gemm_act_f32(t->act, v);
        }
    }
}

/* ---- the oracle --------------------------------------------------------------------- */

void gemm_ref_f32(int64_t m, int64_t n, int64_t kdim, const float *a, int64_t rsa, int64_t csa,
                  const float *b, int64_t rsb, int64_t csb, float *c, int64_t rsc,
                  const gemm_epilogue *ep) {
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n; j++) {
            double s = 0;
            for (int64_t p = 0; p < kdim; p++) s += (double)a[i * rsa + p * csa] * b[p * rsb + j * csb];
            float v = (float)s;
            if (ep->beta != 0.0f) v += ep->beta * c[i * rsc + j];
            if (ep->bias_kind == GEMM_BIAS_ROW) v += ep->bias[j];
            if (ep->bias_kind == GEMM_BIAS_COL) v += ep->bias[i];
            if (ep->preact) ep->preact[i * ep->rsp + j] = v;
            if (ep->pre16) ((uint16_t *)ep->pre16)[i * ep->rsp + j] = round16(v, ep->out_dt);
            if (ep->out16) ((uint16_t *)ep->out16)[i * rsc + j] = round16(gemm_act_f32(ep->act, v), ep->out_dt);
            else c[i * rsc + j] = gemm_act_f32(ep->act, v);
        }
    }
}

static double act_f64(int act, double x) {
    switch (act) {
    case GEMM_ACT_RELU: return x < 0.0 ? 0.0 : x;
    case GEMM_ACT_GELU: return 0.5 * x * (1.0 + erf(x * 0.70710678118654752));
    case GEMM_ACT_GELU_TANH: return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    case GEMM_ACT_SILU: return x / (1.0 + exp(-x));
    default: return x;
    }
}

double gemm_act_grad_f64(int act, double x) {
    switch (act) {
    case GEMM_ACT_RELU: return x > 0.0 ? 1.0 : 0.0;
    case GEMM_ACT_GELU:
        return 0.5 * (1.0 + erf(x * 0.70710678118654752)) + x * exp(-0.5 * x * x) * 0.3989422804014327;
    case GEMM_ACT_GELU_TANH: {
        double k = 0.7978845608028654, t = tanh(k * (x + 0.044715 * x * x * x));
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
    }
    case GEMM_ACT_SILU: {
        double s = 1.0 / (1.0 + exp(-x));
        return s * (1.0 + x * (1.0 - s));
    }
    default: return 1.0;
    }
}

void gemm_ref_f64(int64_t m, int64_t n, int64_t kdim, const double *a, int64_t rsa, int64_t csa,
                  const double *b, int64_t rsb, int64_t csb, double *c, int64_t rsc, double beta,
                  const double *bias, int64_t bias_stride, int bias_kind, int act, double *preact, int64_t rsp) {
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n; j++) {
            double v = 0;
            for (int64_t p = 0; p < kdim; p++) v += a[i * rsa + p * csa] * b[p * rsb + j * csb];
            if (beta != 0.0) v += beta * c[i * rsc + j];
            if (bias_kind == GEMM_BIAS_ROW) v += bias[j * bias_stride];
            if (bias_kind == GEMM_BIAS_COL) v += bias[i * bias_stride];
            if (preact) preact[i * rsp + j] = v;
            c[i * rsc + j] = act_f64(act, v);
        }
    }
}

static void act_grad_ref(float *out, const float *g, const float *pre, int64_t n, int act) {
    for (int64_t i = 0; i < n; i++) out[i] = g[i] * gemm_act_grad_f32(act, pre[i]);
}

typedef struct rows_job {
    const gemm_kernels *k;
    opf_dtype dt;
    void *out;
    const void *g, *pre;
    int64_t rso, rsg, rsp, n;
    int act;
    float *db;
    int beta;
    int64_t m;
} rows_job;

enum { BLOCK16 = 256 }; /* 16-bit rows are converted this many elements at a time */

/* rows [i0, i1) x columns [c0, c1) of g' = g * act'(pre); with j->db also
 * db[c] = sum over the rows of g' as stored (16-bit: the rounded values), in
 * row order as gemm_colsum sums */
static void act_grad_block(const rows_job *j, int64_t i0, int64_t i1, int64_t c0, int64_t c1) {
    const int64_t es = opf_dtype_size(j->dt);
    float *db = j->db;
    for (int64_t c = c0; db && c < c1; c++) db[c] = 0.0f;
    for (int64_t i = i0; i < i1; i++) {
        const char *g = (const char *)j->g + i * j->rsg * es, *pre = (const char *)j->pre + i * j->rsp * es;
        char *out = (char *)j->out + i * j->rso * es;
        if (j->dt == OPF_F32) {
            float *o = (float *)out;
            j->k->act_grad(o + c0, (const float *)g + c0, (const float *)pre + c0, c1 - c0, j->act);
            for (int64_t c = c0; db && c < c1; c++) db[c] += o[c];
            continue;
        }
        float gb[BLOCK16], pb[BLOCK16];
        for (int64_t c = c0; c < c1; c += BLOCK16) {
            int64_t len = c1 - c < BLOCK16 ? c1 - c : BLOCK16;
            j->k->to_f32(gb, (const uint16_t *)g + c, j->dt, len);
            j->k->to_f32(pb, (const uint16_t *)pre + c, j->dt, len);
            j->k->act_grad(gb, gb, pb, len, j->act);
            j->k->from_f32((uint16_t *)out + c, gb, j->dt, len);
            if (!db) continue;
            j->k->to_f32(gb, (const uint16_t *)out + c, j->dt, len);
            for (int64_t e = 0; e < len; e++) db[c + e] += gb[e];
        }
    }
}

static void act_grad_rows_range(int64_t begin, int64_t end, void *ctx) {
    const rows_job *j = ctx;
    act_grad_block(j, begin, end, 0, j->n);
}

static void act_grad_cols_range(int64_t begin, int64_t end, void *ctx) {
    const rows_job *j = ctx;
    act_grad_block(j, 0, j->m, begin, end);
}

void gemm_act_grad_rows(const gemm_kernels *k, opf_dtype dt, void *out, int64_t rso, const void *g, int64_t rsg,
                        const void *pre, int64_t rsp, int64_t m, int64_t n, int act, float *db) {
    rows_job j = {.k = k, .dt = dt, .out = out, .g = g, .pre = pre, .rso = rso, .rsg = rsg, .rsp = rsp, .n = n,
                  .act = act, .db = db, .m = m};
    if (db && n >= 256 * opf_num_threads()) { /* threads split the columns: each sums its own */
        opf_parallel_for(0, n, 256, act_grad_cols_range, &j);
        return;
    }
    j.db = NULL; /* too few columns for every thread: rows, then the sums */
    opf_parallel_for(0, m, n > 0 ? 1 + 32768 / n : 1, act_grad_rows_range, &j);
    if (db) gemm_colsum(k, db, out, dt, rso, m, n, 0);
}

static void colsum_range(int64_t begin, int64_t end, void *ctx) {
    const rows_job *j = ctx;
    for (int64_t c = begin; c < end; c++) j->db[c] = j->beta ? j->db[c] : 0.0f;
    if (j->dt == OPF_F32) {
        const float *g = j->g;
        for (int64_t i = 0; i < j->m; i++) /* row by row: unit-stride reads of g */
            for (int64_t c = begin; c < end; c++) j->db[c] += g[i * j->rsg + c];
        return;
    }
    float row[BLOCK16];
    for (int64_t c0 = begin; c0 < end; c0 += BLOCK16) {
        int64_t len = end - c0 < BLOCK16 ? end - c0 : BLOCK16;
        for (int64_t i = 0; i < j->m; i++) {
            j->k->to_f32(row, (const uint16_t *)j->g + i * j->rsg + c0, j->dt, len);
            for (int64_t c = 0; c < len; c++) j->db[c0 + c] += row[c];
        }
    }
}

void gemm_colsum(const gemm_kernels *k, float *db, const void *g, opf_dtype dt, int64_t rsg, int64_t m, int64_t n,
                 int beta) {
    rows_job j = {.k = k, .dt = dt, .g = g, .rsg = rsg, .m = m, .n = n, .db = db, .beta = beta};
    opf_parallel_for(0, n, 256, colsum_range, &j);
}

static void to_f32_ref(float *dst, const uint16_t *src, int dt, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = dt == OPF_BF16 ? opf_bf16_to_f32(src[i]) : opf_f16_to_f32(src[i]);
}

static void from_f32_ref(uint16_t *dst, const float *src, int dt, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = dt == OPF_BF16 ? opf_f32_to_bf16(src[i]) : opf_f32_to_f16(src[i]);
}

/* ---- scalar micro-kernel (4 x 4) ------------------------------------------------------ */

static void ukernel_ref_4x4(int64_t kc, const float *ap, const float *bp, float *c, int64_t rsc, int m,
                            int n, const gemm_tile *t) {
    float acc[16] = {0};
    for (int64_t p = 0; p < kc; p++, ap += 4, bp += 4)
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) acc[i * 4 + j] += ap[i] * bp[j];
    gemm_tile_store(acc, 4, c, rsc, m, n, t);
}

const gemm_kernels gemm_kernels_ref = {.name = "ref_4x4", .mr = 4, .nr = 4, .mc = 64, .kc = 256, .nc = 1024,
                                       .ukernel = ukernel_ref_4x4, .act_grad = act_grad_ref, .to_f32 = to_f32_ref,
                                       .from_f32 = from_f32_ref};

extern const gemm_kernels gemm_kernels_avx2 __attribute__((weak));
extern const gemm_kernels gemm_kernels_avx512 __attribute__((weak));
extern const gemm_kernels gemm_kernels_avx512_bf16 __attribute__((weak));
extern const gemm_kernels gemm_kernels_amx __attribute__((weak));

const gemm_kernels *gemm_kernels_for(opf_isa isa) {
    if (isa >= OPF_ISA_AMX && &gemm_kernels_amx) return &gemm_kernels_amx;
    if (isa >= OPF_ISA_AVX512_BF16 && &gemm_kernels_avx512_bf16) return &gemm_kernels_avx512_bf16;
    if (isa >= OPF_ISA_AVX512 && &gemm_kernels_avx512) return &gemm_kernels_avx512;
    if (isa >= OPF_ISA_AVX2 && &gemm_kernels_avx2) return &gemm_kernels_avx2;
    return &gemm_kernels_ref;
}

/* ---- conversions and packing -------------------------------------------------------------- */

static inline float load_elem(const void *p, int64_t i, opf_dtype dt) { return (float)opf_load_elem(p, i, dt); }

static inline const void *elem_ptr(const void *p, int64_t i, opf_dtype dt) {
    return (const char *)p + i * (int64_t)opf_dtype_size(dt);
}

typedef struct convert_job {
    const gemm_kernels *k;
    void *dst;
    const void *src;
    int dt, to_f32;
} convert_job;

static void convert_range(int64_t begin, int64_t end, void *ctx) {
    const convert_job *j = ctx;
    if (j->to_f32)
        j->k->to_f32((float *)j->dst + begin, (const uint16_t *)j->src + begin, j->dt, end - begin);
    else
        j->k->from_f32((uint16_t *)j->dst + begin, (const float *)j->src + begin, j->dt, end - begin);
}

void gemm_load_f32(const gemm_kernels *k, float *dst, const void *src, opf_dtype dt, int64_t n, int64_t stride) {
    if (dt != OPF_F32 && stride == 1) {
        convert_job j = {k, dst, src, dt, 1};
        opf_parallel_for(0, n, 1 << 16, convert_range, &j);
        return;
    }
    for (int64_t i = 0; i < n; i++) dst[i] = load_elem(src, i * stride, dt);
}

void gemm_store_f32(const gemm_kernels *k, void *dst, opf_dtype dt, const float *src, int64_t n) {
    if (dt == OPF_F32) {
        for (int64_t i = 0; i < n; i++) ((float *)dst)[i] = src[i];
        return;
    }
    convert_job j = {k, dst, src, dt, 0};
    opf_parallel_for(0, n, 1 << 16, convert_range, &j);
}

/* dst[p*w + r] = src[r*rs + p] (rows along K, contiguous), zero for rows <= r < w.
 * K goes in blocks of 64: the part of dst being written stays in L1 while each
 * row is read along K; a whole-K pass per row would miss L1 on every store,
 * and reading the rows side by side (rows often 4 KiB apart) thrashes L1 sets. */
static void pack_rows_f32(float *dst, const float *src, int64_t rs, int64_t rows, int64_t kc, int w) {
    enum { PB = 64 };
    for (int64_t p0 = 0; p0 < kc; p0 += PB) {
        int64_t pe = kc - p0 < PB ? kc : p0 + PB;
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
 * kc -> dst[p*w + r] as float32, zero past rows. A packs its rows (w = MR), B
 * its columns (w = NR: rs is B's column stride, cs its row stride), as
 * pack_pairs does for bfloat16 pairs. */
static void pack_sliver(const gemm_kernels *k, float *dst, const void *src, opf_dtype dt, int64_t rs, int64_t cs,
                        int64_t rows, int64_t kc, int w) {
    if (cs == 1 && dt == OPF_F32) { /* rows along K: A, or nn.Linear's weight as B */
        pack_rows_f32(dst, src, rs, rows, kc, w);
        return;
    }
    if (cs == 1 && kc <= 1024) { /* 16-bit rows along K: vector conversion, then interleave */
        float row[1024];
        for (int r = 0; r < w; r++) {
            if (r < rows) k->to_f32(row, (const uint16_t *)src + r * rs, dt, kc);
            for (int64_t p = 0; p < kc; p++) dst[p * w + r] = r < rows ? row[p] : 0.0f;
        }
        return;
    }
    if (rs == 1 && rows == w && dt != OPF_F32) { /* a full 16-bit line of w per K step (float32: pack_lines_f32) */
        for (int64_t p = 0; p < kc; p++) k->to_f32(dst + p * w, (const uint16_t *)src + p * cs, dt, w);
        return;
    }
    if (dt == OPF_F32) {
        const float *a = src;
        for (int64_t p = 0; p < kc; p++)
            for (int r = 0; r < w; r++) dst[p * w + r] = r < rows ? a[r * rs + p * cs] : 0.0f;
        return;
    }
    for (int64_t p = 0; p < kc; p++)
        for (int r = 0; r < w; r++) dst[p * w + r] = r < rows ? load_elem(src, r * rs + p * cs, dt) : 0.0f;
}

/* bfloat16 bits of element i of a bfloat16 or float32 array */
static inline uint32_t bf16_bits(const void *p, int64_t i, opf_dtype dt) {
    return dt == OPF_BF16 ? ((const uint16_t *)p)[i] : opf_f32_to_bf16(((const float *)p)[i]);
}

/* Rows [0, rows) of a (row stride rs, K stride cs; bfloat16 or float32) over
 * a K slice of kc -> dst[p*w + r] = a(r, 2p) | a(r, 2p+1) << 16, zero past
 * rows and past kc. A packs its rows (w = MR), B its columns (w = NR: rs is
 * B's column stride, cs its row stride). */
static void pack_pairs(uint32_t *dst, const void *a, opf_dtype dt, int64_t rs, int64_t cs, int64_t rows, int64_t kc,
                       int w) {
    const int64_t kp = (kc + 1) / 2, full = kc / 2;
    if (dt == OPF_BF16 && cs == 1 && rows == w && w % 4 == 0 && rs % 2 == 0 && (uintptr_t)a % 4 == 0) {
        /* full pairs are 32-bit words along 4-byte aligned rows: pack_rows_f32's 4 x 4 transposes move them
         * bit for bit (as floats, never computed on); an odd K's last pair alone */
        pack_rows_f32((float *)dst, (const float *)a, rs / 2, rows, full, w);
        for (int r = 0; kp > full && r < w; r++) dst[full * w + r] = ((const uint16_t *)a)[r * rs + kc - 1];
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
                for (int64_t p = p0; p < fe; p++) dst[p * w + r] = (uint32_t)row[2 * p] | (uint32_t)row[2 * p + 1] << 16;
                if (pe > full) dst[full * w + r] = row[kc - 1];
            }
        }
        return;
    }
    for (int64_t p = 0; p < kp; p++)
        for (int r = 0; r < w; r++) {
            uint32_t lo = r < rows ? bf16_bits(a, r * rs + 2 * p * cs, dt) : 0;
            uint32_t hi = r < rows && 2 * p + 1 < kc ? bf16_bits(a, r * rs + (2 * p + 1) * cs, dt) : 0;
            dst[p * w + r] = lo | hi << 16;
        }
}

/* ---- driver ------------------------------------------------------------------------------- */

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* How a product is split: MC-row blocks (at most the ISA's MC, as many as a
 * multiple of the threads so each thread gets equal ones), and whether each
 * worker packs its own blocks of A (enough blocks for every thread: the block
 * stays in that core's L2, and the workspace holds one block per worker) or
 * A is packed whole and shared by column tasks (few, short blocks). */
typedef struct gemm_plan {
    int64_t threads;           /* the thread count the plan is for */
    int64_t mc;                /* rows of the largest block */
    int64_t slivers, mblocks;  /* block b: MR-row slivers [slivers * b / mblocks, slivers * (b + 1) / mblocks) */
    int64_t workers, kc_max;
    int own_a;
} gemm_plan;

static gemm_plan plan_for(const gemm_kernels *k, int64_t m, int64_t kdim, int64_t threads) {
    gemm_plan p = {.threads = threads};
    p.kc_max = kdim < k->kc ? kdim : k->kc;
    if (k->tile_pairs) p.kc_max = round_up(p.kc_max, k->tile_pairs); /* zero pairs up to a whole tile */
    p.slivers = (m + k->mr - 1) / k->mr;
    p.mblocks = round_up((m + k->mc - 1) / k->mc, threads);
    if (p.mblocks > p.slivers) p.mblocks = p.slivers;
    p.mc = (p.slivers + p.mblocks - 1) / p.mblocks * k->mr;
    p.own_a = p.mblocks >= 2 * threads;
    p.workers = p.mblocks < threads ? p.mblocks : threads;
    return p;
}

/* Where the packed operands go: A's region (the whole of A, or one block per
 * worker) at the start, then one KC x NC panel of B. The one statement of the
 * workspace a plan carves: gemm_workspace_floats sizes with it, gemm_f32x
 * carves with it and checks the total against what it was given. */
typedef struct gemm_layout {
    int64_t b_offset, floats;
} gemm_layout;

static gemm_layout layout_for(const gemm_kernels *k, const gemm_plan *p, int64_t m, int64_t n) {
    int64_t nc = n < k->nc ? n : k->nc;
    gemm_layout l;
    l.b_offset = (p->own_a ? p->workers * p->mc : round_up(m, k->mr)) * p->kc_max;
    l.floats = l.b_offset + round_up(nc, k->nr) * p->kc_max;
    return l;
}

static int use_pairs(const gemm_kernels *k, opf_dtype ta, opf_dtype tb) {
    return k->ukernel_pairs && (ta == OPF_BF16 || tb == OPF_BF16) && ta != OPF_F16 && tb != OPF_F16;
}

/* a pair takes one float's room in the workspace: a slice of pairs is twice as deep */
int64_t gemm_slice_depth(const gemm_kernels *k, opf_dtype ta, opf_dtype tb) {
    return use_pairs(k, ta, tb) ? 2 * k->kc : k->kc;
}

int64_t gemm_workspace_floats(const gemm_kernels *k, int64_t m, int64_t n, int64_t kdim) {
    if (m <= 0 || n <= 0 || kdim <= 0) return 0;
    gemm_plan p = plan_for(k, m, kdim, opf_num_threads());
    int64_t floats = layout_for(k, &p, m, n).floats;
    if (k->f32) { /* either table may run: room for the larger */
        int64_t other = gemm_workspace_floats(k->f32, m, n, kdim);
        if (other > floats) floats = other;
    }
    return floats;
}

typedef struct gemm_job {
    const gemm_kernels *k;
    const gemm_epilogue *ep;
    int64_t m, nc, kc, jc, pc, kdim;
    const void *a, *b;
    opf_dtype ta, tb;
    int64_t rsa, csa, rsb, csb, rsc;
    float *c, *ap, *bp;
    gemm_plan plan;
    int64_t ntn; /* column chunks per row block in the compute phase (1 when plan.own_a) */
    int pairs;   /* packed as bfloat16 pairs for k->ukernel_pairs */
    int64_t kp;  /* packed depth of the K slice: kc, or its pairs */
} gemm_job;

/* Float32 lines along the slivers' rows (rs == 1: B as stored, or a
 * transposed A): slivers [0, ceil(rows / w)) of the K slice at once, K step
 * outermost. Each step reads one run of `rows` adjacent floats; sliver by
 * sliver it would be w floats from every K line, lines that are often a
 * multiple of 4 KiB apart, where the hardware prefetchers do not follow. */
static void pack_lines_f32(float *dst, const float *src, int64_t cs, int64_t rows, int64_t kc, int w) {
    enum { AHEAD = 8 }; /* K lines fetched ahead */
    const int64_t slivers = (rows + w - 1) / w;
    for (int64_t p = 0; p < kc; p++) {
        const float *line = src + p * cs;
        if (p + AHEAD < kc)
            for (int64_t r = 0; r < rows; r += 16) __builtin_prefetch(line + AHEAD * cs + r);
        for (int64_t s = 0; s < slivers; s++) {
            float *d = dst + s * w * kc + p * w;
            const float *l = line + s * w;
            int64_t n = rows - s * w < w ? rows - s * w : w;
            for (int r = 0; r < n; r++) d[r] = l[r];
            for (int r = (int)n; r < w; r++) d[r] = 0.0f;
        }
    }
}

/* Pairs [kp, kps) of each of `slivers` slivers (stride w * kps): zero */
static void zero_pairs(uint32_t *dst, int64_t slivers, int w, int64_t kp, int64_t kps) {
    for (int64_t s = 0; kp < kps && s < slivers; s++) memset(dst + s * w * kps + kp * w, 0, sizeof(uint32_t) * w * (kps - kp));
}

/* The same for bfloat16 pairs (pack_pairs' layout) from bfloat16 or float32
 * lines: K lines 2p and 2p + 1 are read side by side, one run of `rows`
 * each, and interleaved into the slivers; zero past kc, and pairs [kp, kps)
 * zero where the sliver stride w * kps is deeper (tile_pairs). */
static void pack_lines_pairs(uint32_t *dst, const void *src, opf_dtype dt, int64_t cs, int64_t rows, int64_t kc,
                             int w, int64_t kps) {
    enum { AHEAD = 4 }; /* pairs of K lines fetched ahead */
    const int64_t slivers = (rows + w - 1) / w, kp = (kc + 1) / 2, es = opf_dtype_size(dt);
    for (int64_t p = 0; p < kp; p++) {
        const char *lo = (const char *)src + 2 * p * cs * es, *hi = lo + cs * es;
        const int odd = 2 * p + 1 == kc;
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

/* Slivers of `rows` rows of an operand (row stride rs, K stride cs) over the
 * K slice, w rows each (the last zero padded), into dst: sliver s at
 * dst + s * w * kp, float32 or pairs */
static void pack_slivers(const gemm_job *j, float *dst, const void *src, opf_dtype dt, int64_t rs, int64_t cs,
                         int64_t rows, int w) {
    if (rs == 1 && cs != 1 && (j->pairs || dt == OPF_F32)) { /* pairs come from bfloat16 or float32 */
        if (j->pairs) pack_lines_pairs((uint32_t *)dst, src, dt, cs, rows, j->kc, w, j->kp);
        else pack_lines_f32(dst, src, cs, rows, j->kc, w);
        return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += w) {
        const void *s0 = elem_ptr(src, r0 * rs, dt);
        int64_t n = rows - r0 < w ? rows - r0 : w;
        float *d = dst + r0 / w * w * j->kp;
        if (j->pairs) {
            pack_pairs((uint32_t *)d, s0, dt, rs, cs, n, j->kc, w);
            zero_pairs((uint32_t *)d, 1, w, (j->kc + 1) / 2, j->kp);
        } else {
            pack_sliver(j->k, d, s0, dt, rs, cs, n, j->kc, w);
        }
    }
}

/* A's slivers for a tile pair kernel (gemm_kernels.tile_pairs), a block of
 * tp pairs at a time (row r: its tp pairs side by side). bfloat16 rows along
 * K are already in that order: a copy per row. Otherwise the block is packed
 * as pack_slivers packs a slice of 2 tp, then transposed into tile rows. */
static void pack_tile_rows(const gemm_job *j, float *dst, const void *src, opf_dtype dt, int64_t rs, int64_t cs,
                           int64_t rows) {
    enum { TP_MAX = 16, MR_MAX = 32 };
    const int w = j->k->mr, tp = j->k->tile_pairs;
    uint32_t blk[TP_MAX * MR_MAX];
    if (w > MR_MAX || tp > TP_MAX) abort(); /* a table this scratch was not sized for */
    for (int64_t r0 = 0; r0 < rows; r0 += w) {
        int64_t n = rows - r0 < w ? rows - r0 : w;
        uint32_t *d = (uint32_t *)dst + r0 / w * w * j->kp;
        for (int64_t p0 = 0; p0 < j->kp; p0 += tp, d += w * tp) {
            int64_t k0 = 2 * p0, kc = j->kc - k0 < 2 * tp ? j->kc - k0 : 2 * tp;
            if (dt == OPF_BF16 && cs == 1 && kc == 2 * tp) { /* bfloat16 rows along K: a tile row is a copy */
                for (int r = 0; r < w; r++) {
                    if (r < n) memcpy(d + r * tp, (const uint16_t *)src + (r0 + r) * rs + k0, sizeof(uint32_t) * tp);
                    else memset(d + r * tp, 0, sizeof(uint32_t) * tp);
                }
                continue;
            }
            memset(blk, 0, sizeof(uint32_t) * w * tp);
            if (kc > 0) {
                const void *s0 = elem_ptr(src, r0 * rs + k0 * cs, dt);
                if (rs == 1 && cs != 1) pack_lines_pairs(blk, s0, dt, cs, n, kc, w, tp);
                else pack_pairs(blk, s0, dt, rs, cs, n, kc, w);
            }
            for (int r = 0; r < w; r++)
                for (int q = 0; q < tp; q++) d[r * tp + q] = blk[q * w + r];
        }
    }
}

/* A slivers [begin, end) of the K slice into dst (sliver s at (s - base) * mr * kc) */
static void pack_a_slivers(const gemm_job *j, float *dst, int64_t base, int64_t begin, int64_t end) {
    const int mr = j->k->mr;
    int64_t i0 = begin * mr, i1 = end * mr < j->m ? end * mr : j->m;
    const void *src = elem_ptr(j->a, i0 * j->rsa + j->pc * j->csa, j->ta);
    if (j->pairs && j->k->tile_pairs) pack_tile_rows(j, dst + (begin - base) * mr * j->kp, src, j->ta, j->rsa, j->csa, i1 - i0);
    else pack_slivers(j, dst + (begin - base) * mr * j->kp, src, j->ta, j->rsa, j->csa, i1 - i0, mr);
}

static void pack_a_range(int64_t begin, int64_t end, void *ctx) {
    const gemm_job *j = ctx;
    pack_a_slivers(j, j->ap, 0, begin, end);
}

static void pack_b_range(int64_t begin, int64_t end, void *ctx) { /* B's columns are the slivers' rows */
    const gemm_job *j = ctx;
    const int nr = j->k->nr;
    int64_t j0 = begin * nr, j1 = end * nr < j->nc ? end * nr : j->nc;
    pack_slivers(j, j->bp + begin * nr * j->kp, elem_ptr(j->b, j->pc * j->rsb + (j->jc + j0) * j->csb, j->tb), j->tb,
                 j->csb, j->rsb, j1 - j0, nr);
}

/* Task t: a row block and a column chunk of the panel. Blocks of its own A:
 * one chunk (the whole panel). Shared A: the tasks of one column chunk are
 * consecutive, so a worker's share is whole column chunks across all rows
 * when the tasks divide evenly (balanced even when M is a few blocks). */
static void compute_task(const gemm_job *j, int64_t t, float *own_a) {
    const gemm_kernels *k = j->k;
    const gemm_epilogue *ep = j->ep;
    const int first = j->pc == 0, last = j->pc + j->kc >= j->kdim;
    int64_t slivers = (j->nc + k->nr - 1) / k->nr, mb = j->plan.mblocks;
    int64_t ib = t % mb, jn = t / mb;
    int64_t i_lo = j->plan.slivers * ib / mb * k->mr, i_hi = j->plan.slivers * (ib + 1) / mb * k->mr;
    if (i_hi > j->m) i_hi = j->m;
    const float *ap = j->ap + (i_lo / k->mr) * k->mr * j->kp; /* the shared, whole-A packing */
    if (own_a) { /* this worker alone uses the block: pack it here, where it stays in L2 */
        pack_a_slivers(j, own_a, i_lo / k->mr, i_lo / k->mr, (i_hi + k->mr - 1) / k->mr);
        ap = own_a;
    }
    int64_t s_lo = slivers * jn / j->ntn, s_hi = slivers * (jn + 1) / j->ntn;
    for (int64_t s = s_lo; s < s_hi; s++) { /* B sliver stays in cache across the rows */
        int64_t jj = s * k->nr, n = j->nc - jj < k->nr ? j->nc - jj : k->nr, col = j->jc + jj;
        for (int64_t i = i_lo; i < i_hi; i += k->mr) {
            int m = (int)(i_hi - i < k->mr ? i_hi - i : k->mr);
            gemm_tile t_ = {
                .load_c = !first || ep->beta != 0.0f,
                .beta = first ? ep->beta : 1.0f,
                .bias_n = last && ep->bias_kind == GEMM_BIAS_ROW ? ep->bias + col : NULL,
                .bias_m = last && ep->bias_kind == GEMM_BIAS_COL ? ep->bias + i : NULL,
                .act = last ? ep->act : GEMM_ACT_NONE,
                .pre = last && ep->preact ? ep->preact + i * ep->rsp + col : NULL,
                .rsp = ep->rsp,
                .c16 = last && ep->out16 ? (uint16_t *)ep->out16 + i * j->rsc + col : NULL,
                .pre16 = last && ep->pre16 ? (uint16_t *)ep->pre16 + i * ep->rsp + col : NULL,
                .dt16 = ep->out_dt,
            };
            const float *as = ap + ((i - i_lo) / k->mr) * k->mr * j->kp, *bs = j->bp + s * k->nr * j->kp;
            float *cs = j->c ? j->c + i * j->rsc + col : NULL; /* NULL: one slice into out16 */
            if (j->pairs) k->ukernel_pairs(j->kp, (const uint32_t *)as, (const uint32_t *)bs, cs, j->rsc, m, (int)n, &t_);
            else k->ukernel(j->kc, as, bs, cs, j->rsc, m, (int)n, &t_);
        }
    }
}

/* Workers [w0, w1): worker w runs an equal share of the tasks, packing A
 * blocks into its own slot of the workspace when the plan says so. */
static void compute_workers(int64_t w0, int64_t w1, void *ctx) {
    const gemm_job *j = ctx;
    int64_t tasks = j->plan.mblocks * j->ntn, workers = j->plan.workers;
    for (int64_t w = w0; w < w1; w++) {
        float *own_a = j->plan.own_a ? j->ap + w * j->plan.mc * j->kp : NULL;
        for (int64_t t = tasks * w / workers; t < tasks * (w + 1) / workers; t++) compute_task(j, t, own_a);
    }
    if (j->k->release) j->k->release();
}

int gemm_f32(const gemm_kernels *k, int64_t m, int64_t n, int64_t kdim, const float *a, int64_t rsa,
             int64_t csa, const float *b, int64_t rsb, int64_t csb, float *c, int64_t rsc,
             const gemm_epilogue *ep, float *workspace, int64_t ws_floats) {
    return gemm_f32x(k, m, n, kdim, a, OPF_F32, rsa, csa, b, OPF_F32, rsb, csb, c, rsc, ep, workspace, ws_floats);
}

int gemm_f32x(const gemm_kernels *k, int64_t m, int64_t n, int64_t kdim, const void *a, opf_dtype ta,
              int64_t rsa, int64_t csa, const void *b, opf_dtype tb, int64_t rsb, int64_t csb, float *c,
              int64_t rsc, const gemm_epilogue *ep, float *workspace, int64_t ws_floats) {
    if (m <= 0 || n <= 0) return 0;
    if (k->f32 && !use_pairs(k, ta, tb)) k = k->f32;
    if (kdim <= 0) { /* empty sum: the epilogue alone */
        gemm_ref_f32(m, n, 0, NULL, 0, 0, NULL, 0, 0, c, rsc, ep);
        return 0;
    }
    gemm_plan plan = plan_for(k, m, kdim, opf_num_threads());
    gemm_layout lay = layout_for(k, &plan, m, n);
    if (lay.floats > ws_floats) {
        /* sized while fewer threads were set? One worker's plan never needs more than a plan for
         * more threads (its blocks are at most `threads` times larger, and there is one of them) */
        plan = plan_for(k, m, kdim, 1);
        lay = layout_for(k, &plan, m, n);
        if (lay.floats > ws_floats) return -1; /* a caller that sized for another product */
    }
    gemm_job j = {.k = k, .ep = ep, .m = m, .kdim = kdim, .a = a, .b = b, .ta = ta, .tb = tb, .rsa = rsa, .csa = csa,
                  .rsb = rsb, .csb = csb, .rsc = rsc, .c = c, .ap = workspace, .bp = workspace + lay.b_offset,
                  .plan = plan};
    j.pairs = use_pairs(k, ta, tb);
    const int64_t depth = gemm_slice_depth(k, ta, tb);
    int64_t threads = plan.threads, mslivers = (m + k->mr - 1) / k->mr;
    for (int64_t jc = 0; jc < n; jc += k->nc) {
        j.jc = jc;
        j.nc = n - jc < k->nc ? n - jc : k->nc;
        int64_t nslivers = (j.nc + k->nr - 1) / k->nr;
        /* enough column chunks that every thread has work when M is small */
        j.ntn = plan.own_a ? 1 : (2 * threads + plan.mblocks - 1) / plan.mblocks;
        if (j.ntn > nslivers) j.ntn = nslivers;
        /* (with own_a this is plan.workers: ntn = 1 and mblocks >= 2 threads) */
        j.plan.workers = plan.mblocks * j.ntn < threads ? plan.mblocks * j.ntn : threads;
        for (int64_t pc = 0; pc < kdim; pc += depth) {
            j.pc = pc;
            j.kc = kdim - pc < depth ? kdim - pc : depth;
            j.kp = j.pairs ? (j.kc + 1) / 2 : j.kc;
            if (j.pairs && k->tile_pairs) j.kp = round_up(j.kp, k->tile_pairs);
            opf_parallel_for(0, nslivers, 16, pack_b_range, &j);
            if (!plan.own_a) opf_parallel_for(0, mslivers, 16, pack_a_range, &j); /* blocks shared by tasks */
            opf_parallel_for(0, j.plan.workers, 1, compute_workers, &j);
        }
    }
    return 0;
}
