/* The gather kernel's loader and launcher (place.h). */
#include <stdio.h>
#include <string.h>
#include "../internal/cudadrv/cudadrv.h"
#include "place.h"

#define KERNEL_NAME "roce_gather_place"

static const char* embedded_ptx;

void rg_place_set_ptx(const char* ptx) { embedded_ptx = ptx; }

int rg_place_load_image(rg_place_kernel* k, const void* image, char* err, int errlen) {
  memset(k, 0, sizeof(*k));
  const rg_cuda_api* cu = rg_cuda();
  if (cu == NULL) {
    snprintf(err, errlen, "no CUDA driver: %s", rg_cuda_error());
    return -1;
  }
  if (image == NULL) {
    snprintf(err, errlen, "no kernel image is embedded in this library");
    return -1;
  }
  CUresult r = cu->cuModuleLoadData(&k->module, image);
  if (r != CUDA_SUCCESS) {
    snprintf(err, errlen, "the driver cannot load the gather kernel's PTX (cuModuleLoadData: %s)", rg_cuda_strerror(r));
    k->module = NULL;
    return -1;
  }
  r = cu->cuModuleGetFunction(&k->fn, k->module, KERNEL_NAME);
  if (r != CUDA_SUCCESS) {
    snprintf(err, errlen, "the gather kernel's module has no %s (cuModuleGetFunction: %s)", KERNEL_NAME,
             rg_cuda_strerror(r));
    rg_place_unload(k);
    return -1;
  }
  return 0;
}

int rg_place_load(rg_place_kernel* k, char* err, int errlen) { return rg_place_load_image(k, embedded_ptx, err, errlen); }

void rg_place_unload(rg_place_kernel* k) {
  if (k->module != NULL) rg_cuda()->cuModuleUnload(k->module);
  k->module = NULL;
  k->fn = NULL;
}

CUresult rg_place_launch(const rg_place_kernel* k, CUstream stream, const rg_place_args* a) {
  /* Parameter order and types follow roce_gather_place's signature exactly. */
  void* params[] = {(void*)&a->arrival, (void*)&a->lanes,   (void*)&a->seq,     (void*)&a->landing,
                    (void*)&a->peer_row, (void*)&a->peer_len, (void*)&a->own_src, (void*)&a->own_row,
                    (void*)&a->own_len,  (void*)&a->status,   (void*)&a->timeout_ns};
  return rg_cuda()->cuLaunchKernel(k->fn, 1, 1, 1, RG_PLACE_THREADS, 1, 1, 0, stream, params, NULL);
}
