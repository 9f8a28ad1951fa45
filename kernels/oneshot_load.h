/* The loader of the intercepted gather's kernel (oneshot.cu): its PTX, embedded in the
 * library, loaded through the CUDA driver API into the calling thread's current context. */
#ifndef RG_KERNELS_ONESHOT_LOAD_H
#define RG_KERNELS_ONESHOT_LOAD_H

#include "../include/cuda_subset.h"

#define RG_OS_KERNEL_NAME "roce_gather_oneshot"

/* 0 on success, else err says why. */
int rg_os_kernel_load(CUmodule* module, CUfunction* fn, char* err, int errlen);
void rg_os_kernel_unload(CUmodule module);

/* Set once by the Go package's init. */
void rg_os_set_ptx(const char* ptx);

#endif
