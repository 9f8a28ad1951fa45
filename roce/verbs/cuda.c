/* CUDA memory as a dma-buf, for registrations NCCL did not hand a descriptor with. */
#include <stdio.h>
#include <unistd.h>
#include "../../internal/cudadrv/cudadrv.h"
#include "ibv.h"

int rg_cuda_export_dmabuf(uint64_t addr, uint64_t len, uint64_t* offset, char* err, int errlen) {
  const rg_cuda_api* cu = rg_cuda();
  if (cu == NULL) {
    snprintf(err, (size_t)errlen, "no CUDA driver: %s", rg_cuda_error());
    return -1;
  }
  if (cu->cuMemGetHandleForAddressRange == NULL) {
    snprintf(err, (size_t)errlen, "the CUDA driver has no cuMemGetHandleForAddressRange (needs CUDA 11.7 or newer)");
    return -1;
  }
  /* The driver exports whole host pages. */
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  uint64_t base = addr & ~(page - 1), end = (addr + len + page - 1) & ~(page - 1);
  /* Export under the context that owns the memory, restoring the caller's afterwards. */
  CUcontext owner = NULL, prev = NULL;
  int switched = 0;
  if (cu->cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_CONTEXT, (CUdeviceptr)addr) == CUDA_SUCCESS &&
      owner != NULL && cu->cuCtxGetCurrent(&prev) == CUDA_SUCCESS && prev != owner &&
      cu->cuCtxSetCurrent(owner) == CUDA_SUCCESS)
    switched = 1;
  int fd = -1;
  CUresult r = cu->cuMemGetHandleForAddressRange(&fd, (CUdeviceptr)base, (size_t)(end - base),
                                                 CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (switched) cu->cuCtxSetCurrent(prev);
  if (r != CUDA_SUCCESS) {
    snprintf(err, (size_t)errlen, "cuMemGetHandleForAddressRange(0x%llx, %llu bytes) failed: %s",
             (unsigned long long)base, (unsigned long long)(end - base), rg_cuda_strerror(r));
    return -1;
  }
  *offset = addr - base;
  return fd;
}
