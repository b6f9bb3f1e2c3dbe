/*
 * The exact subset of PyTorch's stable C ABI that opforge calls, declared in C.
 *
 * PyTorch ships these declarations only in C++ headers (aoti_torch/c/shim.h,
 * stable/c/shim.h), which a C compiler cannot read. Every function is listed
 * once in OPF_SHIM_FUNCTIONS; tests/abi/abi_drift.cpp includes torch's real
 * headers and static_asserts that each entry has the identical signature, so
 * a torch release that changes one fails `make test` instead of crashing.
 *
 * Minimum torch: 2.10 (torch_library_impl, torch_parallel_for, torch_get_num_threads, the string and list handles).
 * torch_library_def_with_tags and two dtypes (2.12) are looked up as weak symbols.
 */
#ifndef OPFORGE_SHIM_H
#define OPFORGE_SHIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct AtenTensorOpaque *AtenTensorHandle;
typedef struct TorchLibraryOpaque *TorchLibraryHandle;
typedef struct DeviceGuardOpaque *DeviceGuardHandle;
typedef struct StringOpaque *StringHandle;         /* a `str` argument's StableIValue: owned by the kernel */
typedef struct StableListOpaque *StableListHandle; /* a `Tensor[]` argument's StableIValue: owned by the kernel */
typedef int32_t AOTITorchError;
typedef uint64_t StableIValue;
typedef void (*ParallelFunc)(int64_t begin, int64_t end, void *ctx);
typedef void (*OpfBoxedKernel)(StableIValue *stack, uint64_t num_args, uint64_t num_outputs);

#define OPF_AOTI_SUCCESS 0

/* Version encoding of TORCH_ABI_VERSION: major << 56 | minor << 48. */
#define OPF_TORCH_VERSION(major, minor) (((uint64_t)(major) << 56) | ((uint64_t)(minor) << 48))
/* Oldest torch whose stable ABI has everything in OPF_SHIM_FUNCTIONS. */
#define OPF_TORCH_MIN_VERSION OPF_TORCH_VERSION(2, 10)
/* The torch release these declarations were checked against (passed as the
 * extension build version of torch_library_impl). */
#define OPF_TORCH_BUILD_VERSION OPF_TORCH_VERSION(2, 13)

/* X(return type, name, parameter list) */
#define OPF_SHIM_FUNCTIONS(X)                                                                                      \
    X(int32_t, aoti_torch_device_type_cpu, (void))                                                                 \
    X(int32_t, aoti_torch_device_type_cuda, (void))                                                                \
    X(int32_t, aoti_torch_device_type_meta, (void))                                                                \
    X(int32_t, aoti_torch_dtype_bfloat16, (void))                                                                  \
    X(int32_t, aoti_torch_dtype_float16, (void))                                                                   \
    X(int32_t, aoti_torch_dtype_float32, (void))                                                                   \
    X(int32_t, aoti_torch_dtype_float64, (void))                                                                   \
    X(int32_t, aoti_torch_dtype_uint8, (void))                                                                     \
    X(int32_t, aoti_torch_dtype_int8, (void))                                                                      \
    X(int32_t, aoti_torch_dtype_int16, (void))                                                                     \
    X(int32_t, aoti_torch_dtype_int32, (void))                                                                     \
    X(int32_t, aoti_torch_dtype_int64, (void))                                                                     \
    X(int32_t, aoti_torch_dtype_bool, (void))                                                                      \
    X(int32_t, aoti_torch_dtype_complex64, (void))                                                                 \
    X(int32_t, aoti_torch_dtype_complex128, (void))                                                                \
    X(int32_t, aoti_torch_dtype_complex32, (void))                                                                 \
    X(int32_t, aoti_torch_dtype_uint16, (void))                                                                    \
    X(int32_t, aoti_torch_dtype_uint32, (void))                                                                    \
    X(int32_t, aoti_torch_dtype_uint64, (void))                                                                    \
    X(int32_t, aoti_torch_dtype_float8_e5m2, (void))                                                               \
    X(int32_t, aoti_torch_dtype_float8_e4m3fn, (void))                                                             \
    X(int32_t, aoti_torch_dtype_float8_e5m2fnuz, (void))                                                           \
    X(int32_t, aoti_torch_dtype_float8_e4m3fnuz, (void))                                                           \
    X(size_t, aoti_torch_dtype_element_size, (int32_t dtype))                                                      \
    X(uint64_t, aoti_torch_abi_version, (void))                                                                    \
    X(AOTITorchError, aoti_torch_delete_tensor_object, (AtenTensorHandle tensor))                                  \
    X(AOTITorchError, aoti_torch_new_tensor_handle, (AtenTensorHandle orig_handle, AtenTensorHandle * new_handle)) \
    X(AOTITorchError, aoti_torch_get_data_ptr, (AtenTensorHandle tensor, void **ret_data_ptr))                     \
    X(AOTITorchError, aoti_torch_get_dim, (AtenTensorHandle tensor, int64_t * ret_dim))                            \
    X(AOTITorchError, aoti_torch_get_numel, (AtenTensorHandle tensor, int64_t * ret_numel))                        \
    X(AOTITorchError, aoti_torch_get_sizes, (AtenTensorHandle tensor, int64_t * *ret_sizes))                       \
    X(AOTITorchError, aoti_torch_get_strides, (AtenTensorHandle tensor, int64_t * *ret_strides))                   \
    X(AOTITorchError, aoti_torch_get_dtype, (AtenTensorHandle tensor, int32_t * ret_dtype))                        \
    X(AOTITorchError, aoti_torch_get_device_type, (AtenTensorHandle tensor, int32_t * ret_device_type))            \
    X(AOTITorchError, aoti_torch_get_device_index, (AtenTensorHandle tensor, int32_t * ret_device_index))          \
    X(AOTITorchError, aoti_torch_empty_strided,                                                                    \
      (int64_t ndim, const int64_t *sizes_ptr, const int64_t *strides_ptr, int32_t dtype, int32_t device_type,     \
       int32_t device_index, AtenTensorHandle *ret_new_tensor))                                                    \
    X(AOTITorchError, aoti_torch_library_init_def,                                                                 \
      (const char *ns, const char *file, uint32_t line, TorchLibraryHandle *ret_new_torch_lib))                    \
    X(AOTITorchError, aoti_torch_library_init_impl,                                                                \
      (const char *ns, const char *k, const char *file, uint32_t line, TorchLibraryHandle *ret_new_torch_lib))     \
    X(AOTITorchError, aoti_torch_library_def, (TorchLibraryHandle self, const char *schema))                       \
    X(AOTITorchError, torch_library_impl,                                                                          \
      (TorchLibraryHandle self, const char *name, OpfBoxedKernel fn, uint64_t extension_build_version))            \
    X(AOTITorchError, torch_parallel_for,                                                                          \
      (int64_t begin, int64_t end, int64_t grain_size, ParallelFunc func, void *ctx))                              \
    X(AOTITorchError, torch_get_num_threads, (uint32_t * out_num_threads))                                         \
    X(AOTITorchError, torch_new_string_handle, (const char *data, size_t length, StringHandle *handle))            \
    X(AOTITorchError, torch_delete_string, (StringHandle handle))                                                  \
    X(AOTITorchError, torch_string_length, (StringHandle handle, size_t * length))                                 \
    X(AOTITorchError, torch_string_c_str, (StringHandle handle, const char **data))                                \
    X(AOTITorchError, aoti_torch_library_init_fragment,                                                            \
      (const char *ns, const char *file, uint32_t line, TorchLibraryHandle *ret_new_torch_lib))                    \
    X(AOTITorchError, torch_list_size, (StableListHandle list_handle, size_t * size))                              \
    X(AOTITorchError, torch_list_get_item, (StableListHandle list_handle, size_t index, StableIValue * element))   \
    X(AOTITorchError, torch_delete_list, (StableListHandle list_handle))                                           \
    X(void, aoti_torch_check, (bool cond, const char *func, const char *file, uint32_t line, const char *msg))

/* torch's own CPU GEMM and fused attention, for the providers (csrc/torch/gemm_torch.c, attention.c):
 * the AOTInductor C shims of aten::mm.out, aten::addmm.out and the CPU flash attention and its backward (torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h, 2.10), which
 * call ATen's CPU kernels directly (no dispatcher) and return an error code instead of throwing, over
 * tensors that wrap opforge's buffers. */
#define OPF_SHIM_CPU_GEMM_FUNCTIONS(X)                                                                             \
    X(AOTITorchError, aoti_torch_create_tensor_from_blob,                                                          \
      (void *data, int64_t ndim, const int64_t *sizes_ptr, const int64_t *strides_ptr, int64_t storage_offset,     \
       int32_t dtype, int32_t device_type, int32_t device_index, AtenTensorHandle *ret))                           \
    X(AOTITorchError, aoti_torch_cpu_mm_out, (AtenTensorHandle out, AtenTensorHandle self, AtenTensorHandle mat2)) \
    X(AOTITorchError, aoti_torch_cpu_addmm_out,                                                                    \
      (AtenTensorHandle out, AtenTensorHandle self, AtenTensorHandle mat1, AtenTensorHandle mat2, double beta,     \
       double alpha))                                                                                              \
    X(AOTITorchError, aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu,                                  \
      (AtenTensorHandle query, AtenTensorHandle key, AtenTensorHandle value, double dropout_p, int32_t is_causal,  \
       AtenTensorHandle *attn_mask, double *scale, AtenTensorHandle *ret0, AtenTensorHandle *ret1))                \
    X(AOTITorchError, aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu_backward,                         \
      (AtenTensorHandle grad_out, AtenTensorHandle query, AtenTensorHandle key, AtenTensorHandle value,            \
       AtenTensorHandle out, AtenTensorHandle logsumexp, double dropout_p, int32_t is_causal,                      \
       AtenTensorHandle *attn_mask, double *scale, AtenTensorHandle *ret0, AtenTensorHandle *ret1,                 \
       AtenTensorHandle *ret2))

/* The CUDA glue's (opforge/cuda.h), from libtorch_cpu (2.10). */
#define OPF_SHIM_CUDA_FUNCTIONS(X)                                                                           \
    X(AOTITorchError, aoti_torch_create_device_guard, (int32_t device_index, DeviceGuardHandle * ret_guard)) \
    X(AOTITorchError, aoti_torch_delete_device_guard, (DeviceGuardHandle guard))

/* From libtorch_cuda, which only a CUDA build of torch has: looked up by name at run time (dlsym), so
 * that nothing links it; declared in torch's headers under USE_CUDA, where the drift check compares it. */
#define OPF_SHIM_CUDA_LOOKUP(X) \
    X(AOTITorchError, aoti_torch_get_current_cuda_stream, (int32_t device_index, void **ret_stream))

/* Present from torch 2.12 / 2.13 only, or not promised by the minimum release: declared weak so that older
 * releases still load (aoti_torch_is_defined: where it is missing, an undefined tensor is told by its
 * getters failing). */
#define OPF_SHIM_WEAK_FUNCTIONS(X)                                                            \
    X(AOTITorchError, aoti_torch_is_defined, (AtenTensorHandle tensor, bool *ret_is_defined)) \
    X(int32_t, aoti_torch_dtype_float8_e8m0fnu, (void))                                       \
    X(int32_t, aoti_torch_dtype_float4_e2m1fn_x2, (void))                                     \
    X(int32_t, torch_tag_pt2_compliant_tag, (void))                                           \
    X(AOTITorchError, torch_new_stable_ivalue, (StableIValue * *ret_value))                   \
    X(AOTITorchError, torch_delete_stable_ivalue, (StableIValue * value))                     \
    X(AOTITorchError, torch_library_set_python_module,                                        \
      (TorchLibraryHandle self, const char *pymodule, const char *context))                   \
    X(AOTITorchError, torch_library_def_with_tags,                                            \
      (TorchLibraryHandle self, const char *schema, const int32_t *tags, int32_t num_tags))

#define OPF_SHIM_DECLARE(ret, name, params) ret name params;
OPF_SHIM_FUNCTIONS(OPF_SHIM_DECLARE)
OPF_SHIM_CUDA_FUNCTIONS(OPF_SHIM_DECLARE)
OPF_SHIM_CPU_GEMM_FUNCTIONS(OPF_SHIM_DECLARE)
#ifndef __cplusplus
#define OPF_SHIM_DECLARE_WEAK(ret, name, params) __attribute__((weak)) ret name params;
OPF_SHIM_WEAK_FUNCTIONS(OPF_SHIM_DECLARE_WEAK)
#undef OPF_SHIM_DECLARE_WEAK
#endif
#undef OPF_SHIM_DECLARE
#define OPF_SHIM_TYPEDEF(ret, name, params) typedef ret(*name##_fn) params;
OPF_SHIM_CUDA_LOOKUP(OPF_SHIM_TYPEDEF)
#undef OPF_SHIM_TYPEDEF

#ifdef __cplusplus
}
#endif

#endif
