/* The tuner: steer a two-rank AllGather within the agreed window to CollNet Direct /
 * Simple on the agreed channels, and keep every other AllGather off CollNet. The decision reads
 * only inputs that are identical on both ranks (collective, total bytes, the group's
 * agreed outcome, which entries NCCL offers), so both ranks always take the same path. */
#include <stdlib.h>
#include "../internal/nlog/nlog.h"
#include "../roce/gather/stats.h"
#include "_cgo_export.h"
#include "abi.h"
#include "bind.h"
#include "tuner.h"

static float* cell(float** table, int numProto, int algo, int proto) {
  return (float*)table + (size_t)algo * (size_t)numProto + (size_t)proto;
}

/* NCCL marks what it does not offer with a negative cost (-1); it never offers a negative one. */
static int offered(float v) { return v >= 0.0f; }

/* Prices an entry NCCL offered out of the choice on every release; one it did not offer is
 * left as it is (a positive cost there would offer it to NCCL 2.30 and earlier). */
static void price_out(float* entry) {
  if (offered(*entry)) *entry = RG_TUNER_COST_NOT_THIS;
}

int rg_tuner_in_window(const rg_tuner* t, size_t nBytes) {
  /* nBytes is both ranks' bytes. An on group's window has floor <= cap <= this rank's own
   * cap <= 64 MiB, so doubling them cannot overflow. */
  return t->group_on && nBytes > 0 && nBytes >= 2 * t->agreed_floor && nBytes <= 2 * t->agreed_cap;
}

int rg_tuner_policy(const rg_tuner* t, int collType, size_t nBytes, float** table, int numAlgo, int numProto,
                    int* nChannels) {
  if (collType != ncclFuncAllGather || t->nranks != 2) return RG_TUNE_NOT_OURS;
  if (numAlgo <= NCCL_ALGO_COLLNET_CHAIN || numProto <= NCCL_PROTO_SIMPLE) return RG_TUNE_NOT_OURS;
  float* direct = cell(table, numProto, NCCL_ALGO_COLLNET_DIRECT, NCCL_PROTO_SIMPLE);
  if (rg_tuner_in_window(t, nBytes)) {
    /* NCCL ignores the entry without an NVSwitch (or without CollNet, which an on group
     * rules out); use it only where both ranks asked and nodes hold one rank each. */
    int unoffered = !offered(*direct);
    if (!unoffered || t->direct_without_nvswitch) {
      *direct = 0.0f; /* NCCL offers no cost of 0 or below: the cheapest on every release */
      *nChannels = t->oneshot_channels;
      return unoffered ? RG_TUNE_ONESHOT_UNOFFERED : RG_TUNE_ONESHOT;
    }
  }
  /* Outside the window (or with the group off, or Direct not offered) the gather belongs to
   * NCCL's own algorithms, unless pricing CollNet out would leave NCCL no choice at all. */
  int others = 0;
  for (int a = 0; a < numAlgo; a++)
    for (int p = 0; p < numProto; p++)
      if (a != NCCL_ALGO_COLLNET_DIRECT && a != NCCL_ALGO_COLLNET_CHAIN && offered(*cell(table, numProto, a, p)))
        others = 1;
  if (others)
    for (int p = 0; p < numProto; p++) {
      price_out(cell(table, numProto, NCCL_ALGO_COLLNET_DIRECT, p));
      price_out(cell(table, numProto, NCCL_ALGO_COLLNET_CHAIN, p));
    }
  return rg_tuner_in_window(t, nBytes) ? RG_TUNE_NCCL_NOT_OFFERED : RG_TUNE_NCCL;
}

ncclResult_t rg_tuner_get_coll_info(void* ctx, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                                    float** collCostTable, int numAlgo, int numProto, int regBuff, int* nChannels) {
  (void)numPipeOps, (void)regBuff; /* regBuff is rank-local: never decide on it */
  rg_tuner* t = ctx;
  int d = rg_tuner_policy(t, collType, nBytes, collCostTable, numAlgo, numProto, nChannels);
  switch (d) {
  case RG_TUNE_ONESHOT_UNOFFERED:
    rg_stats_add(RG_STAT_TUNER_ONESHOT_UNOFFERED, 1);
    if (!t->warned_unoffered_used) {
      t->warned_unoffered_used = 1;
      RG_INFO(NCCL_TUNING, "communicator 0x%llx: NCCL does not offer CollNet Direct for AllGather here; scheduling "
                           "gathers within the window onto it anyway, as ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1 asks",
              (unsigned long long)t->comm_id);
    }
    __attribute__((fallthrough)); /* counted as one-shot too */
  case RG_TUNE_ONESHOT:
    rg_stats_add(RG_STAT_TUNER_ONESHOT, 1);
    rg_stats_add(RG_STAT_TUNER_ONESHOT_BYTES, nBytes);
    break;
  case RG_TUNE_NCCL_NOT_OFFERED:
    rg_stats_add(RG_STAT_TUNER_NCCL_IGNORED, 1);
    if (!t->warned_not_offered) {
      t->warned_not_offered = 1;
      RG_INFO(NCCL_TUNING, "communicator 0x%llx: NCCL does not offer CollNet Direct for AllGather here (it drops it "
                           "on topologies without NVSwitch); gathers within the window stay on NCCL "
                           "(ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1 on both ranks uses it anyway)",
              (unsigned long long)t->comm_id);
    }
    __attribute__((fallthrough)); /* counted as handed to NCCL too */
  case RG_TUNE_NCCL:
    rg_stats_add(RG_STAT_TUNER_NCCL, 1);
    rg_stats_add(RG_STAT_TUNER_NCCL_BYTES, nBytes);
    break;
  default:
    break;
  }
  return ncclSuccess;
}

ncclResult_t rg_tuner_get_coll_info_v3(void* ctx, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                                       float** collCostTable, int numAlgo, int numProto, int* nChannels) {
  return rg_tuner_get_coll_info(ctx, collType, nBytes, numPipeOps, collCostTable, numAlgo, numProto, 0, nChannels);
}

int rg_tuner_chunk_policy(const rg_tuner* t, int collType, size_t nBytes, int algo, int proto, size_t* chunkSize) {
  if (collType != ncclFuncAllGather || t->nranks != 2 || algo != NCCL_ALGO_COLLNET_DIRECT ||
      proto != NCCL_PROTO_SIMPLE || !rg_tuner_in_window(t, nBytes) || t->oneshot_chunk == 0)
    return 0;
  /* NCCL cuts CollNet gathers into windows of its chunk, one iallgather each, and clamps
   * what a tuner returns to its buffer's step. Both ranks return the same agreed value. */
  *chunkSize = t->oneshot_chunk;
  return 1;
}

ncclResult_t rg_tuner_get_chunk_size(void* ctx, ncclFunc_t collType, size_t nBytes, int algo, int proto,
                                     int nChannels, size_t* chunkSize) {
  (void)nChannels;
  rg_tuner_chunk_policy(ctx, collType, nBytes, algo, proto, chunkSize);
  return ncclSuccess;
}

static ncclResult_t tuner_init(void** ctx, uint64_t commId, int hasCommId, size_t nRanks, size_t nNodes,
                               ncclDebugLogger_t log, int abi) {
  rg_tuner* t = calloc(1, sizeof(*t));
  if (t == NULL) return ncclSystemError;
  t->comm_id = commId;
  t->nranks = nRanks;
  t->nnodes = nNodes;
  int rc = rgGoTunerInit(t, hasCommId, (void*)log, abi);
  if (rc != ncclSuccess) {
    free(t);
    return (ncclResult_t)rc;
  }
  *ctx = t;
  return ncclSuccess;
}

ncclResult_t rg_tuner_init_v3(size_t nRanks, size_t nNodes, ncclDebugLogger_t log, void** ctx) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  return tuner_init(ctx, 0, 0, nRanks, nNodes, log, 3);
}
ncclResult_t rg_tuner_init_v4(size_t nRanks, size_t nNodes, ncclDebugLogger_t log, void** ctx) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  return tuner_init(ctx, 0, 0, nRanks, nNodes, log, 4);
}
ncclResult_t rg_tuner_init_v5(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t log,
                              ncclNvlDomainInfo_v5_t* nvl, ncclTunerConstants_v5_t* constants) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  (void)nvl, (void)constants;
  return tuner_init(ctx, commId, 1, nRanks, nNodes, log, 5);
}
ncclResult_t rg_tuner_init_v6(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t log,
                              ncclNvlDomainInfo_v6_t* nvl, ncclTunerConstants_v6_t* constants) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  (void)nvl, (void)constants;
  return tuner_init(ctx, commId, 1, nRanks, nNodes, log, 6);
}
ncclResult_t rg_tuner_init_v7(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t log,
                              ncclNvlDomainInfo_v7_t* nvl, ncclTunerConstants_v7_t* constants) {
  (void)nvl, (void)constants; /* NCCL's constants are left as NCCL set them */
  return tuner_init(ctx, commId, 1, nRanks, nNodes, log, 7);
}

ncclResult_t rg_tuner_finalize(void* ctx) {
  free(ctx);
  return ncclSuccess;
}
