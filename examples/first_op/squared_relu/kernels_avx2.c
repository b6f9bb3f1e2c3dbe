/* >>> kernels: y = relu(x)^2, dx = 2 * relu(x) * dy, 8 floats at a time */

static void fwd_avx2(float *y, const float *x, int64_t n, int64_t y_s, int64_t x_s) {
    int64_t i = 0;
    if (y_s == 1 && x_s == 1) {
        const __m256 zero = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            /* max(0, x) returns its second operand, x, where x is NaN: as the reference, and torch.relu */
            const __m256 r = _mm256_max_ps(zero, _mm256_loadu_ps(x + i));
            _mm256_storeu_ps(y + i, _mm256_mul_ps(r, r));
        }
    }
    squared_relu_kernels_ref.fwd(y + i * y_s, x + i * x_s, n - i, y_s, x_s);
}

static void bwd_avx2(float *dx, const float *dy, const float *x, int64_t n, int64_t dx_s, int64_t dy_s, int64_t x_s) {
    int64_t i = 0;
    if (dx_s == 1 && dy_s == 1 && x_s == 1) {
        const __m256 zero = _mm256_setzero_ps(), two = _mm256_set1_ps(2.0f);
        for (; i + 8 <= n; i += 8) {
            const __m256 r = _mm256_max_ps(zero, _mm256_loadu_ps(x + i));
            _mm256_storeu_ps(dx + i, _mm256_mul_ps(_mm256_mul_ps(two, r), _mm256_loadu_ps(dy + i)));
        }
    }
    squared_relu_kernels_ref.bwd(dx + i * dx_s, dy + i * dy_s, x + i * x_s, n - i, dx_s, dy_s, x_s);
}
/* <<< kernels */
