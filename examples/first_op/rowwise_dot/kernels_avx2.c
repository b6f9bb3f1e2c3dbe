/* >>> kernels: the row's dot product in 8 partial sums (added at the end: the reference's single
 * running sum rounds differently, within a float32 reduction's tolerance); the backward exactly */

static float fwd_avx2(const float *a, const float *b, int64_t n, int64_t a_s, int64_t b_s) {
    if (a_s != 1 || b_s != 1) return rowwise_dot_kernels_ref.fwd(a, b, n, a_s, b_s);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    float sum = hsum8(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static void bwd_avx2(float *da, float *db, float dy, const float *a, const float *b, int64_t n, int64_t da_s,
                     int64_t db_s, int64_t a_s, int64_t b_s) {
    int64_t i = 0;
    if (da_s == 1 && db_s == 1 && a_s == 1 && b_s == 1) {
        const __m256 g = _mm256_set1_ps(dy);
        for (; i + 8 <= n; i += 8) {
            _mm256_storeu_ps(da + i, _mm256_mul_ps(g, _mm256_loadu_ps(b + i)));
            _mm256_storeu_ps(db + i, _mm256_mul_ps(g, _mm256_loadu_ps(a + i)));
        }
    }
    rowwise_dot_kernels_ref.bwd(da + i * da_s, db + i * db_s, dy, a + i * a_s, b + i * b_s, n - i, da_s, db_s, a_s,
                                b_s);
}
/* <<< kernels */
