/* What tests/gpu's C programs share: NCCL's C API called by name (nccl_api.h), CUDA through the
 * library's driver loader, and the file rendezvous of their two ranks. */
#ifndef RG_TESTS_NCCL_MIN_H
#define RG_TESTS_NCCL_MIN_H

#include <stddef.h>
#include "../../internal/cudadrv/cudadrv.h"
#include "nccl_api.h"

/* Prints "FAIL what" and ends the process with status 1 when bad. */
void die_if(int bad, const char* what);
double now_s(void);
/* Makes device's primary context current; returns the driver API. */
const rg_cuda_api* cuda_on(int device);
/* Prints "NCCL_LIB path" and "NCCL_VERSION x.y.z" of the NCCL this program runs on, and where its
 * ncclAllGather slot leads ("SLOT ncclAllGather ..."); ends the process with "FAIL what" and
 * status 1 when ncclGetVersion fails. */
void nccl_describe(void);
/* Two ranks meet through files in dir: rank 0 writes the unique id, rank 1 waits for it. */
ncclComm_t nccl_pair(int rank, const char* dir);
/* The same through the file dir/name, so that one pair of processes can make several
 * communicators; returns ncclCommInitRank's result and sets *comm only on success. */
ncclResult_t nccl_pair_named(int rank, const char* dir, const char* name, ncclComm_t* comm);
void file_put(const char* dir, const char* name, const void* data, size_t n);
int file_get(const char* dir, const char* name, void* data, size_t n);

#endif
