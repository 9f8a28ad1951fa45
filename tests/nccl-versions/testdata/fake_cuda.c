/* A stand-in libcuda.so.1 for testing the version matrix's scripts on a machine without a
 * GPU: "device" memory is host memory, streams and events are always complete. Only what
 * internal/cudadrv resolves is here. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef uintptr_t CUdeviceptr;
#define OK 0

CUresult cuInit(unsigned f) { (void)f; return OK; }
CUresult cuGetErrorString(CUresult r, const char** s) { (void)r; *s = "fake CUDA error"; return OK; }
CUresult cuDeviceGetCount(int* n) { *n = 1; return OK; }
CUresult cuDeviceGet(int* d, int o) { *d = o; return o == 0 ? OK : 101; }
CUresult cuDeviceGetAttribute(int* v, int a, int d) { (void)a; (void)d; *v = 0; return OK; }
CUresult cuDeviceGetName(char* n, int len, int d) { (void)d; strncpy(n, "fake GPU", (size_t)len); return OK; }
static int ctx_token;
CUresult cuDevicePrimaryCtxRetain(void** c, int d) { (void)d; *c = &ctx_token; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return OK; }
CUresult cuCtxGetCurrent(void** c) { *c = &ctx_token; return OK; }
CUresult cuCtxSetCurrent(void* c) { (void)c; return OK; }
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) { *p = (CUdeviceptr)malloc(n ? n : 1); return *p ? OK : 2; }
CUresult cuMemFree_v2(CUdeviceptr p) { free((void*)p); return OK; }
CUresult cuMemFreeHost(void* p) { free(p); return OK; }
CUresult cuMemHostAlloc(void** p, size_t n, unsigned f) { (void)f; *p = malloc(n ? n : 1); return *p ? OK : 2; }
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned f) { (void)f; *d = (CUdeviceptr)p; return OK; }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) { memmove((void*)d, s, n); return OK; }
CUresult cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) { memmove(d, (void*)s, n); return OK; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, void* st) { (void)st; return cuMemcpyHtoD_v2(d, s, n); }
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char c, size_t n) { memset((void*)d, c, n); return OK; }
static int stream_token;
CUresult cuStreamCreate(void** s, unsigned f) { (void)f; *s = &stream_token; return OK; }
CUresult cuStreamDestroy_v2(void* s) { (void)s; return OK; }
CUresult cuStreamSynchronize(void* s) { (void)s; return OK; }
CUresult cuStreamQuery(void* s) { (void)s; return OK; }
CUresult cuEventCreate(void** e, unsigned f) { (void)f; *e = &stream_token; return OK; }
CUresult cuEventRecord(void* e, void* s) { (void)e; (void)s; return OK; }
CUresult cuEventQuery(void* e) { (void)e; return OK; }
CUresult cuEventDestroy_v2(void* e) { (void)e; return OK; }
CUresult cuModuleLoadData(void** m, const void* img) { (void)m; (void)img; return 200; }
CUresult cuModuleUnload(void* m) { (void)m; return OK; }
CUresult cuModuleGetFunction(void** f, void* m, const char* n) { (void)f; (void)m; (void)n; return 500; }
CUresult cuLaunchKernel(void* f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned h, void* s,
                        void** p, void** x) {
  (void)f; (void)a; (void)b; (void)c; (void)d; (void)e; (void)g; (void)h; (void)s; (void)p; (void)x;
  return 500;
}
CUresult cuStreamWaitEvent(void* s, void* e, unsigned f) { (void)s; (void)e; (void)f; return OK; }
CUresult cuStreamIsCapturing(void* s, int* status) { (void)s; *status = 0; return OK; }
CUresult cuCtxPushCurrent_v2(void* c) { (void)c; return OK; }
CUresult cuCtxPopCurrent_v2(void** c) { *c = &ctx_token; return OK; }
