/* >>> kernels: y[r] = sum_i a[r, i] * b[r, i]; da[r, i] = dy[r] * b[r, i], db[r, i] = dy[r] * a[r, i] */

static float fwd_ref(const float *a, const float *b, int64_t n, int64_t a_s, int64_t b_s) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += a[i * a_s] * b[i * b_s];
    return sum;
}

static void bwd_ref(float *da, float *db, float dy, const float *a, const float *b, int64_t n, int64_t da_s,
                    int64_t db_s, int64_t a_s, int64_t b_s) {
    for (int64_t i = 0; i < n; i++) {
        da[i * da_s] = dy * b[i * b_s];
        db[i * db_s] = dy * a[i * a_s];
    }
}
/* <<< kernels */
