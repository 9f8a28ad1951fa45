/* What the interceptor's wrappers ask of the one-shot engine (roce/gather). */
#ifndef RG_ONESHOT_HOOKS_H
#define RG_ONESHOT_HOOKS_H
#include "../include/nccl/api.h"
/* 1: the one-shot path took the call and *result is what ncclAllGather returns; 0: forward it to NCCL. */
int rg_oneshot_allgather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm,
                         cudaStream_t stream, ncclResult_t* result);
/* 1: the one-shot path took the all-reduce and *result is what ncclAllReduce returns; 0: forward it to NCCL. */
int rg_oneshot_allreduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                         ncclComm_t comm, cudaStream_t stream, ncclResult_t* result);
/* A communicator made through a wrapper; blocking is its config's blocking field (1 without a config). */
void rg_oneshot_comm_created(ncclComm_t comm, int blocking, const char* how);
/* Before NCCL's finalize, destroy or abort of comm; abort is 1 for ncclCommAbort (stop waits at once). */
void rg_oneshot_comm_closing(ncclComm_t comm, int abort);
/* After NCCL's ncclGroupEnd returned leaving this thread's wrappers at depth 0: the end of
 * the outermost group they saw, or of a group opened before the entry hook went in (or of
 * none: NCCL refused it); ok: it succeeded. */
void rg_oneshot_group_ended(int ok);
/* After NCCL's destroy or abort of comm returned. */
void rg_oneshot_comm_gone(ncclComm_t comm);
/* ncclCommGetAsyncError's answer: NCCL's own result, merged with the engine's error for comm. */
ncclResult_t rg_oneshot_async_error(ncclComm_t comm, ncclResult_t nccl_result);
#endif
