/*
 * GEMM reference: the oracles (gemm_ref_f32, gemm_ref_f64), the scalar
 * epilogue every micro-kernel finishes partial tiles with, and the scalar
 * 4 x 4 micro-kernel of the reference table. Contract in gemm.h.
 */
#include <stddef.h>

#include "gemm.h"

static inline uint16_t round16(float v, opf_dtype dt) {
    return dt == OPF_BF16 ? opf_f32_to_bf16(v) : opf_f32_to_f16(v);
}

void gemm_tile_store(const float *acc, int nr, float *c, int64_t rsc, int m, int n, const gemm_tile *t) {
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < n; j++) {
            float v = t->alpha ? acc[i * nr + j] * *t->alpha : acc[i * nr + j];
            if (t->load_c) v += t->beta == 1.0f ? c[i * rsc + j] : t->beta * c[i * rsc + j];
            if (t->bias_n) v += t->bias_n[j];
            if (t->bias_m) v += t->bias_m[i];
            if (t->pre) t->pre[i * t->rsp + j] = v;
            if (t->pre16) t->pre16[i * t->rsp + j] = round16(v, t->dt16);
            if (t->c16)
                t->c16[i * rsc + j] = round16(act_f32(t->act, v), t->dt16);
            else
                c[i * rsc + j] = act_f32(t->act, v);
        }
    }
}

/* ---- the oracles ------------------------------------------------------------------- */

void gemm_ref_f32(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                  int64_t rsb, int64_t csb, float *c, int64_t rsc, const gemm_epilogue *ep) {
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n; j++) {
            double s = 0;
            for (int64_t p = 0; p < k; p++) s += (double)a[i * rsa + p * csa] * b[p * rsb + j * csb];
            float v = (float)(ep->alpha ? s * *ep->alpha : s);
            if (ep->beta != 0.0f) v += ep->beta * c[i * rsc + j];
            if (ep->bias_kind == GEMM_BIAS_ROW) v += ep->bias[j];
            if (ep->bias_kind == GEMM_BIAS_COL) v += ep->bias[i];
            if (ep->preact) ep->preact[i * ep->rsp + j] = v;
            if (ep->pre16) ((uint16_t *)ep->pre16)[i * ep->rsp + j] = round16(v, ep->out_dt);
            if (ep->out16)
                ((uint16_t *)ep->out16)[i * rsc + j] = round16(act_f32(ep->act, v), ep->out_dt);
            else
                c[i * rsc + j] = act_f32(ep->act, v);
        }
    }
}

void gemm_ref_f64(int64_t m, int64_t n, int64_t k, const double *a, int64_t rsa, int64_t csa, const double *b,
                  int64_t rsb, int64_t csb, double *c, int64_t rsc, double beta, const double *bias,
                  int64_t bias_stride, gemm_bias_kind bias_kind, act_kind act, double *preact, int64_t rsp) {
    if (opf_log_enabled(OPF_LOG_INFO)) opf_log_note_pick(gemm_variants.family, "ref_f64", OPF_ISA_REF);
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < n; j++) {
            double v = 0;
            for (int64_t p = 0; p < k; p++) v += a[i * rsa + p * csa] * b[p * rsb + j * csb];
            if (beta != 0.0) v += beta * c[i * rsc + j];
            if (bias_kind == GEMM_BIAS_ROW) v += bias[j * bias_stride];
            if (bias_kind == GEMM_BIAS_COL) v += bias[i * bias_stride];
            if (preact) preact[i * rsp + j] = v;
            c[i * rsc + j] = act_f64(act, v);
        }
    }
}

/* ---- scalar micro-kernel (4 x 4) ------------------------------------------------------ */

static void ukernel_ref_4x4(int64_t depth, const float *ap, const float *bp, float *c, int64_t rsc, int m, int n,
                            const gemm_tile *t) {
    float acc[16] = {0};
    for (int64_t p = 0; p < depth; p++, ap += 4, bp += 4)
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) acc[i * 4 + j] += ap[i] * bp[j];
    gemm_tile_store(acc, 4, c, rsc, m, n, t);
}

const gemm_kernels gemm_kernels_ref = {.name = "ref_4x4",
                                       .isa = OPF_ISA_REF,
                                       .mr = 4,
                                       .nr = 4,
                                       .mc = 64,
                                       .kc = 256,
                                       .nc = 1024,
                                       .ukernel = ukernel_ref_4x4,
                                       .cvt = &convert_kernels_ref,
                                       .act = &act_kernels_ref};
