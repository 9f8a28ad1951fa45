/* The interceptor's wrappers: this library's own ncclAllGather and ncclAllReduce and the
 * calls the engine must see (communicator creation, split, finalize, destroy, abort,
 * ncclCommGetAsyncError, groups). Each counts the call, lets the one-shot engine look
 * (oneshot_hooks.h) and otherwise forwards to NCCL's original code (bind.h) with its
 * arguments and result unchanged. Pure C; the ncclAllGather path takes no lock and
 * allocates nothing once NCCL is found. */
#define _GNU_SOURCE
#include "intercept.h"
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "../internal/nlog/nlog.h"
#include "../roce/gather/stats.h"
#include "bind.h"
#include "oneshot_hooks.h"

#define NAME(f) "nccl" #f,
const char* const rg_wrapped_names[RG_WRAP_N] = {RG_WRAPPED(NAME)};
_Static_assert(RG_STAT_CALL_ALL_REDUCE - RG_STAT_CALL_ALLGATHER + 1 == RG_WRAP_N, "one counter a wrapper");

/* The calling thread's group depth (NCCL keeps its own the same way, per thread). The
 * library's TLS is static already (Go's runtime uses initial-exec): no __tls_get_addr. */
static __thread int group_depth __attribute__((tls_model("initial-exec")));

int rg_intercept_group_depth(void) { return group_depth; }

static void counted(enum rg_wrapped w) { rg_stats_add((enum rg_stat)(RG_STAT_CALL_ALLGATHER + (int)w), 1); }

/* What a wrapper returns when it has nothing to forward to; said once a function. */
static ncclResult_t unavailable(enum rg_wrapped w, const rg_nccl_api* api) {
  static atomic_int warned[RG_WRAP_N];
  if (atomic_exchange(&warned[w], 1) == 0) {
    if (api == NULL)
      RG_WARN("%s: no NCCL in this process (no loaded object defines pncclAllGather); returning ncclInvalidUsage",
              rg_wrapped_names[w]);
    else
      RG_WARN("%s: the NCCL in use (%s) has no %s to forward it to; returning ncclInvalidUsage",
              rg_wrapped_names[w], api->path, rg_wrapped_names[w]);
  }
  return ncclInvalidUsage;
}

/* The blocking mode NCCL gives a communicator made with config: its blocking field where
 * the caller set it (configs from nccl.h 2.14 on), else NCCL's default, 1; NCCL_COMM_BLOCKING
 * (0 or 1) overrides both, as in NCCL. */
static int blocking_of(const ncclConfig_t* config) {
  int blocking = 1;
  if (config != NULL && config->magic == NCCL_API_MAGIC && config->version >= NCCL_VERSION_2_14 &&
      config->blocking != NCCL_CONFIG_UNDEF_INT)
    blocking = config->blocking;
  const char* env = getenv("NCCL_COMM_BLOCKING");
  if (env != NULL && (strcmp(env, "0") == 0 || strcmp(env, "1") == 0)) blocking = env[0] - '0';
  return blocking;
}

/* Every wrapper's start: count the call, and find NCCL's function f or return unavailable's
 * answer. Declares api. */
#define FORWARDING(f)                                   \
  counted(RG_WRAP_##f);                                 \
  const rg_nccl_api* api = rg_nccl();                   \
  if (api == NULL || api->f == NULL) return unavailable(RG_WRAP_##f, api)

static int made(ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; }

static ncclResult_t wrap_AllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                                   ncclComm_t comm, cudaStream_t stream) {
  FORWARDING(AllGather);
  ncclResult_t result;
  if (rg_oneshot_allgather(sendbuff, recvbuff, sendcount, datatype, comm, stream, &result)) return result;
  return api->AllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream);
}

static ncclResult_t wrap_AllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                   ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  FORWARDING(AllReduce);
  ncclResult_t result;
  if (rg_oneshot_allreduce(sendbuff, recvbuff, count, datatype, op, comm, stream, &result)) return result;
  return api->AllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream);
}

static ncclResult_t wrap_CommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  FORWARDING(CommInitRank);
  ncclResult_t r = api->CommInitRank(comm, nranks, commId, rank);
  if (made(r) && comm != NULL && *comm != NULL) rg_oneshot_comm_created(*comm, blocking_of(NULL), "ncclCommInitRank");
  return r;
}

static ncclResult_t wrap_CommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                            ncclConfig_t* config) {
  FORWARDING(CommInitRankConfig);
  ncclResult_t r = api->CommInitRankConfig(comm, nranks, commId, rank, config);
  if (made(r) && comm != NULL && *comm != NULL)
    rg_oneshot_comm_created(*comm, blocking_of(config), "ncclCommInitRankConfig");
  return r;
}

static ncclResult_t wrap_CommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  FORWARDING(CommInitAll);
  ncclResult_t r = api->CommInitAll(comms, ndev, devlist);
  if (made(r) && comms != NULL)
    for (int i = 0; i < ndev; i++)
      if (comms[i] != NULL) rg_oneshot_comm_created(comms[i], blocking_of(NULL), "ncclCommInitAll");
  return r;
}

static ncclResult_t wrap_CommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  FORWARDING(CommSplit);
  ncclResult_t r = api->CommSplit(comm, color, key, newcomm, config);
  if (made(r) && newcomm != NULL && *newcomm != NULL)
    rg_oneshot_comm_created(*newcomm, blocking_of(config), "ncclCommSplit");
  return r;
}

static ncclResult_t wrap_CommFinalize(ncclComm_t comm) {
  FORWARDING(CommFinalize);
  if (comm != NULL) rg_oneshot_comm_closing(comm, 0);
  return api->CommFinalize(comm);
}

static ncclResult_t wrap_CommDestroy(ncclComm_t comm) {
  FORWARDING(CommDestroy);
  if (comm != NULL) rg_oneshot_comm_closing(comm, 0);
  ncclResult_t r = api->CommDestroy(comm);
  if (comm != NULL) rg_oneshot_comm_gone(comm);
  return r;
}

static ncclResult_t wrap_CommAbort(ncclComm_t comm) {
  FORWARDING(CommAbort);
  if (comm != NULL) rg_oneshot_comm_closing(comm, 1);
  ncclResult_t r = api->CommAbort(comm);
  if (comm != NULL) rg_oneshot_comm_gone(comm);
  return r;
}

static ncclResult_t wrap_CommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  FORWARDING(CommGetAsyncError);
  ncclResult_t r = api->CommGetAsyncError(comm, asyncError);
  if (r == ncclSuccess && asyncError != NULL) *asyncError = rg_oneshot_async_error(comm, *asyncError);
  return r;
}

static ncclResult_t wrap_GroupStart(void) {
  FORWARDING(GroupStart);
  ncclResult_t r = api->GroupStart();
  if (r == ncclSuccess) group_depth++;
  return r;
}

static ncclResult_t wrap_GroupEnd(void) {
  FORWARDING(GroupEnd);
  ncclResult_t r = api->GroupEnd();
  /* NCCL leaves a group at any depth above 0, whatever the group's result. An end at depth 0
   * closes a group opened before the hook went in (or none: NCCL then refuses it). */
  if (group_depth > 0) group_depth--;
  if (group_depth == 0) rg_oneshot_group_ended(r == ncclSuccess);
  return r;
}

/* The exported names are aliases: inside this library the wrappers are reached by their
 * own (local) names, so a NCCL earlier in the global scope can never stand in for them. */
#define EXPORT(f) extern __typeof(wrap_##f) nccl##f __attribute__((alias("wrap_" #f), visibility("default")));
RG_WRAPPED(EXPORT)

void* rg_wrapper(enum rg_wrapped w) {
#define WRAPPER(f) (void*)wrap_##f,
  static void* const wrappers[RG_WRAP_N] = {RG_WRAPPED(WRAPPER)};
  return (unsigned)w < RG_WRAP_N ? wrappers[w] : NULL;
}
