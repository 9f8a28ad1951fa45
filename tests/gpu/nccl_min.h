/* The NCCL API subset tests/gpu's C programs use, opened with dlopen (libnccl.so.2 on the
 * library path) so they build without nccl.h, and the file rendezvous of their two ranks. */
#ifndef RG_TESTS_NCCL_MIN_H
#define RG_TESTS_NCCL_MIN_H

#include <stddef.h>
#include "../../internal/cudadrv/cudadrv.h"

typedef struct {
  char internal[128];
} nccl_unique_id;
typedef struct nccl_comm* nccl_comm_t;
enum { NCCL_SUCCESS = 0, NCCL_IN_PROGRESS = 7, NCCL_UINT8 = 1 };

typedef struct nccl_api {
  int (*get_unique_id)(nccl_unique_id*);
  int (*comm_init_rank)(nccl_comm_t*, int, nccl_unique_id, int);
  int (*all_gather)(const void*, void*, size_t, int, nccl_comm_t, CUstream);
  int (*comm_get_async_error)(nccl_comm_t, int*);
  int (*comm_abort)(nccl_comm_t);
  int (*comm_finalize)(nccl_comm_t);
  int (*comm_destroy)(nccl_comm_t);
  int (*comm_register)(nccl_comm_t, void*, size_t, void**);
  int (*comm_deregister)(nccl_comm_t, void*);
  const char* (*get_error_string)(int);
  int (*send)(const void*, size_t, int, int, nccl_comm_t, CUstream);
  int (*recv)(void*, size_t, int, int, nccl_comm_t, CUstream);
  int (*group_start)(void);
  int (*group_end)(void);
  int version;      /* ncclGetVersion: major*10000 + minor*100 + patch */
  const char* path; /* the library dlopen found */
} nccl_api;

extern nccl_api nccl;

/* Prints "FAIL what" and ends the process with status 1 when bad. */
void die_if(int bad, const char* what);
double now_s(void);
/* Opens libnccl.so.2 into `nccl` and prints "NCCL_LIB path" and "NCCL_VERSION x.y.z". */
void nccl_load(void);
/* Makes device's primary context current; returns the driver API. */
const rg_cuda_api* cuda_on(int device);
/* Two ranks meet through files in dir: rank 0 writes the unique id, rank 1 waits for it. */
nccl_comm_t nccl_pair(int rank, const char* dir);
/* The same through the file dir/name, so that one pair of processes can make several
 * communicators; returns ncclCommInitRank's result and sets *comm only on success. */
int nccl_pair_named(int rank, const char* dir, const char* name, nccl_comm_t* comm);
void file_put(const char* dir, const char* name, const void* data, size_t n);
int file_get(const char* dir, const char* name, void* data, size_t n);

#endif
