/* The interceptor's binding: which NCCL it forwards to, and how callers' calls reach its
 * wrappers (plugin/intercept.c): the entry hook on that NCCL's own functions (plugin/hook.c).
 * Pure C, callable from any thread at any time. */
#ifndef RG_BIND_H
#define RG_BIND_H

#include "../include/nccl/api.h"
#include "intercept.h"

/* NCCL's functions as the wrappers and the engine call them. The wrapped ones come first,
 * in enum rg_wrapped's order: NCCL's original code (the trampoline where the entry is
 * hooked, else NCCL's own definition, pncclX or ncclX); the others are NCCL's own pncclX.
 * NULL where that NCCL has no such function. */
#define RG_API_OTHERS(X) X(CommCount) X(CommUserRank) X(CommCuDevice) X(GetVersion) X(Send) X(Recv)
#define RG_API_FIELD(f) nccl##f##_fn f;
typedef struct rg_nccl_api {
  RG_WRAPPED(RG_API_FIELD)
  RG_API_OTHERS(RG_API_FIELD)
  const char* path; /* the NCCL object, as the loader names it */
  int version;      /* its pncclGetVersion, 0 where it has none */
  int hooked;       /* its entries jump to the wrappers */
} rg_nccl_api;

/* The NCCL this library forwards to, found (and hooked) once and then fixed for the
 * process; NULL while no loaded object defines pncclAllGather. After the first success it
 * is one atomic load. */
const rg_nccl_api* rg_nccl(void);

/* Every net init entry calls this with its return address: the NCCL that called is the one
 * preferred, and the loaded objects are looked at again for callers that are not reached.
 * logger, when not NULL, is installed first so that the binding's lines go through NCCL's
 * log. */
void rg_bind_from_nccl(const void* caller, ncclDebugLogger_t logger);

/* How the calls reach the wrappers: "pending" (nothing tried yet), "no_nccl" (no loaded
 * object defines pncclAllGather), "hooked" (the NCCL's entries jump to the wrappers: every
 * caller of it reaches them), "preempting" (not hooked, but LD_PRELOAD puts the library's
 * functions first: callers through relocations reach them), "refused" (not hooked, and
 * nothing else takes the calls). A static string. */
const char* rg_bind_way_in(void);

#endif
