/* The interceptor's wrappers (plugin/intercept.c): the NCCL API functions this library
 * defines itself, each forwarding to NCCL's own code unless the one-shot engine takes it. */
#ifndef RG_INTERCEPT_H
#define RG_INTERCEPT_H

/* The wrapped functions, in one order everywhere (names, wrappers, stats counters, the
 * first fields of rg_nccl_api): X(f) for each function ncclf. */
#define RG_WRAPPED(X)                                                                                          \
  X(AllGather) X(CommInitRank) X(CommInitRankConfig) X(CommInitAll) X(CommSplit) X(CommFinalize) X(CommDestroy) \
  X(CommAbort) X(CommGetAsyncError) X(GroupStart) X(GroupEnd) X(AllReduce)

#define RG_WRAP_ENUM(f) RG_WRAP_##f,
enum rg_wrapped { RG_WRAPPED(RG_WRAP_ENUM) RG_WRAP_N };

/* "ncclAllGather", ... in enum order. */
extern const char* const rg_wrapped_names[RG_WRAP_N];

/* This library's own wrapper for function w (never an interposed address). */
void* rg_wrapper(enum rg_wrapped w);

/* The calling thread's ncclGroupStart depth as the wrappers counted it: starts that succeeded
 * less the ends made at a depth above 0. A group opened before the entry hook went in is not
 * in it (oneshot.c probes for one). */
int rg_intercept_group_depth(void);

#endif
