/* See nccl_min.h. */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include "nccl_min.h"

nccl_api nccl;

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

#define SYM(field, name) *(void**)&nccl.field = dlsym(lib, name)

void nccl_load(void) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* the caller may kill this process; keep every line it printed */
  void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
  if (lib == NULL) {
    printf("FAIL cannot load libnccl.so.2: %s\n", dlerror());
    _exit(1);
  }
  SYM(get_unique_id, "ncclGetUniqueId");
  SYM(comm_init_rank, "ncclCommInitRank");
  SYM(all_gather, "ncclAllGather");
  SYM(comm_get_async_error, "ncclCommGetAsyncError");
  SYM(comm_abort, "ncclCommAbort");
  SYM(comm_finalize, "ncclCommFinalize");
  SYM(comm_destroy, "ncclCommDestroy");
  SYM(comm_register, "ncclCommRegister");
  SYM(comm_deregister, "ncclCommDeregister");
  SYM(get_error_string, "ncclGetErrorString");
  SYM(send, "ncclSend");
  SYM(recv, "ncclRecv");
  SYM(group_start, "ncclGroupStart");
  SYM(group_end, "ncclGroupEnd");
  int (*get_version)(int*);
  *(void**)&get_version = dlsym(lib, "ncclGetVersion");
  die_if(!nccl.get_unique_id || !nccl.comm_init_rank || !nccl.all_gather || !nccl.comm_get_async_error ||
             !nccl.comm_abort || !nccl.comm_finalize || !nccl.comm_destroy || !nccl.comm_register ||
             !nccl.comm_deregister || !nccl.get_error_string || !nccl.send || !nccl.recv || !nccl.group_start ||
             !nccl.group_end || !get_version,
         "libnccl.so.2 lacks a symbol these checks need");
  die_if(get_version(&nccl.version) != NCCL_SUCCESS, "ncclGetVersion");
  Dl_info info;
  nccl.path = dladdr((void*)nccl.comm_abort, &info) && info.dli_fname ? info.dli_fname : "libnccl.so.2";
  printf("NCCL_LIB %s\n", nccl.path);
  printf("NCCL_VERSION %d.%d.%d\n", nccl.version / 10000, nccl.version / 100 % 100, nccl.version % 100);
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

int nccl_pair_named(int rank, const char* dir, const char* name, nccl_comm_t* comm) {
  nccl_unique_id id;
  if (rank == 0) {
    die_if(nccl.get_unique_id(&id) != NCCL_SUCCESS, "ncclGetUniqueId");
    file_put(dir, name, &id, sizeof(id));
  } else {
    for (int i = 0; !file_get(dir, name, &id, sizeof(id)); i++) {
      die_if(i > 3000, "rank 0's unique id did not appear within 30 s");
      usleep(10000);
    }
  }
  nccl_comm_t c;
  int rc = nccl.comm_init_rank(&c, 2, id, rank);
  if (rc == NCCL_SUCCESS) *comm = c;
  return rc;
}

nccl_comm_t nccl_pair(int rank, const char* dir) {
  nccl_comm_t comm;
  int rc = nccl_pair_named(rank, dir, "id", &comm);
  if (rc != NCCL_SUCCESS) printf("FAIL ncclCommInitRank: %s\n", nccl.get_error_string(rc));
  die_if(rc != NCCL_SUCCESS, "ncclCommInitRank");
  return comm;
}
