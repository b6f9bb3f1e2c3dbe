/* The activation gradient, AVX2 + FMA: act_grad8 of act_avx2.h, 8 lanes. */
#include <immintrin.h>

#include "act.h"
#include "act_avx2.h"

/* The tail goes through the same vector code on a padded copy: an element's
 * value must not depend on where a thread's range of columns ends (libm's
 * scalar erff / expf round differently), or the gradients would change with
 * the thread count. */
static void act_grad_8wide(float *out, const float *g, const float *pre, int64_t n, act_kind act) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(g + i), act_grad8(act, _mm256_loadu_ps(pre + i))));
    if (i < n) {
        float gt[8] = {0}, pt[8] = {0}, ot[8];
        for (int64_t e = i; e < n; e++) gt[e - i] = g[e], pt[e - i] = pre[e];
        _mm256_storeu_ps(ot, _mm256_mul_ps(_mm256_loadu_ps(gt), act_grad8(act, _mm256_loadu_ps(pt))));
        for (int64_t e = i; e < n; e++) out[e] = ot[e - i];
    }
}

const act_kernels act_kernels_avx2 = {.name = "avx2", .isa = OPF_ISA_AVX2, .grad = act_grad_8wide};
