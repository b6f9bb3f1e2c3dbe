/*
 * The scalar reference kernels (the table every ISA variant is tested
 * against) and the attention oracle: row by row in double, any dtype (float64
 * included: the op's float64 path, for gradcheck), on a scratch its caller
 * gives. Contract in attention.h.
 */
#include <math.h>

#include "attention.h"

/* ---- scalar reference kernels ------------------------------------------------------------ */

static void mm_ref(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                   int64_t ldb, float *c, int64_t ldc, int acc) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            float sum = 0.0f;
            for (int64_t p = 0; p < k; p++) sum += a[i * rsa + p * csa] * b[p * ldb + j];
            c[i * ldc + j] = acc ? c[i * ldc + j] + sum : sum;
        }
}

static void softmax_cols_ref(float *st, int64_t ld, int64_t bk, int64_t bq, float scale, float *m, float *l,
                             float *alpha, int64_t diag) {
    for (int64_t i = 0; i < bq; i++) {
        const int64_t keys = bk < i + diag + 1 ? bk : (i + diag + 1 > 0 ? i + diag + 1 : 0); /* unmasked: j < keys */
        float mx = m[i];
        for (int64_t j = 0; j < keys; j++) mx = fmaxf(mx, st[j * ld + i] * scale);
        float base = mx == -INFINITY ? 0.0f : mx, sum = 0.0f;
        for (int64_t j = 0; j < bk; j++) {
            float e = j < keys ? expf(st[j * ld + i] * scale - base) : 0.0f;
            st[j * ld + i] = e;
            sum += e;
        }
        alpha[i] = expf(m[i] - base);
        l[i] = l[i] * alpha[i] + sum;
        m[i] = mx;
    }
}

static void probs_ref(float *scores, int64_t ld, int64_t bq, int64_t bk, float scale, const float *lse, int64_t diag) {
    for (int64_t i = 0; i < bq; i++)
        for (int64_t j = 0; j < bk; j++)
            scores[i * ld + j] = lse[i] == -INFINITY || j > i + diag ? 0.0f : expf(scores[i * ld + j] * scale - lse[i]);
}

static void dscores_ref(float *dp, const float *p, int64_t ld, int64_t bq, int64_t bk, const float *delta,
                        float scale) {
    for (int64_t i = 0; i < bq; i++)
        for (int64_t j = 0; j < bk; j++) dp[i * ld + j] = p[i * ld + j] * (dp[i * ld + j] - delta[i]) * scale;
}

static void transpose_ref(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) dst[c * ldd + r] = src[r * lds + c];
}

static void scale_rows_ref(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols,
                           const float *f) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) dst[r * ldd + c] = src[r * lds + c] * f[r];
}

const attention_kernels attention_kernels_ref = {.name = "ref",
                                                 .isa = OPF_ISA_REF,
                                                 .cvt = &convert_kernels_ref,
                                                 .mm = mm_ref,
                                                 .softmax_cols = softmax_cols_ref,
                                                 .probs = probs_ref,
                                                 .dscores = dscores_ref,
                                                 .transpose = transpose_ref,
                                                 .scale_rows = scale_rows_ref};

/* ---- oracle: row by row in double ---------------------------------------------------------- */

/* scores of query i of (b, h) against every key, softmax in place; returns lse */
static double ref_probs(const attention_problem *p, int64_t b, int64_t h, int64_t i, double *w) {
    const int64_t kvh = h / (p->h / p->hkv);
    double mx = -INFINITY;
    int nan = 0;
    for (int64_t j = 0; j < p->s; j++) {
        double bias = mask_bias(p, b, h, i, j);
        if (p->mask_kind == ATTENTION_MASK_ADD && !(p->causal && j > i))
            bias = opf_load_elem(p->mask, off4(p->ms, b, h, i, j), p->mask_dt); /* in double for float64 */
        double dot = 0.0;
        for (int64_t d = 0; d < p->d_qk; d++)
            dot += opf_load_elem(p->q, off4(p->qs, b, h, i, d), p->dt) *
                   opf_load_elem(p->k, off4(p->ks, b, kvh, j, d), p->dt);
        w[j] = bias == -INFINITY ? -INFINITY : dot * p->scale + bias;
        if (w[j] > mx) mx = w[j];
        nan |= isnan(w[j]);
    }
    if (nan) { /* a NaN score makes the whole row NaN, as softmax does */
        for (int64_t j = 0; j < p->s; j++) w[j] = NAN;
        return NAN;
    }
    if (mx == -INFINITY) { /* no key left: zeros */
        for (int64_t j = 0; j < p->s; j++) w[j] = 0.0;
        return -INFINITY;
    }
    double sum = 0.0;
    for (int64_t j = 0; j < p->s; j++) sum += (w[j] = exp(w[j] - mx));
    for (int64_t j = 0; j < p->s; j++) w[j] /= sum;
    return mx + log(sum);
}

/* the probabilities of one query row */
int64_t attention_ref_fwd_doubles(const attention_problem *p) { return p->s + 1; }

void attention_ref_fwd(const attention_problem *p, double *scratch) {
    double *w = scratch;
    for (int64_t b = 0; b < p->b; b++)
        for (int64_t h = 0; h < p->h; h++) {
            const int64_t kvh = h / (p->h / p->hkv);
            for (int64_t i = 0; i < p->n; i++) {
                p->lse[(b * p->h + h) * p->n + i] = (float)ref_probs(p, b, h, i, w);
                for (int64_t d = 0; d < p->d_v; d++) {
                    double acc = 0.0;
                    for (int64_t j = 0; j < p->s; j++)
                        acc += w[j] * opf_load_elem(p->v, off4(p->vs, b, kvh, j, d), p->dt);
                    opf_store_elem(p->out, off4(p->os, b, h, i, d), p->dt, acc);
                }
            }
        }
}

/* one query row's probabilities, dP and dQ, then dK and dV of every key in double */
int64_t attention_ref_bwd_doubles(const attention_problem *p) {
    const int64_t nk = p->b * p->hkv * p->s;
    return (2 * p->s + p->d_qk + 1) + nk * (p->d_qk + p->d_v);
}

void attention_ref_bwd(const attention_problem *p, double *scratch) {
    const int64_t nk = p->b * p->hkv * p->s;
    double *w = scratch, *dpr = w + p->s, *dqr = dpr + p->s;
    double *dk = dqr + p->d_qk + 1, *dv = dk + nk * p->d_qk;
    for (int64_t e = 0; e < nk * (p->d_qk + p->d_v); e++) dk[e] = 0.0;
    for (int64_t b = 0; b < p->b; b++)
        for (int64_t h = 0; h < p->h; h++) {
            const int64_t kvh = h / (p->h / p->hkv), kbase = (b * p->hkv + kvh) * p->s;
            for (int64_t i = 0; i < p->n; i++) {
                ref_probs(p, b, h, i, w);
                double delta = 0.0;
                for (int64_t j = 0; j < p->s; j++) {
                    double dot = 0.0;
                    for (int64_t d = 0; d < p->d_v; d++)
                        dot += opf_load_elem(p->dout, off4(p->dos, b, h, i, d), p->dt) *
                               opf_load_elem(p->v, off4(p->vs, b, kvh, j, d), p->dt);
                    dpr[j] = dot;
                    delta += w[j] * dot;
                }
                for (int64_t d = 0; d < p->d_qk; d++) dqr[d] = 0.0;
                for (int64_t j = 0; j < p->s; j++) {
                    const double ds = w[j] * (dpr[j] - delta) * p->scale;
                    for (int64_t d = 0; d < p->d_v; d++)
                        dv[(kbase + j) * p->d_v + d] += w[j] * opf_load_elem(p->dout, off4(p->dos, b, h, i, d), p->dt);
                    for (int64_t d = 0; d < p->d_qk; d++) {
                        dk[(kbase + j) * p->d_qk + d] += ds * opf_load_elem(p->q, off4(p->qs, b, h, i, d), p->dt);
                        dqr[d] += ds * opf_load_elem(p->k, off4(p->ks, b, kvh, j, d), p->dt);
                    }
                }
                for (int64_t d = 0; d < p->d_qk; d++) opf_store_elem(p->dq, off4(p->dqs, b, h, i, d), p->dt, dqr[d]);
            }
        }
    for (int64_t b = 0; b < p->b; b++)
        for (int64_t kvh = 0; kvh < p->hkv; kvh++)
            for (int64_t j = 0; j < p->s; j++) {
                const int64_t r = (b * p->hkv + kvh) * p->s + j;
                for (int64_t d = 0; d < p->d_qk; d++)
                    opf_store_elem(p->dk, off4(p->dks, b, kvh, j, d), p->dt, dk[r * p->d_qk + d]);
                for (int64_t d = 0; d < p->d_v; d++)
                    opf_store_elem(p->dv, off4(p->dvs, b, kvh, j, d), p->dt, dv[r * p->d_v + d]);
            }
}
