/* Peak probes (see probe.h). */
#include "probe.h"

extern const probe_fma_fn probe_fma_avx2 __attribute__((weak));
extern const probe_fma_fn probe_fma_avx512 __attribute__((weak));

double probe_fma(opf_isa isa, int64_t iters) {
    float sink[8];
    if (isa >= OPF_ISA_AVX512 && &probe_fma_avx512) return probe_fma_avx512(iters, sink);
    if (isa >= OPF_ISA_AVX2 && &probe_fma_avx2) return probe_fma_avx2(iters, sink);
    return 0.0;
}
