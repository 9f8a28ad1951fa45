/* The interceptor's binding: which NCCL it forwards to, and how callers' calls reach its
 * wrappers (plugin/intercept.c). Pure C, callable from any thread at any time. */
#ifndef RG_BIND_H
#define RG_BIND_H

#include "../include/nccl/api.h"

/* NCCL's own functions, each resolved from the NCCL object's own handle by its strong
 * pncclX name; NULL where that NCCL lacks it. */
typedef struct rg_nccl_api {
  ncclAllGather_fn AllGather;
  ncclCommInitRank_fn CommInitRank;
  ncclCommInitRankConfig_fn CommInitRankConfig;
  ncclCommInitAll_fn CommInitAll;
  ncclCommSplit_fn CommSplit;
  ncclCommFinalize_fn CommFinalize;
  ncclCommDestroy_fn CommDestroy;
  ncclCommAbort_fn CommAbort;
  ncclCommGetAsyncError_fn CommGetAsyncError;
  ncclCommCount_fn CommCount;
  ncclCommUserRank_fn CommUserRank;
  ncclCommCuDevice_fn CommCuDevice;
  ncclGroupStart_fn GroupStart;
  ncclGroupEnd_fn GroupEnd;
  ncclGetVersion_fn GetVersion;
  ncclGetErrorString_fn GetErrorString;
  const char* path; /* the NCCL object, as the loader names it */
  int version;      /* its pncclGetVersion, 0 where it has none */
} rg_nccl_api;

/* The NCCL this library forwards to, found once and then fixed for the process; NULL
 * while no loaded object defines pncclAllGather. After the first success it is one
 * atomic load. Finding it also takes the way in (below) when no NCCL init did. */
const rg_nccl_api* rg_nccl(void);

/* Every NCCL init entry (net, collNet, tuner) calls this with its return address: the NCCL
 * that called is the one preferred, and every loaded object is scanned again. logger,
 * when not NULL, is installed first so that the binding's lines go through NCCL's log. */
void rg_bind_from_nccl(const void* caller, ncclDebugLogger_t logger);

/* How the calls reach the wrappers: "pending" (nothing tried yet), "no_nccl" (no loaded
 * object defines pncclAllGather), "preempting" (the process's global scope resolves
 * ncclAllGather to this library: LD_PRELOAD), "rebound" (relocation slots of at least one
 * object's ncclAllGather were rebound), "none" (NCCL is there but no loaded object calls
 * ncclAllGather through a relocation that reaches it), "unsupported" (relocation
 * rebinding is x86-64 only). A static string. */
const char* rg_bind_way_in(void);

#endif
