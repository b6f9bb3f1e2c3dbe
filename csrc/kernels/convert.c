/* Conversions: the scalar reference, the variant list and the threaded drivers. See convert.h. */
#include "convert.h"

static void to_f32_ref(float *dst, const uint16_t *src, opf_dtype dt, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = dt == OPF_BF16 ? opf_bf16_to_f32(src[i]) : opf_f16_to_f32(src[i]);
}

static void from_f32_ref(uint16_t *dst, const float *src, opf_dtype dt, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = dt == OPF_BF16 ? opf_f32_to_bf16(src[i]) : opf_f32_to_f16(src[i]);
}

const convert_kernels convert_kernels_ref = {
    .name = "ref", .isa = OPF_ISA_REF, .to_f32 = to_f32_ref, .from_f32 = from_f32_ref};

/* The ISA files are left out of builds for other architectures: weak references resolve to NULL there. */
extern const convert_kernels convert_kernels_avx2 __attribute__((weak));
extern const convert_kernels convert_kernels_avx512 __attribute__((weak));

const opf_variants convert_variants =
    OPF_VARIANTS("convert", &convert_kernels_ref, &convert_kernels_avx2, &convert_kernels_avx512);

const convert_kernels *convert_kernels_for(opf_isa isa) { return opf_variant_pick(&convert_variants, isa); }

typedef struct convert_job {
    const convert_kernels *kern;
    void *dst;
    const void *src;
    opf_dtype dt;
    int to_f32;
} convert_job;

static void convert_range(int64_t begin, int64_t end, void *ctx) {
    const convert_job *job = ctx;
    if (job->to_f32)
        job->kern->to_f32((float *)job->dst + begin, (const uint16_t *)job->src + begin, job->dt, end - begin);
    else
        job->kern->from_f32((uint16_t *)job->dst + begin, (const float *)job->src + begin, job->dt, end - begin);
}

void convert_load_f32(const convert_kernels *kern, float *dst, const void *src, opf_dtype dt, int64_t n,
                      int64_t stride) {
    if (dt != OPF_F32 && stride == 1) {
        convert_job job = {.kern = kern, .dst = dst, .src = src, .dt = dt, .to_f32 = 1};
        opf_parallel_for(0, n, 1 << 16, convert_range, &job);
        return;
    }
    for (int64_t i = 0; i < n; i++) dst[i] = (float)opf_load_elem(src, i * stride, dt);
}

void convert_store_f32(const convert_kernels *kern, void *dst, opf_dtype dt, const float *src, int64_t n) {
    if (dt == OPF_F32) {
        for (int64_t i = 0; i < n; i++) ((float *)dst)[i] = src[i];
        return;
    }
    convert_job job = {.kern = kern, .dst = dst, .src = src, .dt = dt, .to_f32 = 0};
    opf_parallel_for(0, n, 1 << 16, convert_range, &job);
}
