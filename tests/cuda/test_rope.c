/*
 * The CUDA kernel of rope (csrc/cuda/rope.cu), run on the CPU over
 * tests/emu/cuda_emu.h, against the C reference (rope_run with the reference
 * row kernels): every dtype, both conventions, forward and backward (the
 * transpose), cos / sin per batch, broadcast or picked by position ids,
 * grouped-query heads, head_dim D with rotary dims R = D and R < D (partial
 * rotary), q read in place from a (B, N, H, D) layout (the vector kernels) or
 * one element off, with an inner stride of 2, or with cos / sin at a stride of
 * 2 (the scalar kernel), rows longer than a block, ids outside the table (NaN
 * rows, nothing else touched) and empty shapes. The GPU rounds each product
 * and sum as the CPU does, so every dtype must match bit for bit. The
 * emulated launch caps the grid at a few blocks, so the grid-stride loop runs
 * too.
 */
#include <math.h>
#include <string.h>

#include "../../csrc/cuda/rope.h"
#include "../../csrc/kernels/rope.h"
#include "../c/check.h"

static const char *const DT_NAME[] = {"float32", "float64", "bfloat16", "float16"};

enum { B = 2, HQ = 3, HK = 1, P = 40 };
enum { LAYOUT_BNHD = 0, LAYOUT_OFFSET, LAYOUT_INNER2, LAYOUT_TABLE2 };
static const char *const LAYOUT_NAME[] = {"(B,N,H,D) view", "one element off", "inner stride 2", "cos stride 2"};

static void fill(opf_dtype dt, void *p, int64_t n, unsigned long long seed) {
    for (int64_t i = 0; i < n; i++) opf_store_elem(p, i, dt, check_uniform(&seed) * 2.0 - 1.0);
}

typedef struct rope_case {
    int64_t n, d, r;
    int interleaved, inverse, by_pos, cos_batch, layout;
    int bad_pos; /* with by_pos: one id past the table, one negative */
} rope_case;

/* q and k rotated by the kernel and by the reference; every element of the outputs compared bit for
 * bit (NaN for NaN at a bad id's position) */
static void run_case(opf_dtype dt, rope_case L) {
    const int64_t n = L.n, d = L.d, r = L.r, es = (int64_t)opf_dtype_size(dt);
    const int64_t xst = L.layout == LAYOUT_INNER2 ? 2 : 1, off = L.layout == LAYOUT_OFFSET ? 1 : 0;
    const int64_t tst = L.layout == LAYOUT_TABLE2 ? 2 : 1;
    /* q stored as (B, N, HQ, D) (inner stride xst) and read as (B, HQ, N, D); k contiguous (B, HK, N, D) */
    const int64_t nq = B * HQ * n * d, nk = B * HK * n * d, rows = L.by_pos ? P : B * n;
    char *q = calloc((size_t)(nq * xst + off + 1), (size_t)es), *kk = calloc((size_t)(nk + off + 1), (size_t)es);
    char *oq = malloc((size_t)(nq + 1) * es), *ok = malloc((size_t)(nk + 1) * es);
    char *rq = malloc((size_t)(nq + 1) * es), *rk = malloc((size_t)(nk + 1) * es);
    char *c = calloc((size_t)(rows * r * tst + 1), (size_t)es), *s = calloc((size_t)(rows * r * tst + 1), (size_t)es);
    int64_t pos[B * 64];
    unsigned long long seed = 77;
    fill(dt, q, nq * xst + off, 1 + (unsigned long long)(n * d));
    fill(dt, kk, nk + off, 2 + (unsigned long long)(n * d));
    fill(dt, c, rows * r * tst, 3);
    fill(dt, s, rows * r * tst, 4);
    for (int64_t i = 0; i < B * n; i++) pos[i] = (int64_t)(check_uniform(&seed) * P) % P;
    if (L.bad_pos && n >= 3) pos[1] = P, pos[n + 2] = -1;
    for (int64_t i = 0; i <= nq; i++) opf_store_elem(oq, i, dt, 7.0), opf_store_elem(rq, i, dt, 7.0);
    for (int64_t i = 0; i <= nk; i++) opf_store_elem(ok, i, dt, 7.0), opf_store_elem(rk, i, dt, 7.0);
    const int64_t cb = L.by_pos ? 0 : L.cos_batch ? n * r * tst : 0;
    rope_cuda_problem p = {.b = B,
                           .hq = HQ,
                           .hk = HK,
                           .n = n,
                           .d = d,
                           .r = r,
                           .interleaved = L.interleaved,
                           .inverse = L.inverse,
                           .q = q + off * es,
                           .k = kk + off * es,
                           .cos = c,
                           .sin = s,
                           .oq = oq,
                           .ok = ok,
                           .pos = L.by_pos ? pos : NULL,
                           .table_rows = P,
                           .qs = {n * HQ * d * xst, d * xst, HQ * d * xst, xst},
                           .ks = {HK * n * d, n * d, d, 1},
                           .oqs = {n * HQ * d, d, HQ * d, 1},
                           .oks = {HK * n * d, n * d, d, 1},
                           .cb = cb,
                           .cn = r * tst,
                           .cr = tst,
                           .sb = cb,
                           .sn = r * tst,
                           .sr = tst,
                           .pb = n,
                           .pn = 1};
    const int want_vec = L.layout == LAYOUT_BNHD && (L.interleaved ? r : r / 2) % (16 / es) == 0 && d % (16 / es) == 0;
    CHECK(rope_cuda_vector(dt, &p) == want_vec, "%s D=%lld R=%lld inter=%d %s: the %s kernel expected", DT_NAME[dt],
          (long long)d, (long long)r, L.interleaved, LAYOUT_NAME[L.layout], want_vec ? "vector" : "scalar");
    unsigned grid = rope_cuda(dt, &p, NULL);
    CHECK((grid == 0) == (B * n == 0), "blocks launched for N=%lld: %u", (long long)n, grid);

    /* the reference, position by position where ids may be bad (it would read outside the table) */
    rope_problem pr = {.dt = dt,
                       .b = 1,
                       .hq = HQ,
                       .hk = HK,
                       .n = 1,
                       .d = d,
                       .r = r,
                       .interleaved = L.interleaved,
                       .inverse = L.inverse,
                       .qs = {0, p.qs[1], 0, p.qs[3]},
                       .ks = {0, p.ks[1], 0, p.ks[3]},
                       .oqs = {0, p.oqs[1], 0, 1},
                       .oks = {0, p.oks[1], 0, 1},
                       .cr = tst,
                       .sr = tst};
    int64_t nan_bad = 0, nbad = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < n; i++) {
            const int64_t row = L.by_pos ? pos[b * n + i] : (L.cos_batch ? b * n : 0) + i;
            const int64_t qo = b * p.oqs[0] + i * p.oqs[2], ko = b * p.oks[0] + i * p.oks[2];
            if (row < 0 || row >= P) { /* every element of every head NaN */
                for (int64_t h = 0; h < HQ; h++)
                    for (int64_t j = 0; j < d; j++) nan_bad += !isnan(opf_load_elem(oq, qo + h * p.oqs[1] + j, dt));
                for (int64_t h = 0; h < HK; h++)
                    for (int64_t j = 0; j < d; j++) nan_bad += !isnan(opf_load_elem(ok, ko + h * p.oks[1] + j, dt));
                for (int64_t h = 0; h < HQ; h++)
                    for (int64_t j = 0; j < d; j++) {
                        const int64_t e = qo + h * p.oqs[1] + j;
                        opf_store_elem(rq, e, dt, opf_load_elem(oq, e, dt));
                    }
                for (int64_t h = 0; h < HK; h++)
                    for (int64_t j = 0; j < d; j++) {
                        const int64_t e = ko + h * p.oks[1] + j;
                        opf_store_elem(rk, e, dt, opf_load_elem(ok, e, dt));
                    }
                continue;
            }
            pr.q = (const char *)p.q + (b * p.qs[0] + i * p.qs[2]) * es;
            pr.k = (const char *)p.k + (b * p.ks[0] + i * p.ks[2]) * es;
            pr.oq = rq + qo * es, pr.ok = rk + ko * es;
            pr.cos = c + row * r * tst * es, pr.sin = s + row * r * tst * es;
            rope_run(&rope_kernels_ref, &pr);
        }
    CHECK(nan_bad == 0, "%s D=%lld: %lld elements at a bad position id are not NaN", DT_NAME[dt], (long long)d,
          (long long)nan_bad);
    for (int t = 0; t < 2; t++) {
        const char *got = t ? ok : oq, *want = t ? rk : rq;
        const int64_t cnt = (t ? nk : nq) + 1; /* the element past the end: still the sentinel */
        for (int64_t e = 0; e < cnt; e++) {
            const double g = opf_load_elem(got, e, dt), w = opf_load_elem(want, e, dt);
            if (memcmp(got + e * es, want + e * es, (size_t)es) != 0 && !(isnan(g) && isnan(w)) && nbad++ == 0)
                CHECK(0, "%s D=%lld R=%lld N=%lld inter=%d inv=%d pos=%d %s: %s element %lld: got %.9g want %.9g",
                      DT_NAME[dt], (long long)d, (long long)r, (long long)n, L.interleaved, L.inverse, L.by_pos,
                      LAYOUT_NAME[L.layout], t ? "k" : "q", (long long)e, g, w);
        }
    }
    CHECK(nbad == 0, "%s D=%lld R=%lld N=%lld inter=%d inv=%d pos=%d %s: %lld elements differ", DT_NAME[dt],
          (long long)d, (long long)r, (long long)n, L.interleaved, L.inverse, L.by_pos, LAYOUT_NAME[L.layout],
          (long long)nbad);
    free(q), free(kk), free(oq), free(ok), free(rq), free(rk), free(c), free(s);
}

int main(void) {
    static const int64_t DIMS[][2] = {{2, 2},   {2, 0},   {6, 6},     {6, 4},    {16, 16},  {64, 64},
                                      {64, 32}, {80, 80}, {128, 128}, {128, 96}, {128, 32}, {136, 128}};
    static const int64_t LENS[] = {1, 7, 33};
    for (int dt = 0; dt < OPF_DTYPE_COUNT; dt++) {
        for (size_t di = 0; di < sizeof DIMS / sizeof *DIMS; di++)
            for (size_t ni = 0; ni < sizeof LENS / sizeof *LENS; ni++)
                for (int mode = 0; mode < 8; mode++)
                    run_case((opf_dtype)dt, (rope_case){.n = LENS[ni],
                                                        .d = DIMS[di][0],
                                                        .r = DIMS[di][1],
                                                        .interleaved = mode & 1,
                                                        .inverse = (mode >> 1) & 1,
                                                        .by_pos = mode >> 2,
                                                        .cos_batch = (int)(ni % 2)});
        /* the scalar kernel on layouts the vector ones refuse */
        for (int layout = LAYOUT_OFFSET; layout <= LAYOUT_TABLE2; layout++)
            for (int mode = 0; mode < 8; mode++)
                run_case((opf_dtype)dt, (rope_case){.n = 7,
                                                    .d = 64,
                                                    .r = 48,
                                                    .interleaved = mode & 1,
                                                    .inverse = (mode >> 1) & 1,
                                                    .by_pos = mode >> 2,
                                                    .cos_batch = 1,
                                                    .layout = layout});
        /* rows of more units than a block has threads: the vector kernels (float64, 2 per pack) and
         * the scalar one */
        for (int mode = 0; mode < 4; mode++) {
            run_case((opf_dtype)dt,
                     (rope_case){.n = 2, .d = 1040, .r = 1024, .interleaved = mode & 1, .inverse = mode >> 1});
            run_case((opf_dtype)dt, (rope_case){.n = 2,
                                                .d = 600,
                                                .r = 520,
                                                .interleaved = mode & 1,
                                                .inverse = mode >> 1,
                                                .layout = LAYOUT_OFFSET});
        }
        /* ids outside the table: NaN at their positions, the rest as the reference */
        for (int mode = 0; mode < 4; mode++) {
            run_case((opf_dtype)dt, (rope_case){.n = 7,
                                                .d = 64,
                                                .r = 48,
                                                .interleaved = mode & 1,
                                                .inverse = mode >> 1,
                                                .by_pos = 1,
                                                .bad_pos = 1});
            run_case((opf_dtype)dt, (rope_case){.n = 7,
                                                .d = 64,
                                                .r = 48,
                                                .interleaved = mode & 1,
                                                .inverse = mode >> 1,
                                                .by_pos = 1,
                                                .bad_pos = 1,
                                                .layout = LAYOUT_OFFSET});
        }
        run_case((opf_dtype)dt, (rope_case){.n = 0, .d = 64, .r = 64});
    }
    return check_report("test_rope (CUDA, emulated)");
}
