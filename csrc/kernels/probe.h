/*
 * Peak probes for benchmarks ("% of peak" is against these, measured in the
 * same process): an FMA loop with enough independent accumulators to fill
 * both FMA pipes. Returns the floating-point operations performed.
 */
#ifndef OPFORGE_KERNELS_PROBE_H
#define OPFORGE_KERNELS_PROBE_H

#include <stdint.h>

#include "opforge/runtime.h"

typedef double (*probe_fma_fn)(int64_t iters, float *sink);

typedef struct probe_kernels {
    OPF_VARIANT_HEAD;
    probe_fma_fn fma; /* NULL: no probe (the reference: a scalar loop says nothing of the vector peak) */
} probe_kernels;

extern const probe_kernels probe_kernels_ref;
extern const probe_kernels probe_kernels_avx2;   /* probe_avx2.c */
extern const probe_kernels probe_kernels_avx512; /* probe_avx512.c */
extern const opf_variants probe_variants;

const probe_kernels *probe_kernels_for(opf_isa isa);

/* FLOPs of `iters` rounds of the best FMA loop of isa (0 when it has none). */
double probe_fma(opf_isa isa, int64_t iters);

#endif
