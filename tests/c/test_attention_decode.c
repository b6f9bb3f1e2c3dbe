/*
 * Every compiled decoding-attention variant against the double-precision oracle: one and several new
 * tokens (N = 1, 3, 16), odd head dims (1, 7, 123, 128) and key counts (1, 7, 123, 4097, split into
 * chunks), seq_lens of 0, short, odd and the full cache (int32 and int64), grouped-query heads (g = 1,
 * 3, 4), causal (bottom-right) and not, caches read as strided views of a larger (B, S_buf, Hkv, D)
 * buffer and with an element stride of 2, float32, bfloat16 and float16; each result bitwise the same
 * on 1, 2 and 4 threads; the workspace exactly as sized (guard words); empty shapes.
 */
#define _POSIX_C_SOURCE 200809L /* setenv: the standalone thread count is OPFORGE_NUM_THREADS */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../../csrc/kernels/attention_decode.h"
#include "check.h"

typedef struct cfg {
    int64_t b, h, hkv, n, s, d, dv;
    int causal;
    int layout; /* 0 contiguous, 1 cache a (B, S_buf, Hkv, D) buffer sliced to S, q (B, N, H, D); 2 element stride 2 */
    int lens;   /* 0 every row full, 1 mixed (0, 1, odd, full), 2 all zero */
    int lens_i64;
    opf_dtype dt;
} cfg;

static void *rand_tensor(int64_t count, opf_dtype dt, unsigned long long seed, double amp) {
    void *p = malloc((size_t)(count > 0 ? count : 1) * opf_dtype_size(dt));
    for (int64_t i = 0; i < count; i++) opf_store_elem(p, i, dt, (check_uniform(&seed) * 2.0 - 1.0) * amp);
    return p;
}

/* strides of a (b, h, n, d) view and the elements of the buffer behind it */
static int64_t layout(int lay, int64_t b, int64_t h, int64_t n, int64_t d, int64_t n_buf, int64_t *st) {
    if (lay == 1) { /* (B, n_buf, H, D) buffer, the first n rows of each head */
        st[0] = n_buf * h * d, st[1] = d, st[2] = h * d, st[3] = 1;
        return b * n_buf * h * d;
    }
    if (lay == 2) {
        st[0] = h * n * d * 2, st[1] = n * d * 2, st[2] = d * 2, st[3] = 2;
        return b * h * n * d * 2;
    }
    st[0] = h * n * d, st[1] = n * d, st[2] = d, st[3] = 1;
    return b * h * n * d;
}

/* the driver under a plan made at this run's thread count, as the glue makes it, with a workspace of
 * exactly the plan's size between guard words */
static void run_fwd(const attention_decode_kernels *k, const attention_decode_problem *p) {
    const attention_decode_plan plan = attention_decode_plan_make(p, opf_num_threads());
    float *ws = check_ws_alloc(attention_decode_workspace(&plan));
    attention_decode_fwd(k, &plan, p, ws);
    check_ws_free(ws, "attention_decode_fwd");
}

static void set_threads(int n) {
    char buf[16];
    snprintf(buf, sizeof buf, "%d", n);
    setenv("OPFORGE_NUM_THREADS", buf, 1);
}

static void run(const attention_decode_kernels *k, cfg c) {
    attention_decode_problem p = {.b = c.b,
                                  .h = c.h,
                                  .hkv = c.hkv,
                                  .n = c.n,
                                  .s_max = c.s,
                                  .d_qk = c.d,
                                  .d_v = c.dv,
                                  .dt = c.dt,
                                  .causal = c.causal,
                                  .scale = c.d > 0 ? 1.0 / sqrt((double)c.d) : 1.0,
                                  .lens_i64 = c.lens_i64,
                                  .lens_stride = c.lens_i64 ? 1 : 3}; /* int32 lengths read with a stride */
    const int64_t s_buf = c.s + 5;
    const int64_t nq = layout(c.layout, c.b, c.h, c.n, c.d, c.n, p.qs);
    const int64_t nk = layout(c.layout, c.b, c.hkv, c.s, c.d, s_buf, p.ks);
    const int64_t nv = layout(c.layout, c.b, c.hkv, c.s, c.dv, s_buf, p.vs);
    const int64_t no = layout(0, c.b, c.h, c.n, c.dv, c.n, p.os);
    void *q = rand_tensor(nq, c.dt, 11 + (unsigned long long)c.n, 2.0), *kk = rand_tensor(nk, c.dt, 12, 2.0);
    void *v = rand_tensor(nv, c.dt, 13, 1.0);
    int64_t lens64[64];
    int32_t lens32[3 * 64];
    for (int64_t b = 0; b < c.b; b++) {
        const int64_t mixed[4] = {0, 1, c.s / 2 + 1 < c.s ? c.s / 2 + 1 : c.s, c.s};
        lens64[b] = c.lens == 0 ? c.s : c.lens == 2 ? 0 : mixed[b % 4];
        lens32[3 * b] = (int32_t)lens64[b];
    }
    p.lens = c.lens_i64 ? (const void *)lens64 : (const void *)lens32;
    p.q = q, p.k = kk, p.v = v;
    const size_t ob = (size_t)(no > 0 ? no : 1) * opf_dtype_size(c.dt);
    void *out = malloc(ob), *want = malloc(ob), *again = malloc(ob);
    memset(out, 0x7f, ob); /* NaN-ish garbage: every element must be written */
    attention_decode_problem w = p;
    w.out = want;
    double *scratch = malloc(sizeof(double) * (size_t)attention_decode_ref_doubles(&w));
    attention_decode_ref_fwd(&w, scratch);
    free(scratch);

    set_threads(2);
    p.out = out;
    run_fwd(k, &p);

    double err = 0.0, mag = 0.1; /* errors of values below 0.1 count as absolute */
    int64_t worst = -1;
    for (int64_t i = 0; i < no; i++) {
        const double g = opf_load_elem(out, i, c.dt), x = opf_load_elem(want, i, c.dt);
        if (!(fabs(g - x) <= err)) {
            err = isnan(g) ? INFINITY : fabs(g - x);
            worst = i;
        }
        mag = fmax(mag, fabs(x));
    }
    const double tol = c.dt == OPF_BF16 ? 1.6e-2 : c.dt == OPF_F16 ? 2e-3 : 2e-5;
    CHECK(err / mag <= tol,
          "%s b=%lld h=%lld hkv=%lld n=%lld s=%lld d=%lld dv=%lld causal=%d layout=%d lens=%d i64=%d dt=%d: "
          "relative error %.3g (at %lld: got %.6g, want %.6g)",
          k->name, (long long)c.b, (long long)c.h, (long long)c.hkv, (long long)c.n, (long long)c.s, (long long)c.d,
          (long long)c.dv, c.causal, c.layout, c.lens, c.lens_i64, (int)c.dt, err / mag, (long long)worst,
          worst >= 0 ? opf_load_elem(out, worst, c.dt) : 0.0, worst >= 0 ? opf_load_elem(want, worst, c.dt) : 0.0);

    const int runs[3] = {1, 4, 2}; /* the chunk plan ignores the thread count: the same bits */
    for (int r = 0; r < 3; r++) {
        set_threads(runs[r]);
        memset(again, 0x55, ob);
        p.out = again;
        run_fwd(k, &p);
        CHECK(memcmp(again, out, (size_t)no * opf_dtype_size(c.dt)) == 0,
              "%s b=%lld h=%lld n=%lld s=%lld causal=%d: %d threads differ from 2 threads", k->name, (long long)c.b,
              (long long)c.h, (long long)c.n, (long long)c.s, c.causal, runs[r]);
    }
    unsetenv("OPFORGE_NUM_THREADS");
    free(q), free(kk), free(v), free(out), free(want), free(again);
}

static void test_variant(const attention_decode_kernels *k) {
    const opf_dtype dts[3] = {OPF_F32, OPF_BF16, OPF_F16};
    /* b, h, hkv, n, s, d, dv */
    const int64_t shapes[][7] = {
        {1, 1, 1, 1, 1, 1, 1},        {1, 4, 1, 1, 7, 7, 7},      {2, 6, 2, 3, 123, 123, 40},
        {1, 8, 2, 1, 4097, 128, 128}, {3, 4, 4, 16, 300, 16, 24}, {4, 12, 4, 2, 700, 64, 64},
        {1, 2, 1, 5, 3, 8, 8},
    };
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int causal = 0; causal < 2; causal++)
            for (int lay = 0; lay < 3; lay++) {
                const int64_t *x = shapes[s];
                cfg c = {.b = x[0],
                         .h = x[1],
                         .hkv = x[2],
                         .n = x[3],
                         .s = x[4],
                         .d = x[5],
                         .dv = x[6],
                         .causal = causal,
                         .layout = lay,
                         .lens = (int)((s + (size_t)lay) % 3 == 2 ? 0 : 1),
                         .lens_i64 = (int)((s + (size_t)causal) % 2),
                         .dt = dts[(s + (size_t)lay + (size_t)causal) % 3]};
                if (x[4] > 1000 && lay == 2) continue; /* the long cache: contiguous and sliced views suffice */
                run(k, c);
                if (s == 3 && lay == 1) { /* the long cache in every dtype, and every row empty */
                    c.dt = dts[(c.dt + 1) % 3];
                    run(k, c);
                    c.lens = 2;
                    run(k, c);
                }
            }
    /* empty shapes: no batch, no head, no cache, no head dim */
    const int64_t empty[][7] = {{0, 4, 2, 1, 9, 8, 8},
                                {2, 0, 0, 1, 9, 8, 8},
                                {2, 4, 2, 1, 0, 8, 8},
                                {2, 4, 2, 2, 9, 0, 8},
                                {2, 4, 2, 2, 9, 8, 0}};
    for (size_t s = 0; s < sizeof empty / sizeof empty[0]; s++) {
        const int64_t *x = empty[s];
        run(k, (cfg){.b = x[0],
                     .h = x[1],
                     .hkv = x[2],
                     .n = x[3],
                     .s = x[4],
                     .d = x[5],
                     .dv = x[6],
                     .dt = OPF_F32,
                     .lens = x[4] ? 1 : 2,
                     .lens_i64 = 1});
    }
}

static void test_chunk_plan(void) {
    /* the plan follows max(seq_lens), B and Hkv, never the threads: a long cache of one group is split */
    int64_t lens[2] = {32768, 100};
    attention_decode_problem p = {.b = 1,
                                  .h = 32,
                                  .hkv = 8,
                                  .n = 1,
                                  .s_max = 32768,
                                  .d_qk = 128,
                                  .d_v = 128,
                                  .lens = lens,
                                  .lens_i64 = 1,
                                  .lens_stride = 1};
    const int64_t chunk = attention_decode_chunk(&p);
    CHECK(chunk % ATTENTION_DECODE_BK == 0 && 8 * ((32768 + chunk - 1) / chunk) >= 64,
          "chunk %lld for B=1 Hkv=8 S=32768", (long long)chunk);
    set_threads(1);
    const int64_t c1 = attention_decode_chunk(&p);
    set_threads(4);
    CHECK(attention_decode_chunk(&p) == c1, "the chunk plan changed with the thread count");
    unsetenv("OPFORGE_NUM_THREADS");
    p.b = 2;
    lens[0] = 50;
    CHECK(attention_decode_chunk(&p) >= 64, "short caches keep a minimum chunk, got %lld",
          (long long)attention_decode_chunk(&p));
}

int main(void) {
    test_chunk_plan();
    CHECK_EACH_VARIANT(attention_decode_kernels_for, test_variant);
    return check_report("test_attention_decode");
}
