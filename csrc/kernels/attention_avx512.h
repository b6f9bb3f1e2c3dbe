/*
 * The AVX-512 attention kernels that the AMX table shares (attention_amx.c
 * multiplies bfloat16 blocks on tiles and runs everything else on these).
 */
#ifndef OPFORGE_KERNELS_ATTENTION_AVX512_H
#define OPFORGE_KERNELS_ATTENTION_AVX512_H

#include <stdint.h>

void attention_mm_avx512(int64_t m, int64_t n, int64_t k, const float *a, int64_t rsa, int64_t csa, const float *b,
                         int64_t ldb, float *c, int64_t ldc, int acc);
void attention_softmax_cols_avx512(float *st, int64_t ld, int64_t bk, int64_t bq, float scale, float *m, float *l,
                                   float *alpha, int64_t diag);
void attention_probs_avx512(float *scores, int64_t ld, int64_t bq, int64_t bk, float scale, const float *lse,
                            int64_t diag);
/* B(p, j) = b[p*ldb + j] for p < kc, j < nb (<= 32), rounded to bfloat16 pairs: bp[q * 32 + j] pairs
 * B(2q, j) and B(2q+1, j) (zero past kc), columns past nb zero */
void attention_pack_b_bf16(uint32_t *bp, const float *b, int64_t ldb, int64_t kc, int64_t nb);
void attention_dscores_avx512(float *dp, const float *p, int64_t ld, int64_t bq, int64_t bk, const float *delta,
                              float scale);
/* attention_kernels' transpose and scale_rows */
void attention_transpose_avx512(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols);
void attention_scale_rows_avx512(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols,
                                 const float *f);

#endif
