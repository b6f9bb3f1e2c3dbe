/* >>> kernels: z for 8 positions at a time, the taps added in the reference's order (so the forward
 * and dx are the reference's bits); dweight and dbias sum in 8 lanes (another order: within a float32
 * sum's tolerance). Rows of other strides run the reference, reported by opf_variant_fallback. */

static float silu(float z) { return z / (1.0f + expf(-z)); }

static float dsilu(float z) {
    const float s = 1.0f / (1.0f + expf(-z));
    return s * (1.0f + z * (1.0f - s));
}

/* z[t] for t < n into out (stride 1), x of stride 1 */
static void conv_row(float *out, const float *x, int64_t n, const float *w, float b, int64_t W) {
    int64_t t = 0;
    for (; t < n && t < W - 1; t++) { /* the first W - 1 positions: taps before t = 0 are zero */
        float z = b;
        for (int64_t k = W - 1 - t; k < W; k++) z += w[k] * x[t - W + 1 + k];
        out[t] = z;
    }
    for (; t + 8 <= n; t += 8) {
        __m256 z = _mm256_set1_ps(b);
        for (int64_t k = 0; k < W; k++)
            z = _mm256_add_ps(z, _mm256_mul_ps(_mm256_set1_ps(w[k]), _mm256_loadu_ps(x + t - W + 1 + k)));
        _mm256_storeu_ps(out + t, z);
    }
    for (; t < n; t++) {
        float z = b;
        for (int64_t k = 0; k < W; k++) z += w[k] * x[t - W + 1 + k];
        out[t] = z;
    }
}

static void fwd_avx2(float *y, int64_t y_s, const float *x, int64_t x_s, int64_t n, int64_t row,
                     const causal_conv1d_args *a) {
    if (y_s != 1 || x_s != 1) { /* a strided row: the reference runs it, and the log line says so */
        opf_variant_fallback(&causal_conv1d_variants, &causal_conv1d_kernels_ref, "strided row");
        causal_conv1d_kernels_ref.fwd(y, y_s, x, x_s, n, row, a);
        return;
    }
    const int64_t W = a->s.W, d = row % a->s.D;
    conv_row(y, x, n, a->weight + d * W, a->bias ? a->bias[d] : 0.0f, W);
    if (a->s.activation == 1)
        for (int64_t t = 0; t < n; t++) y[t] = silu(y[t]);
}

static void bwd_avx2(float *dx, int64_t dx_s, const float *dy, int64_t dy_s, const float *x, int64_t x_s, int64_t n,
                     int64_t row, const causal_conv1d_args *a, const causal_conv1d_grads *g) {
    if (dx_s != 1 || dy_s != 1 || x_s != 1) { /* a strided row, or a stride-0 gradient (y.sum().backward()) */
        opf_variant_fallback(&causal_conv1d_variants, &causal_conv1d_kernels_ref, "strided row");
        causal_conv1d_kernels_ref.bwd(dx, dx_s, dy, dy_s, x, x_s, n, row, a, g);
        return;
    }
    const int64_t W = a->s.W, d = row % a->s.D;
    const float *w = a->weight + d * W;
    if (a->s.activation == 1) { /* dz = dy * silu'(z), in dx */
        conv_row(dx, x, n, w, a->bias ? a->bias[d] : 0.0f, W);
        for (int64_t t = 0; t < n; t++) dx[t] = dy[t] * dsilu(dx[t]);
    } else {
        memcpy(dx, dy, (size_t)n * sizeof(float));
    }
    if (g->bias || g->weight) {
        for (int64_t k = 0; k < W; k++) { /* dweight[d, k] += sum_t dz[t] * x[t - W + 1 + k] */
            const int64_t t0 = W - 1 - k;
            __m256 acc = _mm256_setzero_ps();
            int64_t t = t0;
            for (; t + 8 <= n; t += 8)
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(dx + t), _mm256_loadu_ps(x + t - t0)));
            float sum = hsum8(acc);
            for (; t < n; t++) sum += dx[t] * x[t - t0];
            if (g->weight) g->weight[d * W + k] += sum;
        }
        if (g->bias) {
            __m256 acc = _mm256_setzero_ps();
            int64_t t = 0;
            for (; t + 8 <= n; t += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(dx + t));
            float sum = hsum8(acc);
            for (; t < n; t++) sum += dx[t];
            g->bias[d] += sum;
        }
    }
    int64_t s = 0; /* dx[s] = sum_k w[k] * dz[s + W - 1 - k]: a block reads dz[s .. s + W + 6] before it writes */
    for (; s + 8 + W - 1 <= n; s += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < W; k++)
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(w[k]), _mm256_loadu_ps(dx + s + W - 1 - k)));
        _mm256_storeu_ps(dx + s, acc);
    }
    for (; s < n; s++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < W; k++)
            if (s + W - 1 - k < n) acc += w[k] * dx[s + W - 1 - k];
        dx[s] = acc;
    }
}
/* <<< kernels */
