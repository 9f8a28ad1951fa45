/* The part of NCCL's C API that tests/gpu's C programs (gather-nccl, abort-nccl) call by name,
 * declared from NCCL's nccl.h with the types of include/nccl/api.h, so that they build without
 * NCCL's headers. They link with -lnccl like a user's program: against the stand-in
 * tests/gpu/nccl_stub.c at build time, against NCCL's libnccl.so.2 from the library path at run
 * time, so that every call goes through the program's own relocation slot for its name: the
 * slot the library rebinds when NCCL loads it (NCCL_NET_PLUGIN), or the name its own
 * definition preempts (LD_PRELOAD). */
#ifndef RG_TESTS_NCCL_API_H
#define RG_TESTS_NCCL_API_H

#include "nccl/api.h"

ncclResult_t ncclGetVersion(int* version);
const char* ncclGetErrorString(ncclResult_t result);
ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream);
ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);

#endif
