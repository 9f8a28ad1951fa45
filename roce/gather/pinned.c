#include "pinned.h"
#include <stdlib.h>
#include <string.h>
#include "../../internal/cudadrv/cudadrv.h"

void* rg_pinned_alloc(size_t n, int* pinned) {
  const rg_cuda_api* cu = rg_cuda();
  void* p = NULL;
  *pinned = 0;
  if (cu != NULL && cu->cuMemHostAlloc(&p, n, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP) == CUDA_SUCCESS) {
    *pinned = 1;
  } else if (posix_memalign(&p, 4096, n) != 0) {
    return NULL;
  }
  memset(p, 0, n);
  return p;
}

void rg_pinned_free(void* p, int pinned) {
  if (p == NULL) return;
  if (pinned)
    rg_cuda()->cuMemFreeHost(p);
  else
    free(p);
}
