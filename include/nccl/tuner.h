/* The tuner table, versions 3 to 7 (NCCL 2.22 to 2.32). */
#ifndef RG_NCCL_TUNER_H
#define RG_NCCL_TUNER_H

#include "common.h"

/* Cost table indices. NCCL passes numAlgo/numProto with every call; index with those. */
#define NCCL_ALGO_TREE 0
#define NCCL_ALGO_RING 1
#define NCCL_ALGO_COLLNET_DIRECT 2
#define NCCL_ALGO_COLLNET_CHAIN 3
#define NCCL_ALGO_NVLS 4
#define NCCL_ALGO_NVLS_TREE 5
#define NCCL_ALGO_PAT 6
#define NCCL_PROTO_LL 0
#define NCCL_PROTO_LL128 1
#define NCCL_PROTO_SIMPLE 2
/* The cost NCCL gives an entry it does not offer. NCCL 2.30 and earlier also skip an
 * entry a tuner sets to it; NCCL 2.31 and later take the plain minimum of the entries
 * they offered, where it is the cheapest of all. */
#define NCCL_ALGO_PROTO_IGNORE -1.0f

/* v3 (NCCL 2.22): the plugin edits NCCL's cost table. */
typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void** context);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int* nChannels);
  ncclResult_t (*destroy)(void* context);
} ncclTuner_v3_t;

/* v4 (NCCL 2.24): getCollInfo gains regBuff. */
typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void** context);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int regBuff, int* nChannels);
  ncclResult_t (*destroy)(void* context);
} ncclTuner_v4_t;

/* v5 (NCCL 2.28): per-communicator init with commId, NVLink domain info and tunable constants. */
#define RG_NCCL_TUNER_ALGOS_V5 7
#define RG_NCCL_TUNER_PROTOS_V5 3
#define RG_NCCL_TUNER_HW_LINKS_V5 3
#define RG_NCCL_TUNER_COMPCAPS_V5 4
#define RG_NCCL_TUNER_SCALES_V5 3

typedef struct {
  int nNvlDomains;
  int minRanksPerNvlDomain;
  int maxRanksPerNvlDomain;
} ncclNvlDomainInfo_v5_t;

typedef struct {
  double baseLatencies[RG_NCCL_TUNER_ALGOS_V5][RG_NCCL_TUNER_PROTOS_V5];
  double hwLatencies[RG_NCCL_TUNER_HW_LINKS_V5][RG_NCCL_TUNER_ALGOS_V5][RG_NCCL_TUNER_PROTOS_V5];
  double llMaxBws[RG_NCCL_TUNER_COMPCAPS_V5][RG_NCCL_TUNER_SCALES_V5];
  double perChMaxRingLL128Bws[RG_NCCL_TUNER_COMPCAPS_V5][RG_NCCL_TUNER_SCALES_V5];
  double perChMaxTreeLL128Bws[RG_NCCL_TUNER_COMPCAPS_V5][RG_NCCL_TUNER_SCALES_V5];
  double perChMaxTreeBws[RG_NCCL_TUNER_COMPCAPS_V5][RG_NCCL_TUNER_SCALES_V5];
  double perChMaxNVLSTreeBws[RG_NCCL_TUNER_COMPCAPS_V5][RG_NCCL_TUNER_SCALES_V5];
} ncclTunerConstants_v5_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction,
                       ncclNvlDomainInfo_v5_t* nvlDomainInfo, ncclTunerConstants_v5_t* constants);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int regBuff, int* nChannels);
  ncclResult_t (*finalize)(void* context);
} ncclTuner_v5_t;

/* v6 (NCCL 2.30): getChunkSize is appended (NCCL accepts NULL). */
typedef ncclNvlDomainInfo_v5_t ncclNvlDomainInfo_v6_t;
typedef ncclTunerConstants_v5_t ncclTunerConstants_v6_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction,
                       ncclNvlDomainInfo_v6_t* nvlDomainInfo, ncclTunerConstants_v6_t* constants);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int regBuff, int* nChannels);
  ncclResult_t (*finalize)(void* context);
  ncclResult_t (*getChunkSize)(void* context, ncclFunc_t collType, size_t nBytes, int algo, int proto,
                               int nChannels, size_t* chunkSize);
} ncclTuner_v6_t;

/* v7 (NCCL 2.32): v6's functions; the constants gain a fifth compute-capability row
 * (Rubin) in each per-capability table. The NVLink domain info is v5's. */
#define RG_NCCL_TUNER_COMPCAPS_V7 5
typedef ncclNvlDomainInfo_v5_t ncclNvlDomainInfo_v7_t;

typedef struct {
  double baseLatencies[RG_NCCL_TUNER_ALGOS_V5][RG_NCCL_TUNER_PROTOS_V5];
  double hwLatencies[RG_NCCL_TUNER_HW_LINKS_V5][RG_NCCL_TUNER_ALGOS_V5][RG_NCCL_TUNER_PROTOS_V5];
  double llMaxBws[RG_NCCL_TUNER_COMPCAPS_V7][RG_NCCL_TUNER_SCALES_V5];
  double perChMaxRingLL128Bws[RG_NCCL_TUNER_COMPCAPS_V7][RG_NCCL_TUNER_SCALES_V5];
  double perChMaxTreeLL128Bws[RG_NCCL_TUNER_COMPCAPS_V7][RG_NCCL_TUNER_SCALES_V5];
  double perChMaxTreeBws[RG_NCCL_TUNER_COMPCAPS_V7][RG_NCCL_TUNER_SCALES_V5];
  double perChMaxNVLSTreeBws[RG_NCCL_TUNER_COMPCAPS_V7][RG_NCCL_TUNER_SCALES_V5];
} ncclTunerConstants_v7_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction,
                       ncclNvlDomainInfo_v7_t* nvlDomainInfo, ncclTunerConstants_v7_t* constants);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int regBuff, int* nChannels);
  ncclResult_t (*finalize)(void* context);
  ncclResult_t (*getChunkSize)(void* context, ncclFunc_t collType, size_t nBytes, int algo, int proto,
                               int nChannels, size_t* chunkSize);
} ncclTuner_v7_t;

#endif
