/* See nccl_min.h. */
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
