/*
 * L1 glue shared by every op: argument unpacking, validation with clear
 * errors, output allocation, per-call logging, the parallel backend over
 * torch's intra-op pool, and the entry points the Python layer calls. The
 * ops' registration on torch's stable C ABI is register.c.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/convert.h"
#include "../kernels/probe.h"
#include "namespace.h"
#include "opforge/op.h"
#include "pages.h"
#include "registry.h"

/* ---- errors ------------------------------------------------------------------ */

void opf_fail(const char *op, const char *fmt, ...) {
    char msg[1024];
    int n = snprintf(msg, sizeof msg, "[%s] ", op);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg + n, sizeof msg - (size_t)n, fmt, ap);
    va_end(ap);
    /* Throws c10::Error (RuntimeError in Python); the library is built with
     * -fexceptions so the unwind runs the OPF_OWNED cleanups of our frames. */
    aoti_torch_check(false, op, __FILE__, __LINE__, msg);
    __builtin_unreachable();
}

#define OPF_TRY(op, call)                                                                 \
    do {                                                                                  \
        if ((call) != OPF_AOTI_SUCCESS) opf_fail(op, "internal error: %s failed", #call); \
    } while (0)

void opf_tensor_release(AtenTensorHandle *h) {
    if (*h) aoti_torch_delete_tensor_object(*h);
    *h = NULL;
}

/* ---- dtypes ------------------------------------------------------------------ */

typedef struct dtype_entry {
    int32_t code;
    const char *name;
} dtype_entry;

/* Every dtype the stable ABI names, so that a message can name what it
 * rejects; the first four in opf_dtype order. A NULL getter is a weak symbol
 * this torch lacks. */
static const struct {
    int32_t (*code)(void);
    const char *name;
} dtype_getters[] = {
    {aoti_torch_dtype_float32, "float32"},
    {aoti_torch_dtype_float64, "float64"},
    {aoti_torch_dtype_bfloat16, "bfloat16"},
    {aoti_torch_dtype_float16, "float16"},
    {aoti_torch_dtype_uint8, "uint8"},
    {aoti_torch_dtype_uint16, "uint16"},
    {aoti_torch_dtype_uint32, "uint32"},
    {aoti_torch_dtype_uint64, "uint64"},
    {aoti_torch_dtype_int8, "int8"},
    {aoti_torch_dtype_int16, "int16"},
    {aoti_torch_dtype_int32, "int32"},
    {aoti_torch_dtype_int64, "int64"},
    {aoti_torch_dtype_bool, "bool"},
    {aoti_torch_dtype_complex32, "complex32"},
    {aoti_torch_dtype_complex64, "complex64"},
    {aoti_torch_dtype_complex128, "complex128"},
    {aoti_torch_dtype_float8_e5m2, "float8_e5m2"},
    {aoti_torch_dtype_float8_e4m3fn, "float8_e4m3fn"},
    {aoti_torch_dtype_float8_e5m2fnuz, "float8_e5m2fnuz"},
    {aoti_torch_dtype_float8_e4m3fnuz, "float8_e4m3fnuz"},
    {aoti_torch_dtype_float8_e8m0fnu, "float8_e8m0fnu"},
    {aoti_torch_dtype_float4_e2m1fn_x2, "float4_e2m1fn_x2"},
};
#define OPF_NDTYPE_GETTERS ((int)(sizeof dtype_getters / sizeof dtype_getters[0]))
static dtype_entry dtypes[OPF_NDTYPE_GETTERS];
static int ndtypes;

static void dtypes_init(void) {
    for (int i = 0; i < OPF_NDTYPE_GETTERS; i++)
        if (dtype_getters[i].code) dtypes[ndtypes++] = (dtype_entry){dtype_getters[i].code(), dtype_getters[i].name};
}

const char *opf_dtype_name(int32_t code) {
    for (int i = 0; i < ndtypes; i++)
        if (dtypes[i].code == code) return dtypes[i].name;
    /* A few buffers per thread: one message may name two unknown dtypes. */
    static _Thread_local char unknown[4][32];
    static _Thread_local unsigned next;
    char *buf = unknown[next++ % 4];
    snprintf(buf, sizeof unknown[0], "dtype code %d", (int)code);
    return buf;
}

/* ---- arguments --------------------------------------------------------------- */

/* An optional argument arrives as a pointer to a boxed value, NULL for None.
 * Returns 1 and the value, or 0; frees the box. */
static int unbox_optional(StableIValue v, StableIValue *value) {
    StableIValue *box = (StableIValue *)(uintptr_t)v;
    if (box == NULL) return 0;
    *value = *box;
    /* torch >= 2.13 allocates the box with torch_new_stable_ivalue; older
     * releases with C++ new, whose memory comes from malloc */
    if (torch_delete_stable_ivalue)
        torch_delete_stable_ivalue(box);
    else
        free(box);
    return 1;
}

AtenTensorHandle opf_arg_optional_tensor(StableIValue v) {
    StableIValue value;
    return unbox_optional(v, &value) ? (AtenTensorHandle)value : NULL;
}

int opf_arg_optional_double(StableIValue v, double *out) {
    StableIValue value;
    if (!unbox_optional(v, &value)) return 0;
    *out = opf_arg_double(value);
    return 1;
}

double opf_arg_double(StableIValue v) {
    double d;
    memcpy(&d, &v, sizeof d);
    return d;
}

int64_t opf_arg_int(StableIValue v) { return (int64_t)v; }
int opf_arg_bool(StableIValue v) { return (int)(v & 0xff); }

/* The next value of a "none | silu | gelu" list from *p on, blanks around it left out, and its length;
 * NULL past the last. */
static const char *enum_next(const char **p, size_t *len) {
    const char *s = *p;
    if (s == NULL) return NULL;
    const char *bar = strchr(s, '|'), *end = bar ? bar : s + strlen(s);
    *p = bar ? bar + 1 : NULL;
    while (s < end && *s == ' ') s++;
    while (end > s && end[-1] == ' ') end--;
    *len = (size_t)(end - s);
    return s;
}

int opf_arg_enum(const char *op, const char *arg, StableIValue v, const char *values) {
    StringHandle s = (StringHandle)(uintptr_t)v;
    const char *data = NULL, *p = values, *name;
    size_t len = 0, n;
    if (torch_string_c_str(s, &data) != OPF_AOTI_SUCCESS || torch_string_length(s, &len) != OPF_AOTI_SUCCESS) {
        torch_delete_string(s);
        opf_fail(op, "internal error: could not read the string of argument '%s'", arg);
    }
    for (int i = 0; (name = enum_next(&p, &n)); i++) {
        if (n == len && memcmp(name, data, len) == 0) {
            torch_delete_string(s);
            return i;
        }
    }
    char given[256], expected[512] = "";
    snprintf(given, sizeof given, "%.*s", (int)(len < sizeof given ? len : sizeof given - 1), data);
    torch_delete_string(s); /* before the exception: nothing else would free it */
    size_t used = 0;
    p = values;
    for (int i = 0; (name = enum_next(&p, &n)) && used < sizeof expected; i++)
        used += (size_t)snprintf(expected + used, sizeof expected - used, "%s'%.*s'", i ? ", " : "", (int)n, name);
    opf_fail(op, "argument '%s' must be one of %s, got '%s'", arg, expected, given);
}

int opf_arg_optional_enum(const char *op, const char *arg, StableIValue v, const char *values) {
    StableIValue value;
    return unbox_optional(v, &value) ? opf_arg_enum(op, arg, value, values) : -1;
}

int64_t opf_arg_int_list(const char *op, const char *arg, StableIValue v, int64_t *out, int64_t max) {
    StableListHandle list = (StableListHandle)(uintptr_t)v;
    size_t n = 0;
    if (torch_list_size(list, &n) != OPF_AOTI_SUCCESS) {
        torch_delete_list(list);
        opf_fail(op, "internal error: could not read the list of argument '%s'", arg);
    }
    if ((int64_t)n > max) {
        torch_delete_list(list); /* before the exception: nothing else would free it */
        opf_fail(op, "argument '%s' takes at most %lld values, got %zu", arg, (long long)max, n);
    }
    for (size_t i = 0; i < n; i++) {
        StableIValue item = 0;
        if (torch_list_get_item(list, i, &item) != OPF_AOTI_SUCCESS) {
            torch_delete_list(list);
            opf_fail(op, "internal error: could not read item %zu of argument '%s'", i, arg);
        }
        out[i] = opf_arg_int(item);
    }
    torch_delete_list(list);
    return (int64_t)n;
}

int opf_arg_optional_int(StableIValue v, int64_t *out) {
    StableIValue value;
    if (!unbox_optional(v, &value)) return 0;
    *out = opf_arg_int(value);
    return 1;
}

opf_tensor opf_tensor_info(const char *op, const char *arg, AtenTensorHandle h) {
    opf_tensor t = {.h = h};
    int64_t *sizes = NULL, *strides = NULL;
    bool defined = h != NULL;
    /* None for a (non-optional) Tensor argument arrives as an undefined tensor, whose strides cannot be read */
    if (defined && aoti_torch_is_defined && aoti_torch_is_defined(h, &defined) != OPF_AOTI_SUCCESS) defined = false;
    if (!defined || aoti_torch_get_dim(h, &t.ndim) != OPF_AOTI_SUCCESS ||
        aoti_torch_get_numel(h, &t.numel) != OPF_AOTI_SUCCESS || aoti_torch_get_sizes(h, &sizes) != OPF_AOTI_SUCCESS ||
        aoti_torch_get_strides(h, &strides) != OPF_AOTI_SUCCESS)
        opf_fail(op, "argument '%s' must be a tensor, got None", arg);
    OPF_TRY(op, aoti_torch_get_dtype(h, &t.dtype));
    OPF_TRY(op, aoti_torch_get_device_type(h, &t.device_type));
    OPF_TRY(op, aoti_torch_get_data_ptr(h, &t.data));
    t.sizes = sizes;
    t.strides = strides;
    if (t.ndim > OPF_MAX_DIMS)
        opf_fail(op, "argument '%s' must have at most %d dims, got %lld", arg, OPF_MAX_DIMS, (long long)t.ndim);
    return t;
}

opf_dtype opf_check_float(const char *op, const char *arg, const opf_tensor *t) {
    for (int i = 0; i < OPF_DTYPE_COUNT; i++) /* dtypes[] starts in opf_dtype order */
        if (dtypes[i].code == t->dtype) return (opf_dtype)i;
    opf_fail(op, "argument '%s' must be a floating-point tensor (float32, float64, bfloat16 or float16), got %s", arg,
             opf_dtype_name(t->dtype));
}

/* Appends item i of count to the list in buf, as the errors list what they accept: "a", "a or b",
 * "a, b or c" (cut at len). */
static void list_item(char *buf, size_t len, int i, int count, const char *item) {
    size_t used = strlen(buf);
    if (used + 1 < len) snprintf(buf + used, len - used, "%s%s", i == 0 ? "" : i + 1 == count ? " or " : ", ", item);
}

opf_dtype opf_check_dtype(const char *op, const char *arg, const opf_tensor *t, unsigned accepted) {
    accepted &= OPF_DTYPES_FLOAT;
    for (int i = 0; i < OPF_DTYPE_COUNT; i++)
        if ((accepted & OPF_DTYPE_BIT(i)) && dtypes[i].code == t->dtype) return (opf_dtype)i;
    if (accepted == OPF_DTYPES_FLOAT) opf_check_float(op, arg, t); /* its message, word for word */
    /* "float32", "float32 or float16", "float32, bfloat16 or float16": the set, in opf_dtype order */
    char names[96] = "";
    int count = 0, total = __builtin_popcount(accepted);
    for (int i = 0; i < OPF_DTYPE_COUNT; i++)
        if (accepted & OPF_DTYPE_BIT(i)) list_item(names, sizeof names, count++, total, opf_dtype_name(dtypes[i].code));
    opf_fail(op, "argument '%s' must be %s, got %s", arg, count ? names : "(no dtype: the accepted set is empty)",
             opf_dtype_name(t->dtype));
}

const char *opf_device_name(int32_t type) {
    if (type == aoti_torch_device_type_cpu()) return "cpu";
    if (type == aoti_torch_device_type_cuda()) return "cuda";
    if (type == aoti_torch_device_type_meta()) return "meta";
    return "another device";
}

int64_t opf_check_enum(const char *op, const char *arg, const opf_enum_desc *e, int64_t value) {
    for (int i = 0; i < e->count; i++)
        if (e->values[i].code == value) return value;
    char list[512] = "";
    for (int i = 0; i < e->count; i++) {
        char item[96];
        snprintf(item, sizeof item, "%lld (%s)", (long long)e->values[i].code, e->values[i].name);
        list_item(list, sizeof list, i, e->count, item);
    }
    opf_fail(op, "argument '%s' must be %s, got %lld", arg, list, (long long)value);
}

void opf_check_cpu(const char *op, const char *arg, const opf_tensor *t) {
    if (t->device_type != aoti_torch_device_type_cpu())
        opf_fail(op, "argument '%s' must be on the cpu device (this kernel is the CPU one), got %s", arg,
                 opf_device_name(t->device_type));
}

void opf_check_device(const char *op, const char *arg, const opf_tensor *t, const char *ref_arg,
                      const opf_tensor *ref) {
    const int32_t cpu = aoti_torch_device_type_cpu(), meta = aoti_torch_device_type_meta();
    if (t->device_type != cpu && t->device_type != meta)
        opf_fail(op, "argument '%s' must be on the cpu device (this kernel is the CPU one), got %s", arg,
                 opf_device_name(t->device_type));
    if (t->device_type != ref->device_type)
        opf_fail(op, "argument '%s' must be on the device of '%s' (%s), got %s", arg, ref_arg,
                 opf_device_name(ref->device_type), opf_device_name(t->device_type));
}

int opf_is_meta(const opf_tensor *t) { return t->device_type == aoti_torch_device_type_meta(); }

void opf_shape_str(char *buf, size_t len, const opf_tensor *t) {
    size_t n = (size_t)snprintf(buf, len, "[");
    for (int64_t d = 0; d < t->ndim && n < len; d++)
        n += (size_t)snprintf(buf + n, len - n, d ? ", %lld" : "%lld", (long long)t->sizes[d]);
    if (n < len) snprintf(buf + n, len - n, "]");
}

void opf_check_same_shape(const char *op, const char *arg, const opf_tensor *t, const char *ref_arg,
                          const opf_tensor *ref) {
    int same = t->ndim == ref->ndim;
    for (int64_t d = 0; same && d < t->ndim; d++) same = t->sizes[d] == ref->sizes[d];
    if (!same) {
        char a[256], b[256];
        opf_shape_str(a, sizeof a, t);
        opf_shape_str(b, sizeof b, ref);
        opf_fail(op, "argument '%s' must have the shape of '%s' %s, got %s", arg, ref_arg, b, a);
    }
}

void opf_check_same_dtype(const char *op, const char *arg, const opf_tensor *t, const char *ref_arg,
                          const opf_tensor *ref) {
    if (t->dtype != ref->dtype)
        opf_fail(op, "argument '%s' must have the dtype of '%s' (%s), got %s", arg, ref_arg, opf_dtype_name(ref->dtype),
                 opf_dtype_name(t->dtype));
}

void opf_check_dims(const char *op, const char *arg, const opf_tensor *t, int64_t ndim, const char *names) {
    if (t->ndim == ndim) return;
    char got[256];
    opf_shape_str(got, sizeof got, t);
    opf_fail(op, "argument '%s' must have %lld dim%s%s%s, got %lld: %s", arg, (long long)ndim, ndim == 1 ? "" : "s",
             names ? " " : "", names ? names : "", (long long)t->ndim, got);
}

/* The index of size(dim) of t (a negative dim counts from the end), or a failure naming arg. */
static int64_t dim_index(const char *op, const char *arg, const opf_tensor *t, int64_t dim) {
    const int64_t d = dim < 0 ? dim + t->ndim : dim;
    if (d >= 0 && d < t->ndim) return d;
    /* the dims size(dim) needs; unsigned: no overflow at either end of int64 */
    const unsigned long long need = dim < 0 ? (unsigned long long)-(dim + 1) + 1 : (unsigned long long)dim + 1;
    char got[256];
    opf_shape_str(got, sizeof got, t);
    opf_fail(op, "argument '%s' must have at least %llu dim%s for size(%lld), got %lld: %s", arg, need,
             need == 1 ? "" : "s", (long long)dim, (long long)t->ndim, got);
}

void opf_check_size(const char *op, const char *arg, const opf_tensor *t, int64_t dim, const char *ref_arg,
                    const opf_tensor *ref, int64_t ref_dim) {
    const int64_t want = ref->sizes[dim_index(op, ref_arg, ref, ref_dim)], size = t->sizes[dim_index(op, arg, t, dim)];
    if (size == want) return;
    char a[256], b[256];
    opf_shape_str(a, sizeof a, t);
    opf_shape_str(b, sizeof b, ref);
    opf_fail(op, "argument '%s' must have size(%lld) == %s.size(%lld) = %lld, got %lld (%s: %s, %s: %s)", arg,
             (long long)dim, ref_arg, (long long)ref_dim, (long long)want, (long long)size, arg, a, ref_arg, b);
}

void opf_check_size_is(const char *op, const char *arg, const opf_tensor *t, int64_t dim, int64_t size) {
    const int64_t got = t->sizes[dim_index(op, arg, t, dim)];
    if (got == size) return;
    char shape[256];
    opf_shape_str(shape, sizeof shape, t);
    opf_fail(op, "argument '%s' must have size(%lld) == %lld, got %lld (%s)", arg, (long long)dim, (long long)size,
             (long long)got, shape);
}

/* page_in: an output the op writes whole (opf_page_in); a workspace is left to the kernel's writes,
 * which may use only part of it */
static AtenTensorHandle empty_strided(const char *op, int64_t ndim, const int64_t *sizes, const int64_t *strides,
                                      int32_t dtype, const opf_tensor *like, int page_in) {
    AtenTensorHandle out = NULL;
    int32_t index = 0;
    OPF_TRY(op, aoti_torch_get_device_index(like->h, &index));
    if (aoti_torch_empty_strided(ndim, sizes, strides, dtype, like->device_type, index, &out) != OPF_AOTI_SUCCESS) {
        opf_tensor t = {.ndim = ndim, .sizes = sizes};
        char shape[256];
        opf_shape_str(shape, sizeof shape, &t);
        opf_fail(op, "could not allocate the output (%s %s): out of memory?", opf_dtype_name(dtype), shape);
    }
    if (page_in && like->device_type == aoti_torch_device_type_cpu()) opf_page_in(out, ndim, sizes, strides, dtype);
    return out;
}

AtenTensorHandle opf_empty_strided(const char *op, int64_t ndim, const int64_t *sizes, const int64_t *strides,
                                   int32_t dtype, const opf_tensor *like) {
    return empty_strided(op, ndim, sizes, strides, dtype, like, 1);
}

AtenTensorHandle opf_empty_like(const char *op, const opf_tensor *like) {
    int64_t strides[OPF_MAX_DIMS];
    opf_output_strides((int)like->ndim, like->sizes, like->strides, strides);
    return opf_empty_strided(op, like->ndim, like->sizes, strides, like->dtype, like);
}

AtenTensorHandle opf_empty(const char *op, int64_t ndim, const int64_t *sizes, int32_t dtype, const opf_tensor *like) {
    int64_t strides[OPF_MAX_DIMS];
    opf_output_strides((int)ndim, sizes, NULL, strides);
    return opf_empty_strided(op, ndim, sizes, strides, dtype, like);
}

AtenTensorHandle opf_workspace(const char *op, int64_t floats, const opf_tensor *like, float **data) {
    const int64_t n = floats > 0 ? floats : 1, one = 1;
    AtenTensorHandle h = empty_strided(op, 1, &n, &one, aoti_torch_dtype_float32(), like, 0);
    opf_tensor t = opf_tensor_info(op, "workspace", h);
    *data = t.data;
    return h;
}

void opf_tensors_str(char *buf, size_t len, int n, const opf_tensor *tensors) {
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && used < len; i++) {
        char shape[256];
        opf_shape_str(shape, sizeof shape, &tensors[i]);
        used +=
            (size_t)snprintf(buf + used, len - used, "%s%s%s", i ? " " : "", opf_dtype_name(tensors[i].dtype), shape);
    }
}

void opf_log_call(const char *op, double t0_us, int n, const opf_tensor *tensors) {
    if (!opf_log_enabled(OPF_LOG_INFO)) return;
    double us = opf_now_us() - t0_us;
    char args[768];
    opf_tensors_str(args, sizeof args, n, tensors);
    /* the variants this call picked (opf_variant_pick), not the machine's best ISA: a library
     * with an AVX2 variant only runs AVX2 on an AVX-512 CPU */
    char kernels[256];
    int isa = opf_log_take_picks(t0_us, kernels, sizeof kernels);
    if (isa >= 0)
        opf_log(OPF_LOG_INFO, "%s %s isa=%s kernels=%s threads=%d %.1fus", op, args, opf_isa_name((opf_isa)isa),
                kernels, opf_num_threads(), us);
    else /* the op chose its kernels without a variant table: only the ISA it was allowed is known */
        opf_log(OPF_LOG_INFO, "%s %s isa<=%s (no variant table) threads=%d %.1fus", op, args,
                opf_isa_name(opf_isa_current()), opf_num_threads(), us);
}

/* ---- parallel backend over torch's pool ------------------------------------- */

static void torch_backend_for(int64_t begin, int64_t end, int64_t grain, opf_range_fn fn, void *ctx) {
    if (torch_parallel_for(begin, end, grain, fn, ctx) != OPF_AOTI_SUCCESS)
        fn(begin, end, ctx); /* the pool refused (shutting down?): do it here */
}

static int torch_backend_threads(void) {
    uint32_t n = 1;
    if (torch_get_num_threads(&n) != OPF_AOTI_SUCCESS || n < 1) n = 1;
    return (int)n;
}

static const opf_parallel_backend torch_backend = {torch_backend_for, torch_backend_threads};

/* ---- exported to the Python layer (ctypes) ----------------------------------- */

static int initialized; /* opforge_init succeeded (atomic access) */

OPF_EXPORT int opforge_init(char *err, size_t errlen) {
    uint64_t v = aoti_torch_abi_version();
    if (v < OPF_TORCH_MIN_VERSION) {
        snprintf(err, errlen, "opforge needs torch >= 2.10 (stable C ABI), this torch reports ABI %d.%d",
                 (int)(v >> 56), (int)((v >> 48) & 0xff));
        return -1;
    }
    if (ndtypes == 0) dtypes_init();
    opf_parallel_set_backend(&torch_backend);
    int rc = opf_runtime_init(err, errlen);
    if (rc == 0) rc = opf_pages_init(err, errlen);
    if (rc == 0) __atomic_store_n(&initialized, 1, __ATOMIC_RELEASE);
    return rc;
}

/* opforge_init for entry points reached without the Python layer, which
 * calls it at import (the AOTInductor shims, csrc/torch/aoti.c): once per
 * process, so that an ISA chosen with opforge.set_isa() stays chosen. */
int opf_init_once(char *err, size_t errlen) {
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    if (__atomic_load_n(&initialized, __ATOMIC_ACQUIRE)) return 0;
    pthread_mutex_lock(&lock);
    int rc = __atomic_load_n(&initialized, __ATOMIC_ACQUIRE) ? 0 : opforge_init(err, errlen);
    pthread_mutex_unlock(&lock);
    return rc;
}

/* Where opforge's own ops register: a build parameter, read by the Python layer at load. */
OPF_EXPORT const char *opforge_namespace(void) { return OPF_NAMESPACE; }

OPF_EXPORT int opforge_set_isa(const char *name, char *err, size_t errlen) { return opf_isa_set(name, err, errlen); }

OPF_EXPORT const char *opforge_isa(void) { return opf_isa_name(opf_isa_current()); }
OPF_EXPORT const char *opforge_isa_best(void) { return opf_isa_name(opf_isa_best()); }
/* The ISA names in order (a later one implies the earlier), NULL past the last. */
OPF_EXPORT const char *opforge_isa_name_at(int i) {
    return i >= 0 && i < OPF_ISA_COUNT ? opf_isa_name((opf_isa)i) : NULL;
}

/* The families every op shares; each op file registers its own. */
OPF_REGISTER_FAMILY(convert_variants);
OPF_REGISTER_FAMILY(probe_variants);

OPF_SECTION_BOUNDS(opf_families, const opf_variants *);

/* Variant i of the family vs: its name (NULL where this build lacks it), the
 * ISA it needs, and whether the current ISA runs it. Returns 1, or 0 past the
 * family's last variant. Also reads a user library's families
 * (OPF_KERNEL_FAMILIES). */
OPF_EXPORT int opforge_variant_at(const opf_variants *vs, int i, const char **name, const char **isa, int *current) {
    if (i < 0 || i >= vs->count) return 0;
    const opf_variant *v = vs->tables[i];
    *name = v ? v->name : NULL;
    *isa = v ? opf_isa_name(v->isa) : NULL;
    const opf_variant *best = opf_variant_best(vs, opf_isa_current()); /* listing: not logged as a pick */
    *current = v && best == v;
    return 1;
}

/* Variant i of kernel family f of opforge's own library, read from the tables
 * the kernels are chosen from: the family's name, then as opforge_variant_at.
 * Returns 1, 0 past the family's last variant, -1 past the last family. */
OPF_EXPORT int opforge_kernel_variant(int f, int i, const char **family, const char **name, const char **isa,
                                      int *current) {
    if (f < 0 || f >= (int)(__stop_opf_families - __start_opf_families)) return -1;
    *family = __start_opf_families[f]->family;
    return opforge_variant_at(__start_opf_families[f], i, name, isa, current);
}

OPF_EXPORT int opforge_set_log_level(const char *name, char *err, size_t errlen) {
    return opf_log_set_level(name, err, errlen);
}

OPF_EXPORT int opforge_set_log_file(const char *path, char *err, size_t errlen) {
    return opf_log_set_file(path, "set_log_file()", err, errlen);
}

OPF_EXPORT const opf_cpu_features *opforge_cpu_features(void) { return opf_cpu(); }

OPF_EXPORT uint64_t opforge_torch_abi_version(void) { return aoti_torch_abi_version(); }

OPF_EXPORT double opforge_probe_fma(int64_t iters) { return probe_fma(opf_isa_best(), iters); }
