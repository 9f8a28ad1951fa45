/* A stand-in plugin for plugincheck's own tests: it loads the real library and exports
 * copies of its tables with one thing broken, as RG_BREAK says:
 *   TABLE:N        sets entry N (counting from 0 after the name) of TABLE to NULL
 *   TABLE:props12  makes TABLE's getProperties write a v12 properties struct
 *   TABLE:ignore   makes tuner TABLE (v4 on) write NCCL's -1 onto every CollNet entry, as
 *                  the tuner did before NCCL 2.31 made -1 the cheapest
 *   TABLE:constants7  makes tuner TABLE (v5 on) clear a v7 constants struct at init */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "nccl/net.h"
#include "nccl/tuner.h"

ncclNet_v12_t ncclNetPlugin_v12;
ncclNet_v11_t ncclNetPlugin_v11;
ncclNet_v10_t ncclNetPlugin_v10;
ncclNet_v9_t ncclNetPlugin_v9;
ncclNet_v8_t ncclNetPlugin_v8;
ncclCollNet_v12_t ncclCollNetPlugin_v12;
ncclCollNet_v11_t ncclCollNetPlugin_v11;
ncclCollNet_v10_t ncclCollNetPlugin_v10;
ncclCollNet_v9_t ncclCollNetPlugin_v9;
ncclCollNet_v8_t ncclCollNetPlugin_v8;
ncclTuner_v7_t ncclTunerPlugin_v7;
ncclTuner_v6_t ncclTunerPlugin_v6;
ncclTuner_v5_t ncclTunerPlugin_v5;
ncclTuner_v4_t ncclTunerPlugin_v4;
ncclTuner_v3_t ncclTunerPlugin_v3;

static struct {
  const char* name;
  void* copy;
  size_t size;
} tables[] = {
#define T(n) {#n, &n, sizeof(n)}
    T(ncclNetPlugin_v12),     T(ncclNetPlugin_v11),     T(ncclNetPlugin_v10),     T(ncclNetPlugin_v9),
    T(ncclNetPlugin_v8),      T(ncclCollNetPlugin_v12), T(ncclCollNetPlugin_v11), T(ncclCollNetPlugin_v10),
    T(ncclCollNetPlugin_v9),  T(ncclCollNetPlugin_v8),  T(ncclTunerPlugin_v7),    T(ncclTunerPlugin_v6),
    T(ncclTunerPlugin_v5),    T(ncclTunerPlugin_v4),    T(ncclTunerPlugin_v3),
#undef T
};

/* The real functions the broken ones wrap (the init of each of v5 to v7 has one shape). */
typedef ncclResult_t (*coll_info_fn)(void*, ncclFunc_t, size_t, int, float**, int, int, int, int*);
typedef ncclResult_t (*tuner_init_fn)(void**, uint64_t, size_t, size_t, ncclDebugLogger_t, ncclNvlDomainInfo_v5_t*,
                                      void*);
static coll_info_fn real_coll_info;
static tuner_init_fn real_tuner_init;

static ncclResult_t coll_info_writing_ignore(void* ctx, ncclFunc_t coll, size_t nBytes, int pipeOps, float** table,
                                             int numAlgo, int numProto, int regBuff, int* nChannels) {
  ncclResult_t r = real_coll_info(ctx, coll, nBytes, pipeOps, table, numAlgo, numProto, regBuff, nChannels);
  for (int p = 0; p < numProto; p++) {
    ((float*)table)[NCCL_ALGO_COLLNET_DIRECT * numProto + p] = NCCL_ALGO_PROTO_IGNORE;
    ((float*)table)[NCCL_ALGO_COLLNET_CHAIN * numProto + p] = NCCL_ALGO_PROTO_IGNORE;
  }
  return r;
}

static ncclResult_t init_clearing_v7_constants(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes,
                                               ncclDebugLogger_t log, ncclNvlDomainInfo_v5_t* nvl, void* constants) {
  ncclResult_t r = real_tuner_init(ctx, commId, nRanks, nNodes, log, nvl, constants);
  memset(constants, 0, sizeof(ncclTunerConstants_v7_t));
  return r;
}

__attribute__((constructor)) static void load(void) {
  void* real = dlopen(getenv("RG_REAL_LIB"), RTLD_NOW | RTLD_LOCAL);
  if (real == NULL) {
    fprintf(stderr, "breaklib: %s\n", dlerror());
    return;
  }
  for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++) {
    void* t = dlsym(real, tables[i].name);
    if (t) memcpy(tables[i].copy, t, tables[i].size);
  }
  const char* spec = getenv("RG_BREAK");
  const char* colon = spec ? strchr(spec, ':') : NULL;
  if (colon == NULL) return;
  for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++) {
    if (strncmp(tables[i].name, spec, (size_t)(colon - spec)) != 0 || tables[i].name[colon - spec] != '\0') continue;
    if (strcmp(colon + 1, "props12") == 0) {
      /* getProperties is entry 2 in every net and collNet table. */
      void** slots = (void**)((char*)tables[i].copy + sizeof(char*));
      slots[2] = (void*)ncclNetPlugin_v12.getProperties;
    } else if (strcmp(colon + 1, "ignore") == 0) {
      /* getCollInfo is entry 1 of every tuner table. */
      void** slots = (void**)((char*)tables[i].copy + sizeof(char*));
      real_coll_info = (coll_info_fn)slots[1];
      slots[1] = (void*)coll_info_writing_ignore;
    } else if (strcmp(colon + 1, "constants7") == 0) {
      void** slots = (void**)((char*)tables[i].copy + sizeof(char*));
      real_tuner_init = (tuner_init_fn)slots[0];
      slots[0] = (void*)init_clearing_v7_constants;
    } else {
      void** slots = (void**)((char*)tables[i].copy + sizeof(char*));
      slots[atoi(colon + 1)] = NULL;
    }
  }
}
