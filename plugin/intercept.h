/* The interceptor's wrappers (plugin/intercept.c): the NCCL API functions this library
 * defines itself, each forwarding to NCCL's own code unless the one-shot engine takes it. */
#ifndef RG_INTERCEPT_H
#define RG_INTERCEPT_H

/* The wrapped functions, in one order everywhere (names, wrappers, stats counters). */
enum rg_wrapped {
  RG_WRAP_AllGather,
  RG_WRAP_CommInitRank,
  RG_WRAP_CommInitRankConfig,
  RG_WRAP_CommInitAll,
  RG_WRAP_CommSplit,
  RG_WRAP_CommFinalize,
  RG_WRAP_CommDestroy,
  RG_WRAP_CommAbort,
  RG_WRAP_CommGetAsyncError,
  RG_WRAP_GroupStart,
  RG_WRAP_GroupEnd,
  RG_WRAP_AllReduce,
  RG_WRAP_N
};

/* "ncclAllGather", ... in enum order. */
extern const char* const rg_wrapped_names[RG_WRAP_N];

/* This library's own wrapper for function w (never an interposed address). */
void* rg_wrapper(enum rg_wrapped w);

/* The calling thread's ncclGroupStart depth as the wrappers counted it: starts that succeeded
 * less the ends made at a depth above 0. A group opened before the entry hook went in is not
 * in it (oneshot.c probes for one). */
int rg_intercept_group_depth(void);

#endif
