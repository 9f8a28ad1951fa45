/* The interceptor's side of the intercepted gather (oneshot.c, oneshot.go): what the
 * agreement hands back to the hot path, and the exchange it makes through NCCL. */
#ifndef RG_PLUGIN_ONESHOT_H
#define RG_PLUGIN_ONESHOT_H

#include <stddef.h>
#include <stdint.h>
#include "../include/nccl/api.h"

enum rg_ic_state {
  RG_IC_PENDING = 0, /* not agreed yet: gathers go to NCCL until a call may agree */
  RG_IC_ON = 1,      /* both ranks agreed the path: gathers in the window take it */
  RG_IC_OFF = 2,     /* NCCL's path on both ranks for every gather */
  RG_IC_FAILED = 3,  /* the agreement itself failed: every gather returns the error */
};

/* The agreement's answer (rgGoOneShotAgree). */
typedef struct rg_oneshot_agreed {
  int state;      /* enum rg_ic_state */
  void* engine;   /* rg_os_engine*, when RG_IC_ON */
  uint64_t floor; /* the agreed window, bytes a rank */
  uint64_t cap;
  int result;     /* the ncclResult_t every gather returns, when RG_IC_FAILED */
  int ar_on;      /* RG_IC_ON and the all-reduce agreed too */
  uint64_t ar_floor; /* its window, bytes of the buffer */
  uint64_t ar_cap;
} rg_oneshot_agreed;

/* One all-gather of n bytes a rank through NCCL's own pncclAllGather on comm, on a private
 * stream in device memory (host memory when standin), waited for up to timeout_ns. Returns
 * an ncclResult_t; err says why when it is not ncclSuccess. */
int rg_oneshot_exchange(ncclComm_t comm, int device, const void* mine, void* all, size_t n, int standin, uint64_t timeout_ns,
                        char* err, int errlen);

#endif
