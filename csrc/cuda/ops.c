/*
 * libopforge_cuda.so: the CUDA kernels of opforge's ops, registered on torch's
 * CUDA dispatch key when the library is loaded (after libopforge.so, which it
 * links and which defines the ops). Schemas, fake kernels, autograd and
 * autocast stay the CPU library's: an op is one op on every device.
 */
#include <stdio.h>
#include <string.h>

#include "../torch/namespace.h"
#include "../torch/registry.h"
#include "opforge/cuda.h"

OPF_SECTION_BOUNDS(opf_cuda_kernels, const opf_cuda_kernel *);

static struct {
    int rc;
    char err[512];
    TorchLibraryHandle impl; /* kept for the process: deleting it undoes the registrations */
} status;

__attribute__((constructor)) static void register_cuda_at_load(void) {
    /* the runtime linked in needs a driver of its major release or newer (minor-version compatibility);
     * with an older one every launch would fail, so nothing is registered and the reason is kept. No
     * driver at all (a machine without a GPU) registers: nothing dispatches to the CUDA key there. */
    int driver = 0;
    if (cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0 && driver / 1000 < CUDART_VERSION / 1000) {
        snprintf(status.err, sizeof status.err,
                 "the CUDA library was built with CUDA %d.%d, whose runtime needs a driver for CUDA %d.x or newer; "
                 "this driver supports CUDA %d.%d: rebuild it with an older CUDA toolkit or update the driver",
                 CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10, CUDART_VERSION / 1000, driver / 1000,
                 driver % 1000 / 10);
        status.rc = -2;
        return;
    }
    for (const opf_cuda_kernel *const *k = __start_opf_cuda_kernels; k < __stop_opf_cuda_kernels; k++)
        if (opf_find_op((*k)->name) == NULL) {
            snprintf(status.err, sizeof status.err, "the CUDA kernel of '%s' has no op of that name in opforge's table",
                     (*k)->name);
            status.rc = -1;
            return;
        }
    if (aoti_torch_library_init_impl(OPF_NAMESPACE, "CUDA", __FILE__, __LINE__, &status.impl) != OPF_AOTI_SUCCESS) {
        snprintf(status.err, sizeof status.err, "could not open a CUDA implementation library for namespace '%s'",
                 OPF_NAMESPACE);
        status.rc = -1;
        return;
    }
    for (const opf_cuda_kernel *const *k = __start_opf_cuda_kernels; k < __stop_opf_cuda_kernels; k++)
        if (torch_library_impl(status.impl, (*k)->name, (*k)->fn, OPF_TORCH_BUILD_VERSION) != OPF_AOTI_SUCCESS) {
            snprintf(status.err, sizeof status.err, "could not register the CUDA kernel of %s::%s", OPF_NAMESPACE,
                     (*k)->name);
            status.rc = -1;
            return;
        }
}

/* 0 when the CUDA kernels registered as the library was loaded, else -1 (an error) or -2 (a driver too old for
 * the runtime linked in: nothing registered) and why. */
OPF_EXPORT int opforge_cuda_registered(char *err, size_t errlen) {
    if (status.rc) snprintf(err, errlen, "%s", status.err);
    return status.rc;
}

/* The name of the op of CUDA kernel i, NULL past the last. */
OPF_EXPORT const char *opforge_cuda_kernel_at(int i) {
    return i >= 0 && i < (int)(__stop_opf_cuda_kernels - __start_opf_cuda_kernels) ? __start_opf_cuda_kernels[i]->name
                                                                                   : NULL;
}

/* The CUDA runtime this library was built with (major * 1000 + minor * 10), and the one the driver
 * supports, for `opforge info`. */
OPF_EXPORT int opforge_cuda_runtime_version(void) { return CUDART_VERSION; }
OPF_EXPORT int opforge_cuda_driver_version(void) {
    int v = 0;
    return cudaDriverGetVersion(&v) == cudaSuccess ? v : 0;
}
