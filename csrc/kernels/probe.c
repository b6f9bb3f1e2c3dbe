/* Peak probes (see probe.h). */
#include <stddef.h>

#include "probe.h"

const probe_kernels probe_kernels_ref = {.name = "ref", .isa = OPF_ISA_REF, .fma = NULL};

/* The ISA files are left out of builds for other architectures: weak references resolve to NULL there. */
extern const probe_kernels probe_kernels_avx2 __attribute__((weak));
extern const probe_kernels probe_kernels_avx512 __attribute__((weak));

const opf_variants probe_variants =
    OPF_VARIANTS("probe", &probe_kernels_ref, &probe_kernels_avx2, &probe_kernels_avx512);

const probe_kernels *probe_kernels_for(opf_isa isa) { return opf_variant_pick(&probe_variants, isa); }

double probe_fma(opf_isa isa, int64_t iters) {
    float sink[8];
    const probe_kernels *kern = probe_kernels_for(isa);
    return kern->fma ? kern->fma(iters, sink) : 0.0;
}
