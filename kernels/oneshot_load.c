#include "oneshot_load.h"
#include <stdio.h>
#include "../internal/cudadrv/cudadrv.h"

static const char* embedded;

void rg_os_set_ptx(const char* ptx) { embedded = ptx; }

int rg_os_kernel_load(CUmodule* module, CUfunction* fn, char* err, int errlen) {
  *module = NULL;
  *fn = NULL;
  const rg_cuda_api* cu = rg_cuda();
  if (cu == NULL) {
    snprintf(err, errlen, "no CUDA driver: %s", rg_cuda_error());
    return -1;
  }
  if (embedded == NULL) {
    snprintf(err, errlen, "no one-shot kernel is embedded in this library");
    return -1;
  }
  CUresult r = cu->cuModuleLoadData(module, embedded);
  if (r != CUDA_SUCCESS) {
    snprintf(err, errlen, "the driver cannot load the one-shot kernel's PTX (cuModuleLoadData: %s)", rg_cuda_strerror(r));
    *module = NULL;
    return -1;
  }
  r = cu->cuModuleGetFunction(fn, *module, RG_OS_KERNEL_NAME);
  if (r != CUDA_SUCCESS) {
    snprintf(err, errlen, "the one-shot kernel's module has no %s (cuModuleGetFunction: %s)", RG_OS_KERNEL_NAME,
             rg_cuda_strerror(r));
    cu->cuModuleUnload(*module);
    *module = NULL;
    return -1;
  }
  return 0;
}

void rg_os_kernel_unload(CUmodule module) {
  if (module != NULL) rg_cuda()->cuModuleUnload(module);
}
