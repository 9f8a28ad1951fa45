/* See nccl_min.h. */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include "nccl_min.h"

void die_if(int bad, const char* what) {
  if (bad) {
    printf("FAIL %s\n", what);
    fflush(stdout);
    _exit(1);
  }
}

double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

const rg_cuda_api* cuda_on(int device) {
  const rg_cuda_api* cu = rg_cuda();
  die_if(cu == NULL, "no CUDA driver");
  CUdevice dev;
  CUcontext ctx;
  die_if(cu->cuDeviceGet(&dev, device) != CUDA_SUCCESS || cu->cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
             cu->cuCtxSetCurrent(ctx) != CUDA_SUCCESS,
         "cannot make the GPU's primary context current");
  return cu;
}

void file_put(const char* dir, const char* name, const void* data, size_t n) {
  char path[512], tmp[520];
  snprintf(path, sizeof(path), "%s/%s", dir, name);
  snprintf(tmp, sizeof(tmp), "%s.tmp", path);
  FILE* f = fopen(tmp, "wb");
  die_if(f == NULL, "cannot create a file in DIR");
  int ok = fwrite(data, 1, n, f) == n;
  ok &= fclose(f) == 0;
  die_if(!ok || rename(tmp, path) != 0, "cannot write a file in DIR");
}

int file_get(const char* dir, const char* name, void* data, size_t n) {
  char path[512];
  snprintf(path, sizeof(path), "%s/%s", dir, name);
  FILE* f = fopen(path, "rb");
  if (f == NULL) return 0;
  size_t got = fread(data, 1, n, f);
  fclose(f);
  return got == n;
}

/* The object that the address of ncclAllGather, read through this program's slot now, lies in:
 * NCCL's library, or the one that rebound or preempted the name. Not inlined, so that each
 * call reads the slot afresh. */
__attribute__((noinline)) static void print_slot(const char* when) {
  Dl_info info;
  const char* where = dladdr((void*)ncclAllGather, &info) && info.dli_fname ? info.dli_fname : "(unknown)";
  printf("SLOT ncclAllGather %s: %s\n", when, where[0] ? where : "(this program)");
}

void nccl_describe(void) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* the caller may kill this process; keep every line it printed */
  int version = 0;
  ncclResult_t rc = ncclGetVersion(&version);
  if (rc != ncclSuccess) printf("FAIL ncclGetVersion: %s\n", ncclGetErrorString(rc));
  die_if(rc != ncclSuccess, "ncclGetVersion");
  Dl_info info;
  printf("NCCL_LIB %s\n", dladdr((void*)ncclGetVersion, &info) && info.dli_fname ? info.dli_fname : "libnccl.so.2");
  printf("NCCL_VERSION %d.%d.%d\n", version / 10000, version / 100 % 100, version % 100);
  print_slot("before any communicator");
}

ncclResult_t nccl_pair_named(int rank, const char* dir, const char* name, ncclComm_t* comm) {
  static int first = 1;
  ncclUniqueId id;
  if (rank == 0) {
    die_if(ncclGetUniqueId(&id) != ncclSuccess, "ncclGetUniqueId");
    file_put(dir, name, &id, sizeof(id));
  } else {
    for (int i = 0; !file_get(dir, name, &id, sizeof(id)); i++) {
      die_if(i > 3000, "rank 0's unique id did not appear within 30 s");
      usleep(10000);
    }
  }
  ncclComm_t c = NULL;
  ncclResult_t rc = ncclCommInitRank(&c, 2, id, rank);
  if (first) print_slot("after the first ncclCommInitRank"); /* NCCL has loaded NCCL_NET_PLUGIN by now */
  first = 0;
  if (rc == ncclSuccess) *comm = c;
  return rc;
}

ncclComm_t nccl_pair(int rank, const char* dir) {
  ncclComm_t comm;
  ncclResult_t rc = nccl_pair_named(rank, dir, "id", &comm);
  if (rc != ncclSuccess) printf("FAIL ncclCommInitRank: %s\n", ncclGetErrorString(rc));
  die_if(rc != ncclSuccess, "ncclCommInitRank");
  return comm;
}
