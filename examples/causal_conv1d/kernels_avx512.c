/* >>> kernels: z for 16 positions at a time, the taps added in the reference's order; SiLU with a vector
 * exp (Cephes' polynomial: within 2 ulp of expf, so within float32's tolerance of the reference, not its
 * bits); dweight and dbias sum in 16 lanes (another order). Rows of other strides run the reference,
 * reported by opf_variant_fallback. */

static float silu(float z) { return z / (1.0f + expf(-z)); }

static float dsilu(float z) {
    const float s = 1.0f / (1.0f + expf(-z));
    return s * (1.0f + z * (1.0f - s));
}

/* exp(x) for 16 floats: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, 2^n into the exponent */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* 1 / (1 + exp(-z)) for 16 floats */
static inline __m512 sigmoid16(__m512 z) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), z))));
}

/* y[t] = silu(y[t]), in place */
static void silu_row(float *y, int64_t n) {
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        const __m512 z = _mm512_loadu_ps(y + t);
        _mm512_storeu_ps(y + t, _mm512_mul_ps(z, sigmoid16(z)));
    }
    for (; t < n; t++) y[t] = silu(y[t]);
}

/* dz[t] = dy[t] * silu'(z[t]), z in dz, in place */
static void dsilu_row(float *dz, const float *dy, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        const __m512 z = _mm512_loadu_ps(dz + t), s = sigmoid16(z);
        const __m512 d = _mm512_mul_ps(s, _mm512_add_ps(one, _mm512_mul_ps(z, _mm512_sub_ps(one, s))));
        _mm512_storeu_ps(dz + t, _mm512_mul_ps(_mm512_loadu_ps(dy + t), d));
    }
    for (; t < n; t++) dz[t] = dy[t] * dsilu(dz[t]);
}

/* z[t] for t < n into out (stride 1), x of stride 1 */
static void conv_row(float *out, const float *x, int64_t n, const float *w, float b, int64_t W) {
    int64_t t = 0;
    for (; t < n && t < W - 1; t++) { /* the first W - 1 positions: taps before t = 0 are zero */
        float z = b;
        for (int64_t k = W - 1 - t; k < W; k++) z += w[k] * x[t - W + 1 + k];
        out[t] = z;
    }
    for (; t + 16 <= n; t += 16) {
        __m512 z = _mm512_set1_ps(b);
        for (int64_t k = 0; k < W; k++)
            z = _mm512_add_ps(z, _mm512_mul_ps(_mm512_set1_ps(w[k]), _mm512_loadu_ps(x + t - W + 1 + k)));
        _mm512_storeu_ps(out + t, z);
    }
    for (; t < n; t++) {
        float z = b;
        for (int64_t k = 0; k < W; k++) z += w[k] * x[t - W + 1 + k];
        out[t] = z;
    }
}

static void fwd_avx512(float *y, int64_t y_s, const float *x, int64_t x_s, int64_t n, int64_t row,
                       const causal_conv1d_args *a) {
    if (y_s != 1 || x_s != 1) { /* a strided row: the reference runs it, and the log line says so */
        opf_variant_fallback(&causal_conv1d_variants, &causal_conv1d_kernels_ref, "strided row");
        causal_conv1d_kernels_ref.fwd(y, y_s, x, x_s, n, row, a);
        return;
    }
    const int64_t W = a->s.W, d = row % a->s.D;
    conv_row(y, x, n, a->weight + d * W, a->bias ? a->bias[d] : 0.0f, W);
    if (a->s.activation == 1) silu_row(y, n);
}

static void bwd_avx512(float *dx, int64_t dx_s, const float *dy, int64_t dy_s, const float *x, int64_t x_s, int64_t n,
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
        dsilu_row(dx, dy, n);
    } else {
        memcpy(dx, dy, (size_t)n * sizeof(float));
    }
    if (g->bias || g->weight) {
        for (int64_t k = 0; k < W; k++) { /* dweight[d, k] += sum_t dz[t] * x[t - W + 1 + k] */
            const int64_t t0 = W - 1 - k;
            __m512 acc = _mm512_setzero_ps();
            int64_t t = t0;
            for (; t + 16 <= n; t += 16)
                acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(dx + t), _mm512_loadu_ps(x + t - t0)));
            float sum = _mm512_reduce_add_ps(acc);
            for (; t < n; t++) sum += dx[t] * x[t - t0];
            if (g->weight) g->weight[d * W + k] += sum;
        }
        if (g->bias) {
            __m512 acc = _mm512_setzero_ps();
            int64_t t = 0;
            for (; t + 16 <= n; t += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(dx + t));
            float sum = _mm512_reduce_add_ps(acc);
            for (; t < n; t++) sum += dx[t];
            g->bias[d] += sum;
        }
    }
    int64_t s = 0; /* dx[s] = sum_k w[k] * dz[s + W - 1 - k]: a block reads dz[s .. s + W + 14] before it writes */
    for (; s + 16 + W - 1 <= n; s += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < W; k++)
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(w[k]), _mm512_loadu_ps(dx + s + W - 1 - k)));
        _mm512_storeu_ps(dx + s, acc);
    }
    for (; s < n; s++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < W; k++)
            if (s + W - 1 - k < n) acc += w[k] * dx[s + W - 1 - k];
        dx[s] = acc;
    }
}
/* <<< kernels */
