/* >>> kernels: y = relu(x)^2, dx = 2 * relu(x) * dy */

static void fwd_ref(float *y, const float *x, int64_t n, int64_t y_s, int64_t x_s) {
    for (int64_t i = 0; i < n; i++) {
        const float r = x[i * x_s] < 0.0f ? 0.0f : x[i * x_s]; /* NaN stays NaN, as torch.relu */
        y[i * y_s] = r * r;
    }
}

static void bwd_ref(float *dx, const float *dy, const float *x, int64_t n, int64_t dx_s, int64_t dy_s, int64_t x_s) {
    for (int64_t i = 0; i < n; i++) {
        const float r = x[i * x_s] < 0.0f ? 0.0f : x[i * x_s]; /* NaN stays NaN, as torch.relu */
        dx[i * dx_s] = 2.0f * r * dy[i * dy_s];
    }
}
/* <<< kernels */
