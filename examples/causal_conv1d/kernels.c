/* >>> kernels: y[b, d, t] = act(z), z = bias[d] + sum_k weight[d, k] * x[b, d, t - W + 1 + k] (x is 0
 * before t = 0); row = b * D + d. The backward: dz = dy * act'(z), dx[s] = sum_k weight[d, k] *
 * dz[s + W - 1 - k], and the row's share of dweight[d, k] and dbias[d]. float, then double. */

static float silu(float z) { return z / (1.0f + expf(-z)); }

static float dsilu(float z) {
    const float s = 1.0f / (1.0f + expf(-z));
    return s * (1.0f + z * (1.0f - s));
}

/* z at t: the taps in order k = 0 .. W-1 (the vector variants add them in the same order) */
static float conv_at(const float *x, int64_t x_s, const float *w, float b, int64_t W, int64_t t) {
    float z = b;
    for (int64_t k = 0; k < W; k++)
        if (t - W + 1 + k >= 0) z += w[k] * x[(t - W + 1 + k) * x_s];
    return z;
}

static void fwd_ref(float *y, int64_t y_s, const float *x, int64_t x_s, int64_t n, int64_t row,
                    const causal_conv1d_args *a) {
    const int64_t W = a->s.W, d = row % a->s.D;
    const float *w = a->weight + d * W, b = a->bias ? a->bias[d] : 0.0f;
    for (int64_t t = 0; t < n; t++) {
        const float z = conv_at(x, x_s, w, b, W, t);
        y[t * y_s] = a->s.activation == 1 ? silu(z) : z;
    }
}

static void bwd_ref(float *dx, int64_t dx_s, const float *dy, int64_t dy_s, const float *x, int64_t x_s, int64_t n,
                    int64_t row, const causal_conv1d_args *a, const causal_conv1d_grads *g) {
    const int64_t W = a->s.W, d = row % a->s.D;
    const float *w = a->weight + d * W, b = a->bias ? a->bias[d] : 0.0f;
    float db = 0.0f;
    for (int64_t t = 0; t < n; t++) { /* dz, kept in dx until dx is written over it below */
        float dz = dy[t * dy_s];
        if (a->s.activation == 1) dz *= dsilu(conv_at(x, x_s, w, b, W, t));
        dx[t * dx_s] = dz;
        db += dz;
        for (int64_t k = 0; k < W; k++)
            if (g->weight && t - W + 1 + k >= 0) g->weight[d * W + k] += dz * x[(t - W + 1 + k) * x_s];
    }
    if (g->bias) g->bias[d] += db;
    for (int64_t s = 0; s < n; s++) { /* ascending: dx[s] reads dz[s .. s + W - 1], not yet written over */
        float acc = 0.0f;
        for (int64_t k = 0; k < W; k++)
            if (s + W - 1 - k < n) acc += w[k] * dx[(s + W - 1 - k) * dx_s];
        dx[s * dx_s] = acc;
    }
}

static double silu64(double z) { return z / (1.0 + exp(-z)); }

static double dsilu64(double z) {
    const double s = 1.0 / (1.0 + exp(-z));
    return s * (1.0 + z * (1.0 - s));
}

static double conv_at64(const double *x, int64_t x_s, const double *w, double b, int64_t W, int64_t t) {
    double z = b;
    for (int64_t k = 0; k < W; k++)
        if (t - W + 1 + k >= 0) z += w[k] * x[(t - W + 1 + k) * x_s];
    return z;
}

void causal_conv1d_fwd64(double *y, int64_t y_s, const double *x, int64_t x_s, int64_t n, int64_t row,
                         const causal_conv1d_args64 *a) {
    const int64_t W = a->s.W, d = row % a->s.D;
    const double *w = a->weight + d * W, b = a->bias ? a->bias[d] : 0.0;
    for (int64_t t = 0; t < n; t++) {
        const double z = conv_at64(x, x_s, w, b, W, t);
        y[t * y_s] = a->s.activation == 1 ? silu64(z) : z;
    }
}

void causal_conv1d_bwd64(double *dx, int64_t dx_s, const double *dy, int64_t dy_s, const double *x, int64_t x_s,
                         int64_t n, int64_t row, const causal_conv1d_args64 *a, const causal_conv1d_grads64 *g) {
    const int64_t W = a->s.W, d = row % a->s.D;
    const double *w = a->weight + d * W, b = a->bias ? a->bias[d] : 0.0;
    double db = 0.0;
    for (int64_t t = 0; t < n; t++) {
        double dz = dy[t * dy_s];
        if (a->s.activation == 1) dz *= dsilu64(conv_at64(x, x_s, w, b, W, t));
        dx[t * dx_s] = dz;
        db += dz;
        for (int64_t k = 0; k < W; k++)
            if (g->weight && t - W + 1 + k >= 0) g->weight[d * W + k] += dz * x[(t - W + 1 + k) * x_s];
    }
    if (g->bias) g->bias[d] += db;
    for (int64_t s = 0; s < n; s++) {
        double acc = 0.0;
        for (int64_t k = 0; k < W; k++)
            if (s + W - 1 - k < n) acc += w[k] * dx[(s + W - 1 - k) * dx_s];
        dx[s * dx_s] = acc;
    }
}
/* <<< kernels */
