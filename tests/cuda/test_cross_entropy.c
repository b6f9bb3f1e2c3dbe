/*
 * The CUDA kernels of the fused cross-entropy (csrc/cuda/cross_entropy.cu),
 * run on the CPU over tests/emu/cuda_emu.h, against the C reference drivers
 * (csrc/kernels/cross_entropy.c with the scalar reference kernels): every
 * dtype, class counts around the warp and block paths up to a 128256
 * vocabulary, weight, ignore_index, label smoothing, softcap, the three
 * reductions, float32 and float64 saved lse, strided logits (row stride, class
 * stride, permuted lead dims, misaligned start), strided target, weight and
 * grad_losses, empty problems, -inf / +inf logits, and targets out of range
 * (NaN rows, where the CPU op raises).
 */
#include <math.h>
#include <string.h>

#include "../../csrc/cuda/cross_entropy.h"
#include "../../csrc/kernels/cross_entropy.h"
#include "../c/check.h"

static const char *const DT_NAME[] = {"float32", "float64", "bfloat16", "float16"};
static const char *seen[OPF_DTYPE_COUNT][8];
static void saw(opf_dtype dt, const char *k) {
    for (int i = 0; i < 8; i++) {
        if (seen[dt][i] && strcmp(seen[dt][i], k) == 0) return;
        if (!seen[dt][i]) {
            seen[dt][i] = k;
            return;
        }
    }
}
static int was_seen(opf_dtype dt, const char *k) {
    for (int i = 0; i < 8 && seen[dt][i]; i++)
        if (strcmp(seen[dt][i], k) == 0) return 1;
    return 0;
}

typedef struct ce_case {
    const char *what;
    int lead_ndim;
    int64_t lead[3], C;
    int64_t xs[4], ts[3], gs[3]; /* logits (lead..., class), target and grad_losses strides; 0: contiguous */
    int64_t xoff;                /* logits' offset in elements */
    int weight;
    int64_t wstride;
    double ignore_share; /* share of rows whose target is ignore_index */
    int64_t ignore_index;
    double eps, cap;
    int reduction, lse_f32, special, bad_targets, zero_grad_loss, zero_weight;
} ce_case;

static double tol_of(opf_dtype dt) {
    return dt == OPF_F64 ? 1e-12 : dt == OPF_F32 ? 3e-6 : dt == OPF_BF16 ? 1e-2 : 2e-3;
}

/* got vs want (n elements): within tol of |want| plus atol times the largest finite |want| (at least 1:
 * an exact 0 comes out as the inputs' rounding); NaN matches NaN, infinities themselves */
static void compare(const char *what, const ce_case *c, opf_dtype dt, opf_dtype vdt, const void *got, const void *want,
                    int64_t n, double tol, double atol) {
    double scale = 0;
    for (int64_t i = 0; i < n; i++) {
        double b = opf_load_elem(want, i, vdt);
        if (isfinite(b)) scale = fmax(scale, fabs(b));
    }
    int64_t bad = 0, first = -1;
    double ga = 0, wa = 0;
    for (int64_t i = 0; i < n; i++) {
        double a = opf_load_elem(got, i, vdt), b = opf_load_elem(want, i, vdt);
        int ok = (isnan(a) && isnan(b)) || a == b || fabs(a - b) <= tol * fabs(b) + atol * fmax(scale, 1.0);
        if (!ok) {
            if (first < 0) first = i, ga = a, wa = b;
            bad++;
        }
    }
    CHECK(bad == 0, "%s %s (%s, C %lld): %lld of %lld mismatch, first at %lld: got %.9g want %.9g", what, DT_NAME[dt],
          c->what, (long long)c->C, (long long)bad, (long long)n, (long long)first, ga, wa);
}

static int64_t span(int nd, const int64_t *sizes, const int64_t *st) {
    int64_t s = 1;
    for (int d = 0; d < nd; d++)
        if (sizes[d] == 0) return 0;
    for (int d = 0; d < nd; d++) s += (sizes[d] - 1) * st[d];
    return s;
}
static int64_t offset_of(int nd, const int64_t *sizes, const int64_t *st, int64_t i) {
    int64_t off = 0;
    for (int d = nd - 1; d >= 0; d--) {
        off += (i % sizes[d]) * st[d];
        i /= sizes[d];
    }
    return off;
}

static void run_case(opf_dtype dt, const ce_case *c0) {
    ce_case c = *c0;
    const size_t es = opf_dtype_size(dt);
    const int L = c.lead_ndim;
    int64_t rows = 1, sizes[4], xs[4], ts[3], gs[3], contig[3];
    for (int d = L - 1; d >= 0; d--) contig[d] = rows, rows *= c.lead[d];
    for (int d = 0; d < L; d++) sizes[d] = c.lead[d];
    sizes[L] = c.C;
    /* default strides: contiguous */
    for (int d = 0; d <= L; d++) xs[d] = c.xs[d] ? c.xs[d] : (d == L ? 1 : contig[d] * c.C);
    for (int d = 0; d < L; d++) ts[d] = c.ts[d] ? c.ts[d] : contig[d], gs[d] = c.gs[d] ? c.gs[d] : contig[d];
    const int64_t C = c.C, nx = span(L + 1, sizes, xs) + c.xoff, nt = span(L, sizes, ts), ng = span(L, sizes, gs);
    char *xbuf = calloc((size_t)nx + 8, es), *x = xbuf + c.xoff * (int64_t)es;
    int64_t *target = calloc((size_t)nt + 1, 8);
    char *w = c.weight ? calloc((size_t)(C * c.wstride + 1), es) : NULL;
    char *gl = calloc((size_t)ng + 1, es), *gsc = calloc(1, es);
    unsigned long long seed = 12345 + (unsigned long long)(C * 7 + rows);
    for (int64_t i = 0; i < nx; i++) opf_store_elem(xbuf, i, dt, -8 + 16 * check_uniform(&seed));
    for (int64_t i = 0; i < ng; i++) opf_store_elem(gl, i, dt, -1 + 2 * check_uniform(&seed));
    opf_store_elem(gsc, 0, dt, c.zero_grad_loss ? 0.0 : 0.5 + check_uniform(&seed));
    if (w)
        for (int64_t j = 0; j < C; j++)
            opf_store_elem(w, j * c.wstride, dt, c.zero_weight ? 0.0 : 0.25 + 2 * check_uniform(&seed));
    for (int64_t i = 0; i < rows; i++) {
        int64_t t = C > 0 ? (int64_t)(check_uniform(&seed) * (double)C) % C : 0;
        if (C == 0 || check_uniform(&seed) < c.ignore_share) t = c.ignore_index;
        target[offset_of(L, sizes, ts, i)] = t;
    }
    if (c.special)
        for (int64_t i = 0; i < rows && C > 1; i++) {
            /* row i % 5: 0 one -inf, 1 the target's logit -inf, 2 one +inf (row 7 ignored), 3 most -inf, 4 (row 9) all */
            char *xr = x + offset_of(L, sizes, xs, i) * (int64_t)es;
            if (i % 10 == 7) target[offset_of(L, sizes, ts, i)] = c.ignore_index; /* ignored, holding +inf */
            const int64_t t = target[offset_of(L, sizes, ts, i)], cs = xs[L];
            switch (i % 5) {
            case 0: opf_store_elem(xr, (C / 2) * cs, dt, -INFINITY); break;
            case 1:
                if (t >= 0 && t < C) opf_store_elem(xr, t * cs, dt, -INFINITY); /* loss inf */
                break;
            case 2: opf_store_elem(xr, (C - 1) * cs, dt, INFINITY); break;
            case 3:
                for (int64_t j = 0; j < C * 9 / 10; j++)
                    if (j != t) opf_store_elem(xr, j * cs, dt, -INFINITY);
                break;
            case 4:
                if (i % 10 == 9) /* a row of -inf only: lse NaN */
                    for (int64_t j = 0; j < C; j++) opf_store_elem(xr, j * cs, dt, -INFINITY);
                break;
            default: break;
            }
        }
    /* targets out of range: the GPU makes those rows NaN; the reference sees them ignored */
    int64_t *ref_target = malloc((size_t)(nt + 1) * 8);
    memcpy(ref_target, target, (size_t)(nt + 1) * 8);
    if (c.bad_targets)
        for (int64_t i = 1; i < rows; i += 3) {
            target[offset_of(L, sizes, ts, i)] = i % 2 ? C : -7;
            ref_target[offset_of(L, sizes, ts, i)] = c.ignore_index;
        }

    /* the reference */
    char *losses = calloc((size_t)rows + 1, es), *rlosses = calloc((size_t)rows + 1, es);
    char *loss = calloc(1, es), *rloss = calloc(1, es);
    double *lse = calloc((size_t)rows + 1, 8), *rlse = calloc((size_t)rows + 1, 8);
    float *lse32 = calloc((size_t)rows + 1, 4);
    char *dx = calloc((size_t)(rows * C + 1), es), *rdx = calloc((size_t)(rows * C + 1), es);
    cross_entropy_problem rp = {.dt = dt,
                                .rows = rows,
                                .classes = C,
                                .lead_ndim = L,
                                .lead_sizes = sizes,
                                .logits = x,
                                .logits_strides = xs,
                                .target = ref_target,
                                .target_strides = ts,
                                .weight = w,
                                .weight_stride = c.wstride,
                                .ignore_index = c.ignore_index,
                                .label_smoothing = c.eps,
                                .softcap = c.cap,
                                .reduction = c.reduction,
                                .losses = rlosses,
                                .loss = rloss,
                                .lse = rlse};
    float *rws = check_ws_alloc(cross_entropy_fwd_workspace(&rp));
    cross_entropy_fwd(&cross_entropy_kernels_ref, &rp, rws);
    check_ws_free(rws, "reference");
    for (int64_t i = 0; i < rows; i++) lse32[i] = (float)rlse[i];

    /* the GPU's */
    cross_entropy_cuda_problem p = {.nrows = rows,
                                    .classes = C,
                                    .class_stride = xs[L],
                                    .weight_stride = c.wstride,
                                    .ignore_index = c.ignore_index,
                                    .label_smoothing = c.eps,
                                    .softcap = c.cap,
                                    .reduction = c.reduction};
    const int64_t *st[4] = {contig, xs, ts, gs};
    CHECK(opf_cuda_nd_make(&p.rows, L, sizes, 4, st) == 0, "rows plan");
    float *ws = check_ws_alloc(cross_entropy_cuda_fwd_workspace(dt, &p, c.weight));
    cross_entropy_cuda_launch r = cross_entropy_cuda_fwd(dt, losses, loss, lse, x, target, w, ws, &p, NULL);
    check_ws_free(ws, "forward");
    CHECK(r.grid > 0, "the forward always writes the loss");
    saw(dt, r.kernel);
    const double tol = tol_of(dt), ltol = dt == OPF_F64 ? 1e-12 : 2e-6;
    if (c.bad_targets) {
        for (int64_t i = 1; i < rows; i += 3) {
            CHECK(isnan(opf_load_elem(losses, i, dt)) && isnan(lse[i]),
                  "%s: row %lld with target out of range: loss %g lse %g, want NaN", c.what, (long long)i,
                  opf_load_elem(losses, i, dt), lse[i]);
            opf_store_elem(losses, i, dt, 0.0), lse[i] = 0; /* the reference's (ignored) */
        }
        CHECK(rows < 2 || isnan(opf_load_elem(loss, 0, dt)), "%s: loss with a target out of range: %g, want NaN",
              c.what, opf_load_elem(loss, 0, dt));
    } else {
        compare("loss", &c, dt, dt, loss, rloss, 1,
                dt == OPF_F64   ? 1e-12
                : dt == OPF_F32 ? 1e-5
                                : tol,
                dt == OPF_F64 ? 1e-13 : 1e-6);
    }
    compare("losses", &c, dt, dt, losses, rlosses, rows, dt == OPF_F32 ? 1e-5 : tol, dt == OPF_F64 ? 1e-13 : 1e-6);
    compare("lse", &c, dt, OPF_F64, lse, rlse, rows, ltol, 0);

    /* backward, from the reference's lse */
    rp.lse_saved = c.lse_f32 ? (const void *)lse32 : (const void *)rlse;
    rp.lse_dt = c.lse_f32 ? OPF_F32 : OPF_F64;
    rp.grad_losses = gl, rp.grad_losses_strides = gs, rp.grad_loss = gsc, rp.dlogits = rdx;
    cross_entropy_bwd(&cross_entropy_kernels_ref, &rp);
    ws = check_ws_alloc(cross_entropy_cuda_bwd_workspace(dt, &p, c.weight));
    r = cross_entropy_cuda_bwd(dt, dx, x, target, w, gl, gsc, rp.lse_saved, c.lse_f32, ws, &p, NULL);
    check_ws_free(ws, "backward");
    CHECK((r.grid == 0) == (rows * C == 0), "%s: backward blocks %u for %lld logits", c.what, r.grid,
          (long long)(rows * C));
    if (r.grid) saw(dt, r.kernel);
    if (c.bad_targets)
        for (int64_t i = 1; i < rows; i += 3) {
            int64_t nan = 0;
            for (int64_t j = 0; j < C; j++) nan += isnan(opf_load_elem(dx, i * C + j, dt));
            CHECK(nan == C, "%s: gradient row %lld with a target out of range: %lld of %lld NaN", c.what, (long long)i,
                  (long long)nan, (long long)C);
            for (int64_t j = 0; j < C; j++) opf_store_elem(dx, i * C + j, dt, 0.0);
        }
    compare("dlogits", &c, dt, dt, dx, rdx, rows * C, dt == OPF_F32 ? 1e-5 : tol, dt == OPF_F64 ? 1e-12 : 1e-6);

    free(xbuf), free(target), free(ref_target), free(w), free(gl), free(gsc);
    free(losses), free(rlosses), free(loss), free(rloss), free(lse), free(rlse), free(lse32), free(dx), free(rdx);
}

int main(void) {
    static const int64_t CS[] = {1, 3, 31, 32, 33, 100, 1000, 2048, 2049, 5000, 40000, 128256};
    for (int dti = 0; dti < OPF_DTYPE_COUNT; dti++) {
        const opf_dtype dt = (opf_dtype)dti;
        for (size_t i = 0; i < sizeof CS / sizeof *CS; i++) {
            const int64_t C = CS[i], rows = C <= 2048 ? 37 : C < 100000 ? 3 : 2;
            for (int red = 0; red < 3; red++) {
                ce_case c = {.what = "contiguous",
                             .lead_ndim = 1,
                             .lead = {rows},
                             .C = C,
                             .wstride = 1,
                             .ignore_share = 0.2,
                             .ignore_index = -100,
                             .reduction = red};
                if (C > 5000 && red != 1) continue; /* the long rows once */
                run_case(dt, &c);
                c.what = "weight, smoothing";
                c.weight = 1, c.eps = 0.1;
                if (C <= 5000) run_case(dt, &c);
            }
            ce_case s = {.what = "softcap, smoothing, f32 lse",
                         .lead_ndim = 1,
                         .lead = {rows},
                         .C = C,
                         .wstride = 1,
                         .ignore_share = 0.3,
                         .ignore_index = 3,
                         .eps = 0.25,
                         .cap = 5.0,
                         .reduction = 1,
                         .lse_f32 = 1};
            if (C <= 5000 || C == 128256) run_case(dt, &s);
        }
        /* strided and permuted operands */
        {
            ce_case a = {.what = "row stride C+3, strided target and weight",
                         .lead_ndim = 1,
                         .lead = {9},
                         .C = 333,
                         .xs = {336, 1},
                         .ts = {2},
                         .gs = {3},
                         .weight = 1,
                         .wstride = 2,
                         .ignore_index = -100,
                         .eps = 0.1,
                         .reduction = 1};
            ce_case b = {.what = "class stride 2",
                         .lead_ndim = 1,
                         .lead = {5},
                         .C = 3000,
                         .xs = {6001, 2},
                         .ignore_index = -100,
                         .reduction = 2};
            ce_case d = {.what = "permuted lead dims",
                         .lead_ndim = 2,
                         .lead = {3, 4},
                         .C = 50,
                         .xs = {50, 150, 1},
                         .ts = {1, 3},
                         .gs = {1, 3},
                         .weight = 1,
                         .wstride = 1,
                         .ignore_share = 0.2,
                         .ignore_index = -100,
                         .reduction = 1};
            ce_case e = {.what = "misaligned logits",
                         .lead_ndim = 1,
                         .lead = {6},
                         .C = 4099,
                         .xoff = 1,
                         .ignore_index = -100,
                         .reduction = 1,
                         .cap = 30};
            ce_case f = {.what = "misaligned short rows",
                         .lead_ndim = 1,
                         .lead = {19},
                         .C = 101,
                         .xoff = 3,
                         .ignore_index = -100,
                         .reduction = 0};
            ce_case g = {.what = "1-d logits", .lead_ndim = 0, .C = 1000, .ignore_index = -100, .reduction = 1};
            ce_case h = {.what = "3 lead dims, zero grad_loss",
                         .lead_ndim = 3,
                         .lead = {2, 3, 2},
                         .C = 70,
                         .ignore_index = -100,
                         .reduction = 1,
                         .zero_grad_loss = 1,
                         .ignore_share = 1.0};
            run_case(dt, &a), run_case(dt, &b), run_case(dt, &d), run_case(dt, &e), run_case(dt, &f);
            ce_case z = {.what = "zero weights, zero grad_loss",
                         .lead_ndim = 1,
                         .lead = {20},
                         .C = 40,
                         .weight = 1,
                         .wstride = 1,
                         .ignore_index = -100,
                         .reduction = 1,
                         .zero_grad_loss = 1,
                         .zero_weight = 1};
            run_case(dt, &g), run_case(dt, &h), run_case(dt, &z);
        }
        /* empty: no rows (mean NaN, sum 0), no classes (every target ignored) */
        for (int red = 0; red < 3; red++) {
            ce_case a = {
                .what = "no rows", .lead_ndim = 1, .lead = {0}, .C = 10, .ignore_index = -100, .reduction = red};
            ce_case b = {.what = "no classes",
                         .lead_ndim = 1,
                         .lead = {4},
                         .C = 0,
                         .ignore_index = -100,
                         .ignore_share = 1.0,
                         .reduction = red};
            run_case(dt, &a), run_case(dt, &b);
        }
        /* -inf, a target of -inf (loss inf), +inf, most of a row -inf */
        static const int64_t SP[] = {40, 3000, 50000};
        for (size_t i = 0; i < sizeof SP / sizeof *SP; i++) {
            ce_case c = {.what = "special values",
                         .lead_ndim = 1,
                         .lead = {10},
                         .C = SP[i],
                         .ignore_index = -100,
                         .reduction = 2,
                         .special = 1};
            run_case(dt, &c);
        }
        /* targets out of range: NaN rows */
        static const int64_t BT[] = {50, 3000};
        for (size_t i = 0; i < sizeof BT / sizeof *BT; i++) {
            ce_case c = {.what = "targets out of range",
                         .lead_ndim = 1,
                         .lead = {10},
                         .C = BT[i],
                         .ignore_index = -100,
                         .reduction = 2,
                         .bad_targets = 1};
            run_case(dt, &c);
        }
        static const char *const K[] = {"cross_entropy_fwd_warp", "cross_entropy_fwd_block", "cross_entropy_fwd_finish",
                                        "cross_entropy_bwd_warp", "cross_entropy_bwd_block"};
        for (size_t k = 0; k < sizeof K / sizeof *K; k++)
            CHECK(was_seen(dt, K[k]), "%s never ran for %s", K[k], DT_NAME[dt]);
    }
    return check_report("test_cross_entropy (CUDA, emulated)");
}
