/* The group probe (plugin/oneshot.c's settle): whether the calling thread is inside a NCCL
 * group that the wrappers' depth does not count, one opened before the entry hook went in.
 * A self send and receive of a few bytes, in a group of their own, on a private stream:
 * outside any group they run at that group's end; inside another, NCCL defers them to the
 * end of the outermost group, so once the stream is idle the bytes have not arrived. The
 * peer takes no part, so the probe cannot pair with anything the peer issues. */
#ifndef RG_PROBE_H
#define RG_PROBE_H

#include <stdint.h>
#include "../include/nccl/api.h"
#include "../internal/cudadrv/cudadrv.h"
#include "bind.h"

enum rg_probe_result {
  RG_PROBE_CLEAR,    /* the bytes arrived: no group is open on this thread */
  RG_PROBE_IN_GROUP, /* they did not: a group the wrappers did not see is open */
  RG_PROBE_SKIPPED,  /* this NCCL has no ncclSend/ncclRecv (before 2.7): nothing probed */
  RG_PROBE_FAILED,   /* NCCL or CUDA refused a step; why says which */
};

/* Buffers (and the stream) of a probe NCCL has deferred: its send and receive still run at
 * that group's end, so they live until the communicator is destroyed. */
typedef struct rg_probe_kept rg_probe_kept;

/* Probes on comm (rank is this rank) in device memory on device, or host memory when
 * standin (no CUDA: NCCL's stand-in). A deferred or unfinished probe's buffers go onto
 * *kept. */
int rg_group_probe(const rg_nccl_api* nccl, ncclComm_t comm, int rank, int device, int standin, rg_probe_kept** kept,
                   char* why, int whylen);

/* The device's primary context, where NCCL's communicators live (and PyTorch and JAX work),
 * made current on a thread that has no current context; rg_ctx_leave undoes it. */
typedef struct rg_ctx_entered {
  int device, retained, pushed;
} rg_ctx_entered;
void rg_ctx_enter(const rg_cuda_api* cu, int device, rg_ctx_entered* e);
void rg_ctx_leave(const rg_cuda_api* cu, const rg_ctx_entered* e);

/* Frees every probe on the list: after NCCL's destroy or abort of their communicator. */
void rg_probe_release(rg_probe_kept* kept);

#endif
