/*
 * opforge runtime: CPU features and ISA dispatch, parallel_for, logging,
 * strided n-d iteration. Pure C, no torch: the C tests link it standalone.
 */
#ifndef OPFORGE_RUNTIME_H
#define OPFORGE_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- ISA ------------------------------------------------------------------ */

/* Ordered: a later ISA implies every earlier one is usable. avx512_bf16 is
 * avx512 plus the AVX512-BF16 dot products (bfloat16 GEMMs); amx is
 * avx512_bf16 plus AMX-BF16 tiles, once the kernel has granted this process
 * the tile state (Linux: arch_prctl ARCH_REQ_XCOMP_PERM, asked on first use;
 * refused, the CPU's best is avx512_bf16). */
typedef enum opf_isa {
    OPF_ISA_REF = 0,
    OPF_ISA_AVX2,
    OPF_ISA_AVX512,
    OPF_ISA_AVX512_BF16,
    OPF_ISA_AMX,
    OPF_ISA_COUNT
} opf_isa;

typedef struct opf_cpu_features {
    int avx2, fma, f16c;                                   /* AVX2 path needs all three */
    int avx512f, avx512bw, avx512vl, avx512dq, avx512bf16; /* AVX-512 path: f, bw, vl, dq */
    int amx_tile, amx_bf16;
    int os_avx, os_avx512; /* XCR0 lets us use the registers */
    int os_amx;            /* XCR0 has the tile state (XTILECFG, XTILEDATA) */
    char model[64];
    /* cpuid leaf 1's signature (family and model extended as Intel and AMD define them): one brand
     * string ("Intel(R) Xeon(R) Processor" under many hypervisors) can name several generations */
    int family, model_number, stepping;
} opf_cpu_features;

const opf_cpu_features *opf_cpu(void);
const char *opf_isa_name(opf_isa isa);
/* Best ISA this CPU supports. */
opf_isa opf_isa_best(void);
/* ISA every kernel should use now (best, or what OPFORGE_ISA / opf_isa_set chose). */
opf_isa opf_isa_current(void);
/* Parses a name ("ref", "avx2", "avx512", "avx512_bf16", "amx", or "" / "auto" for the best) and makes
 * it current. Returns 0, or -1 with a message naming the valid choices in err. */
int opf_isa_set(const char *name, char *err, size_t errlen);
/* Reads OPFORGE_ISA and OPFORGE_LOG_LEVEL / OPFORGE_LOG_FILE. 0 or -1 with err. */
int opf_runtime_init(char *err, size_t errlen);

/* ---- kernel variants ---------------------------------------------------------- */

/* Every variant table of a kernel family (gemm_kernels, attention_kernels, ...)
 * begins with these two members, so that one function chooses among any
 * family's tables and one listing names them all. */
#define OPF_VARIANT_HEAD                                                  \
    const char *name; /* "avx2_6x16": the ISA, then what sets it apart */ \
    opf_isa isa       /* the ISA its code needs */

typedef struct opf_variant {
    OPF_VARIANT_HEAD;
} opf_variant;

/* A kernel family's variant tables, the reference first. An entry is NULL
 * where the build leaves its ISA file out (a weak reference), so the list has
 * a count, not a NULL end. */
typedef struct opf_variants {
    const char *family; /* "gemm" */
    int count;
    const void *const *tables; /* each begins with OPF_VARIANT_HEAD */
} opf_variants;

#define OPF_VARIANTS(FAMILY, ...)                                                                            \
    {                                                                                                        \
        .family = FAMILY, .count = (int)(sizeof((const void *const[]){__VA_ARGS__}) / sizeof(const void *)), \
        .tables = (const void *const[]) {                                                                    \
            __VA_ARGS__                                                                                      \
        }                                                                                                    \
    }

/* The table of vs for isa: of those present whose ISA isa includes, the one
 * needing the latest ISA (the later entry on a tie). The reference needs
 * OPF_ISA_REF, so there is always one. At OPFORGE_LOG_LEVEL=info the pick is
 * noted (opf_log_note_pick), so that the op's log line names the variant that
 * ran, not merely the best ISA of the machine. */
const void *opf_variant_pick(const opf_variants *vs, opf_isa isa);
/* The same choice, not noted: for listings (opforge info), which run nothing. */
const void *opf_variant_best(const opf_variants *vs, opf_isa isa);
/* A kernel picked from vs ran `ran` (a table of vs, usually the reference) instead, for reason why
 * ("stride-0 gradient"; copied, at most 47 characters): the call's log line names it
 * family:picked->ran (why), and its ISA is the highest ISA that actually ran. Call it once per call
 * where the choice is made (a driver, before its opf_parallel_for), not per row; from a worker of
 * opf_parallel_for it reaches the caller's line too. Below info level it is one load and a return. */
void opf_variant_fallback(const opf_variants *vs, const void *ran, const char *why);
/* What a driver runs: picked, or where why is not NULL the reference (vs's first table), reported
 * through opf_variant_fallback unless picked is the reference already. */
const void *opf_variant_or_ref(const opf_variants *vs, const void *picked, const char *why);

/* ---- parallel_for ------------------------------------------------------------ */

typedef void (*opf_range_fn)(int64_t begin, int64_t end, void *ctx);
typedef struct opf_parallel_backend {
    /* Splits [begin, end) into chunks of at least grain and calls fn on each. */
    void (*parallel_for)(int64_t begin, int64_t end, int64_t grain, opf_range_fn fn, void *ctx);
    int (*num_threads)(void);
} opf_parallel_backend;

/* Default backend: pthreads, OPFORGE_NUM_THREADS or the online CPU count.
 * Inside PyTorch the glue installs torch's intra-op pool instead. */
void opf_parallel_set_backend(const opf_parallel_backend *backend);
void opf_parallel_for(int64_t begin, int64_t end, int64_t grain, opf_range_fn fn, void *ctx);
int opf_num_threads(void);

/* ---- logging ----------------------------------------------------------------- */

typedef enum opf_log_level { OPF_LOG_ERROR = 0, OPF_LOG_WARNING, OPF_LOG_INFO, OPF_LOG_DEBUG } opf_log_level;

extern int opf_log_level_value; /* read on every call: keep it a plain load */
static inline int opf_log_enabled(opf_log_level level) { return (int)level <= opf_log_level_value; }
int opf_log_set_level(const char *name, char *err, size_t errlen);
/* source names what asked for the file (an environment variable, a function)
 * in the message when it cannot be opened. */
int opf_log_set_file(const char *path, const char *source, char *err, size_t errlen);
void opf_log(opf_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
double opf_now_us(void);

/* Kernel variants picked by this thread, for the call's log line: opf_variant_pick
 * notes each pick (at info level, with the time), opf_variant_fallback each
 * fallback (the variant picked from the family, the default picked where the
 * call noted no pick of it); opf_log_take_picks writes those noted since t0_us
 * as "family:variant,..." into buf (a pick that fell back as
 * "family:picked->ran (why)"), forgets every noted pick, and returns the
 * highest ISA among those that ran, or -1 where the call picked none (an op
 * that chooses its kernels without a variant table). */
void opf_log_note_pick(const char *family, const char *variant, opf_isa isa);
void opf_log_note_fallback(const char *family, const char *picked, const char *ran, opf_isa isa, const char *why);
int opf_log_take_picks(double t0_us, char *buf, size_t len);
/* Where this thread notes picks: its own record, or while it runs a chunk of another
 * thread's opf_parallel_for (at info level), that thread's, so that what a worker
 * notes reaches the caller's log line. opf_log_record_use returns the record used before. */
typedef struct opf_log_record opf_log_record;
opf_log_record *opf_log_record_current(void);
opf_log_record *opf_log_record_use(opf_log_record *record);

/* ---- strided n-d iteration for elementwise kernels -------------------------- */

#define OPF_MAX_DIMS 64
#define OPF_MAX_OPERANDS 8 /* an elementwise backward of three inputs: 3 gradients, dy, 3 inputs */

/* Operand 0 is the output. Dims of size 1 are dropped, dims are ordered so the
 * output's smallest stride is innermost, and neighbours that are contiguous in
 * every operand are merged: a dense tensor becomes one dim of stride 1. */
typedef struct opf_nd {
    int ndim, nops;
    int64_t numel;
    int64_t size[OPF_MAX_DIMS];                     /* innermost last */
    int64_t stride[OPF_MAX_OPERANDS][OPF_MAX_DIMS]; /* in elements */
} opf_nd;

void opf_nd_init(opf_nd *nd, int ndim, const int64_t *sizes, int nops, const int64_t *const *strides);

/* One run along the innermost dim: n elements, operand k starts at element
 * offset off[k] and steps by stride[k]. */
typedef void (*opf_segment_fn)(void *ctx, const int64_t *off, const int64_t *stride, int64_t n);
/* Calls fn for every innermost run covering flat logical indices [begin, end). */
void opf_nd_segments(const opf_nd *nd, int64_t begin, int64_t end, opf_segment_fn fn, void *ctx);

/* The elementwise driver: splits [0, numel) over opf_parallel_for in chunks of
 * at least grain elements and calls fn on every run of each chunk. */
void opf_nd_parallel(const opf_nd *nd, int64_t grain, opf_segment_fn fn, void *ctx);

/* At OPFORGE_LOG_LEVEL=debug: how op will walk nd (dims after merging, the
 * innermost strides, the chunks it splits into). */
void opf_nd_log(const char *op, const opf_nd *nd, int64_t grain);

/* Dense and non-overlapping: some permutation of the dims is contiguous.
 * Elementwise outputs copy such a layout (as torch.empty_like does) so that
 * input and output can be walked as one flat array. */
int opf_is_dense(int ndim, const int64_t *sizes, const int64_t *strides);
/* Strides of a new output with `sizes`, copying `like_strides` when that layout
 * is dense, row-major contiguous otherwise. */
void opf_output_strides(int ndim, const int64_t *sizes, const int64_t *like_strides, int64_t *out_strides);

#ifdef __cplusplus
}
#endif

#endif
