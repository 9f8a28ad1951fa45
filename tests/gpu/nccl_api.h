/* The NCCL API subset tests/gpu's C programs call, as a table of entry points, so that one
 * program's cases run against NCCL opened with dlopen (nccl_dlopen.c: gather-nccl,
 * abort-nccl, built by make all) or against the NCCL it is linked with (gather_linked.c:
 * gather-linked, abort-linked, built on the GPU machine). Needs no CUDA or NCCL header. */
#ifndef RG_TESTS_NCCL_API_H
#define RG_TESTS_NCCL_API_H

#include <stddef.h>

typedef struct {
  char internal[128];
} nccl_unique_id;
typedef struct nccl_comm* nccl_comm_t;
struct CUstream_st; /* CUstream and cudaStream_t point to it */
enum { NCCL_SUCCESS = 0, NCCL_IN_PROGRESS = 7, NCCL_UINT8 = 1 };

typedef struct nccl_api {
  int (*get_unique_id)(nccl_unique_id*);
  int (*comm_init_rank)(nccl_comm_t*, int, nccl_unique_id, int);
  int (*all_gather)(const void*, void*, size_t, int, nccl_comm_t, struct CUstream_st*);
  int (*comm_get_async_error)(nccl_comm_t, int*);
  int (*comm_abort)(nccl_comm_t);
  int (*comm_finalize)(nccl_comm_t);
  int (*comm_destroy)(nccl_comm_t);
  int (*comm_register)(nccl_comm_t, void*, size_t, void**);
  int (*comm_deregister)(nccl_comm_t, void*);
  const char* (*get_error_string)(int);
  int (*send)(const void*, size_t, int, int, nccl_comm_t, struct CUstream_st*);
  int (*recv)(void*, size_t, int, int, nccl_comm_t, struct CUstream_st*);
  int (*group_start)(void);
  int (*group_end)(void);
  int version;      /* ncclGetVersion: major*10000 + minor*100 + patch */
  const char* path; /* the library that defines NCCL's functions */
} nccl_api;

extern nccl_api nccl;

/* Fills `nccl` and prints "NCCL_LIB path" and "NCCL_VERSION x.y.z"; ends the process with
 * "FAIL what" and status 1 when NCCL cannot be had. */
void nccl_load(void);

#endif
