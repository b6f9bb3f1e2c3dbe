/* {name}: the kernel contract shared by the reference and the ISA variants.
 * n elements; y / dx advance by ys / dxs, x by xs, dy by dys (in elements). */
#ifndef {NAME}_H
#define {NAME}_H

#include <stdint.h>

typedef struct {name}_kernels {
    void (*fwd)(float *y, const float *x, int64_t n, int64_t ys, int64_t xs, float alpha);
    void (*bwd)(float *dx, const float *dy, const float *x, int64_t n, int64_t dxs, int64_t dys,
                int64_t xs, float alpha);
} {name}_kernels;

extern const {name}_kernels {name}_kernels_ref;

#endif
