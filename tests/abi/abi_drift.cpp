// ABI drift check (test-only C++): opforge's C declarations of the stable ABI
// (csrc/include/opforge/shim.h) must match torch's own headers exactly.
// Including both in one translation unit already rejects a conflicting
// extern "C" redeclaration; the static_asserts name each symbol that drifted.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>

#include <type_traits>

#include "opforge/shim.h"

#define OPF_SAME_SIGNATURE(ret, name, params)                                                     \
    static_assert(std::is_same<decltype(&::name), ret(*) params>::value,                           \
                  "stable ABI drift: " #name " no longer matches csrc/include/opforge/shim.h");
OPF_SHIM_FUNCTIONS(OPF_SAME_SIGNATURE)
OPF_SHIM_WEAK_FUNCTIONS(OPF_SAME_SIGNATURE)
OPF_SHIM_CUDA_FUNCTIONS(OPF_SAME_SIGNATURE)
OPF_SHIM_CPU_GEMM_FUNCTIONS(OPF_SAME_SIGNATURE)
#ifdef USE_CUDA  // the declarations torch's headers give a CUDA build (make abi-check compiles this file both ways)
#define OPF_SAME_LOOKUP(ret, name, params)                                                                     \
    static_assert(std::is_same<decltype(&::name), name##_fn>::value,                                         \
                  "stable ABI drift: " #name " no longer matches csrc/include/opforge/shim.h");
OPF_SHIM_CUDA_LOOKUP(OPF_SAME_LOOKUP)
static_assert(std::is_same<DeviceGuardHandle, ::DeviceGuardOpaque*>::value, "DeviceGuardHandle changed");
#endif

static_assert(std::is_same<StableIValue, uint64_t>::value, "StableIValue is no longer uint64_t");
static_assert(std::is_same<AOTITorchError, int32_t>::value, "AOTITorchError changed");
static_assert(std::is_same<OpfBoxedKernel, void (*)(StableIValue*, uint64_t, uint64_t)>::value,
              "the boxed kernel signature changed");
static_assert(AOTI_TORCH_SUCCESS == OPF_AOTI_SUCCESS, "AOTI_TORCH_SUCCESS changed");
static_assert(OPF_TORCH_VERSION(2, 10) == TORCH_VERSION_2_10_0, "version encoding changed");
static_assert(TORCH_ABI_VERSION >= OPF_TORCH_MIN_VERSION, "torch older than opforge's minimum");

int main() { return 0; }
