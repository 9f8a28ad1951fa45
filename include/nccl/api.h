/* The part of NCCL's public API that the interceptor defines and forwards (plugin/intercept.c).
 * Declared by this project from the layouts of NCCL's nccl.h (2.19 to 2.30); nothing here
 * needs NCCL at build or link time. */
#ifndef RG_NCCL_API_H
#define RG_NCCL_API_H

#include <limits.h>
#include <stddef.h>
#include "common.h"

/* A communicator, opaque to every caller. */
typedef struct ncclComm* ncclComm_t;

/* CUDA's stream handle, opaque here: the interceptor only passes it on. */
typedef struct CUstream_st* cudaStream_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

/* ncclConfig_t as far as blocking: the whole struct of 2.14, which introduced it. Later
 * releases append fields after blocking (2.17: cgaClusterSize, minCTAs, maxCTAs, netName;
 * 2.18: splitShare; 2.26: trafficClass; 2.27: commName, collnetEnable, CTAPolicy,
 * shrinkShare, nvlsCTAs; 2.28: nChannelsPerNetPeer, nvlinkCentricSched; 2.29: graphUsageMode, numRmaCtx;
 * 2.30: maxP2pPeers, graphStreamOrdering), and the caller's `size` says how many it has. Only
 * these four are read here, and a config is always passed on as the caller's own pointer. */
typedef struct {
  size_t size;          /* sizeof the caller's ncclConfig_t */
  unsigned int magic;   /* NCCL_API_MAGIC once initialised (NCCL_CONFIG_INITIALIZER) */
  unsigned int version; /* NCCL_VERSION_CODE of the nccl.h the caller was built with */
  int blocking;         /* 0: nonblocking; 1: blocking; NCCL_CONFIG_UNDEF_INT: NCCL's default (1) */
} ncclConfig_t;

#define NCCL_API_MAGIC 0xcafebeefu
#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_SPLIT_NOCOLOR -1
/* NCCL_VERSION(2, 14, 0): configs from older headers have no usable blocking field. */
#define NCCL_VERSION_2_14 21400

/* The functions, as NCCL exports each under ncclX (weak) and pncclX (strong, same address). */
typedef ncclResult_t (*ncclAllGather_fn)(const void* sendbuff, void* recvbuff, size_t sendcount,
                                         ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
typedef ncclResult_t (*ncclCommInitRank_fn)(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
typedef ncclResult_t (*ncclCommInitRankConfig_fn)(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                                  ncclConfig_t* config);
typedef ncclResult_t (*ncclCommInitAll_fn)(ncclComm_t* comms, int ndev, const int* devlist);
typedef ncclResult_t (*ncclCommSplit_fn)(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                         ncclConfig_t* config);
typedef ncclResult_t (*ncclCommFinalize_fn)(ncclComm_t comm);
typedef ncclResult_t (*ncclCommDestroy_fn)(ncclComm_t comm);
typedef ncclResult_t (*ncclCommAbort_fn)(ncclComm_t comm);
typedef ncclResult_t (*ncclCommGetAsyncError_fn)(ncclComm_t comm, ncclResult_t* asyncError);
typedef ncclResult_t (*ncclCommCount_fn)(const ncclComm_t comm, int* count);
typedef ncclResult_t (*ncclCommUserRank_fn)(const ncclComm_t comm, int* rank);
typedef ncclResult_t (*ncclCommCuDevice_fn)(const ncclComm_t comm, int* device);
typedef ncclResult_t (*ncclGroupStart_fn)(void);
typedef ncclResult_t (*ncclGroupEnd_fn)(void);
typedef ncclResult_t (*ncclAllReduce_fn)(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                         ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
typedef ncclResult_t (*ncclSend_fn)(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                                    ncclComm_t comm, cudaStream_t stream);
typedef ncclResult_t (*ncclRecv_fn)(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                                    cudaStream_t stream);
typedef ncclResult_t (*ncclGetVersion_fn)(int* version);

#endif
