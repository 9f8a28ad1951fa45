#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include "cudadrv.h"

static rg_cuda_api api;
static const rg_cuda_api* loaded;
static char load_error[256];
static pthread_once_t once = PTHREAD_ONCE_INIT;

#define RESOLVE(field, sym)                                                              \
  do {                                                                                   \
    *(void**)&api.field = dlsym(lib, sym);                                               \
    if (api.field == NULL) {                                                             \
      snprintf(load_error, sizeof(load_error), "libcuda.so.1 has no symbol %s", sym);    \
      return;                                                                            \
    }                                                                                    \
  } while (0)

static void load(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    snprintf(load_error, sizeof(load_error), "cannot load libcuda.so.1: %s", dlerror());
    return;
  }
  RESOLVE(cuInit, "cuInit");
  RESOLVE(cuGetErrorString, "cuGetErrorString");
  RESOLVE(cuDeviceGetCount, "cuDeviceGetCount");
  RESOLVE(cuDeviceGet, "cuDeviceGet");
  RESOLVE(cuDeviceGetAttribute, "cuDeviceGetAttribute");
  RESOLVE(cuDeviceGetName, "cuDeviceGetName");
  RESOLVE(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  RESOLVE(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
  RESOLVE(cuCtxGetCurrent, "cuCtxGetCurrent");
  RESOLVE(cuCtxSetCurrent, "cuCtxSetCurrent");
  RESOLVE(cuMemAlloc, "cuMemAlloc_v2");
  RESOLVE(cuMemFree, "cuMemFree_v2");
  RESOLVE(cuMemFreeHost, "cuMemFreeHost");
  RESOLVE(cuMemHostAlloc, "cuMemHostAlloc");
  RESOLVE(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2");
  RESOLVE(cuMemcpyHtoD, "cuMemcpyHtoD_v2");
  RESOLVE(cuMemcpyDtoH, "cuMemcpyDtoH_v2");
  RESOLVE(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
  RESOLVE(cuMemsetD8, "cuMemsetD8_v2");
  RESOLVE(cuStreamCreate, "cuStreamCreate");
  RESOLVE(cuStreamDestroy, "cuStreamDestroy_v2");
  RESOLVE(cuStreamSynchronize, "cuStreamSynchronize");
  RESOLVE(cuStreamQuery, "cuStreamQuery");
  RESOLVE(cuEventCreate, "cuEventCreate");
  RESOLVE(cuEventRecord, "cuEventRecord");
  RESOLVE(cuEventQuery, "cuEventQuery");
  RESOLVE(cuEventDestroy, "cuEventDestroy_v2");
  RESOLVE(cuModuleLoadData, "cuModuleLoadData");
  RESOLVE(cuModuleUnload, "cuModuleUnload");
  RESOLVE(cuModuleGetFunction, "cuModuleGetFunction");
  RESOLVE(cuLaunchKernel, "cuLaunchKernel");
  RESOLVE(cuStreamWaitEvent, "cuStreamWaitEvent");
  RESOLVE(cuStreamIsCapturing, "cuStreamIsCapturing");
  RESOLVE(cuCtxPushCurrent, "cuCtxPushCurrent_v2");
  RESOLVE(cuCtxPopCurrent, "cuCtxPopCurrent_v2");
  CUresult r = api.cuInit(0);
  if (r != CUDA_SUCCESS) {
    snprintf(load_error, sizeof(load_error), "cuInit failed: %s", rg_cuda_strerror(r));
    return;
  }
  loaded = &api;
}

const rg_cuda_api* rg_cuda(void) {
  pthread_once(&once, load);
  return loaded;
}

const char* rg_cuda_error(void) {
  pthread_once(&once, load);
  return loaded ? "" : load_error;
}

const char* rg_cuda_strerror(CUresult r) {
  const char* s = NULL;
  if (api.cuGetErrorString != NULL && api.cuGetErrorString(r, &s) == CUDA_SUCCESS && s != NULL) return s;
  static __thread char buf[32];
  snprintf(buf, sizeof(buf), "CUDA error %d", r);
  return buf;
}

CUresult rg_cuda_device_count(int* count) {
  if (rg_cuda() == NULL) return -1;
  return api.cuDeviceGetCount(count);
}

CUresult rg_cuda_device_query(int ordinal, rg_cuda_device_info* out) {
  if (rg_cuda() == NULL) return -1;
  CUdevice dev;
  CUresult r = api.cuDeviceGet(&dev, ordinal);
  if (r != CUDA_SUCCESS) return r;
  memset(out, 0, sizeof(*out));
  if ((r = api.cuDeviceGetName(out->name, (int)sizeof(out->name) - 1, dev)) != CUDA_SUCCESS) return r;
  api.cuDeviceGetAttribute(&out->cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  api.cuDeviceGetAttribute(&out->cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
  api.cuDeviceGetAttribute(&out->integrated, CU_DEVICE_ATTRIBUTE_INTEGRATED, dev);
  /* Older drivers lack the newer attributes; they then read as unsupported. */
  if (api.cuDeviceGetAttribute(&out->gpudirect_rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, dev) != CUDA_SUCCESS)
    out->gpudirect_rdma = 0;
  if (api.cuDeviceGetAttribute(&out->dmabuf, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev) != CUDA_SUCCESS)
    out->dmabuf = 0;
  return CUDA_SUCCESS;
}
