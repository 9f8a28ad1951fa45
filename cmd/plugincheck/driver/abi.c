/* The ABI check: every versioned table present and complete, and init, devices,
 * getProperties and finalize called for every version, as NCCL would. */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include "driver.h"
#include "select.h"

static int failures;

static void report(const char* table, const char* check, int ok, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void report(const char* table, const char* check, int ok, const char* fmt, ...) {
  char detail[512] = "";
  if (fmt) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof(detail), fmt, ap);
    va_end(ap);
  }
  if (!ok) failures++;
  printf("{\"table\":");
  json_string(stdout, table);
  printf(",\"check\":");
  json_string(stdout, check);
  printf(",\"ok\":%s,\"detail\":", ok ? "true" : "false");
  json_string(stdout, detail);
  printf("}\n");
  fflush(stdout);
}

static const char* net8_fields[] = {"init",    "devices", "getProperties", "listen",      "connect",
                                    "accept",  "regMr",   "regMrDmaBuf",   "deregMr",     "isend",
                                    "irecv",   "iflush",  "test",          "closeSend",   "closeRecv",
                                    "closeListen", "getDeviceMr", "irecvConsumed", "makeVDevice", "finalize",
                                    "setNetAttr"};
static const char* coll8_fields[] = {"init",          "devices",    "getProperties", "listen",      "connect",
                                     "reduceSupport", "regMr",      "regMrDmaBuf",   "deregMr",     "iallreduce",
                                     "iallgather",    "ireducescatter", "iflush",    "test",        "closeColl",
                                     "closeListen",   "makeVDevice", "finalize"};
static const char* tuner_fields[] = {"init", "getCollInfo", "finalize", "getChunkSize"};

/* Every slot after the name is a function pointer: all must be set. */
static int check_complete(const char* table, const void* t, size_t size, const char** names, int nnames) {
  int nslots = (int)((size - sizeof(char*)) / sizeof(void*));
  if (nslots != nnames) {
    report(table, "complete", 0, "this checker knows %d entries, the declared table has %d", nnames, nslots);
    return 0;
  }
  const char* name = *(const char* const*)t;
  if (name == NULL || strcmp(name, "roce_gather") != 0) {
    report(table, "name", 0, "name is %s, expected roce_gather", name ? name : "NULL");
    return 0;
  }
  void* const* slots = (void* const*)((const char*)t + sizeof(char*));
  char missing[512] = "";
  for (int i = 0; i < nslots; i++)
    if (slots[i] == NULL) {
      strncat(missing, missing[0] ? ", " : "", sizeof(missing) - strlen(missing) - 1);
      strncat(missing, names[i], sizeof(missing) - strlen(missing) - 1);
    }
  if (missing[0]) {
    report(table, "complete", 0, "NULL entries: %s", missing);
    return 0;
  }
  report(table, "complete", 1, "name roce_gather, %d entries set", nslots);
  return 1;
}

#define CANARY 0xA5
#define SLACK 64

typedef struct props_view {
  const char* name;
  int ptrSupport, speed, maxComms, maxRecvs, netDeviceType, netDeviceVersion;
  float latency;
  int has_sizes;
  uint64_t maxP2pBytes, maxCollBytes;
} props_view;

/* Calls getProperties into a buffer with a canary behind the version's struct, so a
 * plugin writing a bigger (newer) struct is caught, then reads fields at their offsets. */
static int get_props(const char* table, ncclResult_t (*fn)(int, void*), size_t size, size_t off_p2p,
                     size_t off_coll, props_view* v) {
  unsigned char* buf = malloc(size + SLACK);
  memset(buf, CANARY, size + SLACK);
  ncclResult_t r = fn(0, buf);
  if (r != ncclSuccess) {
    report(table, "getProperties", 0, "getProperties(0) returned %d", r);
    free(buf);
    return 0;
  }
  for (int i = 0; i < SLACK; i++)
    if (buf[size + i] != CANARY) {
      report(table, "getProperties", 0, "wrote beyond the %zu-byte struct of this version (byte %zu)", size,
             size + (size_t)i);
      free(buf);
      return 0;
    }
  const ncclNetProperties_v8_t* p8 = (const void*)buf; /* the leading fields share offsets up to regIsGlobal */
  memset(v, 0, sizeof(*v));
  v->name = p8->name;
  v->ptrSupport = p8->ptrSupport;
  if (off_p2p == 0) { /* v8 */
    v->speed = p8->speed;
    v->latency = p8->latency;
    v->maxComms = p8->maxComms;
    v->maxRecvs = p8->maxRecvs;
    v->netDeviceType = p8->netDeviceType;
    v->netDeviceVersion = p8->netDeviceVersion;
  } else {
    const ncclNetProperties_v9_t* p9 = (const void*)buf;
    v->speed = p9->speed;
    v->latency = p9->latency;
    v->maxComms = p9->maxComms;
    v->maxRecvs = p9->maxRecvs;
    v->netDeviceType = p9->netDeviceType;
    v->netDeviceVersion = p9->netDeviceVersion;
    v->has_sizes = 1;
    memcpy(&v->maxP2pBytes, buf + off_p2p, 8);
    memcpy(&v->maxCollBytes, buf + off_coll, 8);
  }
  free(buf);
  return 1;
}

static void check_props(const char* table, const props_view* v) {
  char why[256] = "";
  if (v->name == NULL || v->name[0] == '\0') snprintf(why, sizeof(why), "name is empty");
  else if (!(v->ptrSupport & NCCL_PTR_HOST)) snprintf(why, sizeof(why), "ptrSupport 0x%x lacks NCCL_PTR_HOST", v->ptrSupport);
  else if (v->ptrSupport & ~(NCCL_PTR_HOST | NCCL_PTR_CUDA | NCCL_PTR_DMABUF)) snprintf(why, sizeof(why), "ptrSupport 0x%x has unknown bits", v->ptrSupport);
  else if (v->speed <= 0) snprintf(why, sizeof(why), "speed %d Mbps is not positive", v->speed);
  else if (!(v->latency >= 0.0f && v->latency < 1000.0f)) snprintf(why, sizeof(why), "latency %g us is out of range", v->latency);
  else if (v->maxComms <= 0) snprintf(why, sizeof(why), "maxComms %d is not positive", v->maxComms);
  else if (v->maxRecvs < 1 || v->maxRecvs > 8) snprintf(why, sizeof(why), "maxRecvs %d is outside 1..8", v->maxRecvs);
  else if (v->netDeviceType != NCCL_NET_DEVICE_HOST || v->netDeviceVersion != 0)
    snprintf(why, sizeof(why), "device type %d version %d, expected host/0", v->netDeviceType, v->netDeviceVersion);
  else if (v->has_sizes && (v->maxP2pBytes == 0 || v->maxP2pBytes > NCCL_MAX_NET_SIZE_BYTES))
    snprintf(why, sizeof(why), "maxP2pBytes %llu is outside (0, 1 TiB]", (unsigned long long)v->maxP2pBytes);
  else if (v->has_sizes && (v->maxCollBytes == 0 || v->maxCollBytes > NCCL_MAX_NET_SIZE_BYTES))
    snprintf(why, sizeof(why), "maxCollBytes %llu is outside (0, 1 TiB]", (unsigned long long)v->maxCollBytes);
  if (why[0]) {
    report(table, "properties", 0, "%s", why);
    return;
  }
  if (v->has_sizes)
    report(table, "properties", 1, "device %s, ptrSupport 0x%x, %d Mbps, latency %g us, maxRecvs %d, maxP2pBytes %llu, maxCollBytes %llu",
           v->name, v->ptrSupport, v->speed, v->latency, v->maxRecvs, (unsigned long long)v->maxP2pBytes,
           (unsigned long long)v->maxCollBytes);
  else
    report(table, "properties", 1, "device %s, ptrSupport 0x%x, %d Mbps, latency %g us, maxRecvs %d", v->name,
           v->ptrSupport, v->speed, v->latency, v->maxRecvs);
}

static void check_devices(const char* table, ncclResult_t (*devices)(int*)) {
  int n = -1;
  ncclResult_t r = devices(&n);
  report(table, "devices", r == ncclSuccess && n >= 1, "devices returned %d with %d device(s)", r, n);
}

static void check_reduce_support(const char* table, ncclResult_t (*reduce_support)(ncclDataType_t, ncclRedOp_t, int*)) {
  int sup = -1;
  ncclResult_t r = reduce_support(ncclFloat32, ncclSum, &sup);
  report(table, "reduceSupport", r == ncclSuccess && sup == 0, "float32 sum: returned %d, supported %d", r, sup);
}

/* The checks every net and collNet table gets; table_check adds the kind's own. */
#define TABLE_CHECK(T, var, fields, props_t, offp2p, offcoll, init_call, table_check, finalize_call)                 \
  do {                                                                                                                  \
    const char* tname = T;                                                                                              \
    if (var == NULL) {                                                                                                  \
      report(tname, "present", 0, "dlsym found no %s", tname);                                                          \
      break;                                                                                                            \
    }                                                                                                                   \
    report(tname, "present", 1, "exported");                                                                            \
    if (!check_complete(tname, var, sizeof(*var), fields, (int)((sizeof(*var) - 8) / 8))) break;                        \
    ncclResult_t r = init_call;                                                                                         \
    report(tname, "init", r == ncclSuccess, "init returned %d", r);                                                     \
    if (r != ncclSuccess) break;                                                                                        \
    check_devices(tname, var->devices);                                                                                 \
    props_view pv;                                                                                                      \
    if (get_props(tname, (ncclResult_t(*)(int, void*))var->getProperties, sizeof(props_t), offp2p, offcoll, &pv))      \
      check_props(tname, &pv);                                                                                          \
    table_check;                                                                                                        \
    finalize_call;                                                                                                      \
  } while (0)

#define NET_CHECK(T, var, props_t, offp2p, offcoll, init_call, finalize_call) \
  TABLE_CHECK(T, var, net8_fields, props_t, offp2p, offcoll, init_call, , finalize_call)
#define COLL_CHECK(T, var, props_t, offp2p, offcoll, init_call, finalize_call)                        \
  TABLE_CHECK(T, var, coll8_fields, props_t, offp2p, offcoll, init_call,                              \
              check_reduce_support(tname, var->reduceSupport), finalize_call)

/* NCCL's cost table for a two-rank AllGather with every entry offered, CollNet the
 * cheapest (as NCCL may rate it), Tree / LL the cheapest of NCCL's own algorithms. */
static void fill_table(float* before, float* table, int* nch) {
  for (int i = 0; i < 21; i++) {
    int collnet = i / 3 == NCCL_ALGO_COLLNET_DIRECT || i / 3 == NCCL_ALGO_COLLNET_CHAIN;
    before[i] = table[i] = (collnet ? 1.0f : 10.0f) + (float)i;
  }
  *nch = 0;
}

/* Checks one version's getCollInfo on fill_table's table. Without a collNet group the tuner
 * leaves the gather to NCCL: NCCL's own entries and channels untouched, CollNet priced out
 * with no negative cost, so that NCCL 2.30's rule and 2.31's both pick NCCL's own best. */
static void check_coll_info(const char* tname, ncclResult_t r, const float* before, const float* table, int nch) {
  if (r != ncclSuccess) {
    report(tname, "getCollInfo", 0, "returned %d", r);
    return;
  }
  const int own_best = NCCL_ALGO_TREE * 3 + NCCL_PROTO_LL;
  int by230 = nccl_pick_skipping_negatives(table, 21), by231 = nccl_pick_plain_minimum(before, table, 21);
  char why[256] = "";
  if (nch != 0) snprintf(why, sizeof(why), "nChannels set to %d, expected 0 (NCCL's choice)", nch);
  for (int i = 0; i < 21 && !why[0]; i++) {
    int collnet = i / 3 == NCCL_ALGO_COLLNET_DIRECT || i / 3 == NCCL_ALGO_COLLNET_CHAIN;
    if (table[i] < 0.0f)
      snprintf(why, sizeof(why), "algo %d / proto %d set to %g: NCCL 2.31 takes a negative cost as the cheapest", i / 3,
               i % 3, table[i]);
    else if (!collnet && table[i] != before[i])
      snprintf(why, sizeof(why), "NCCL's own algo %d / proto %d changed from %g to %g", i / 3, i % 3, before[i],
               table[i]);
  }
  if (!why[0] && (by230 != own_best || by231 != own_best))
    snprintf(why, sizeof(why), "NCCL 2.30's rule picks algo %d / proto %d, 2.31's algo %d / proto %d; NCCL's own best is %d / %d",
             by230 / 3, by230 % 3, by231 / 3, by231 % 3, own_best / 3, own_best % 3);
  if (why[0]) {
    report(tname, "getCollInfo", 0, "AllGather with no collNet group: %s", why);
    return;
  }
  report(tname, "getCollInfo", 1,
         "AllGather with no collNet group: left to NCCL, CollNet priced out at %g; NCCL 2.30's and 2.31's rules both "
         "pick algo %d / proto %d, NCCL's own best",
         table[NCCL_ALGO_COLLNET_DIRECT * 3 + NCCL_PROTO_SIMPLE], by230 / 3, by230 % 3);
}

/* NCCL's tuning constants as init gets them: a pattern, with the same pattern behind the
 * version's struct. init must leave both alone (NCCL 2.31.2 passes them uninitialised). */
#define CONSTANTS_BUF (sizeof(ncclTunerConstants_v7_t) + SLACK)
static void check_constants(const char* tname, const unsigned char* buf, size_t size) {
  for (size_t i = size; i < size + SLACK; i++) /* a bigger (newer) struct written is the worse fault */
    if (buf[i] != CANARY) {
      report(tname, "constants", 0, "init wrote past NCCL's constants, at byte %zu (the struct of this version has %zu)",
             i, size);
      return;
    }
  for (size_t i = 0; i < size; i++)
    if (buf[i] != CANARY) {
      report(tname, "constants", 0, "init changed NCCL's constants at byte %zu (the struct of this version has %zu)", i,
             size);
      return;
    }
  report(tname, "constants", 1, "init left NCCL's %zu bytes of constants, and the %d behind them, as they were", size,
         SLACK);
}

#define TUNER_PRESENT(T, var, nfields)                                                           \
  (var == NULL ? (report(T, "present", 0, "dlsym found no %s", T), 0)                              \
               : (report(T, "present", 1, "exported"),                                            \
                  check_complete(T, var, sizeof(*var), tuner_fields, nfields)))

/* One tuner table: present and complete, init, one AllGather decision, extra checks, then
 * the call that ends it (finalize, or destroy before v5). */
#define TUNER_CHECK(T, var, nfields, init_call, coll_info_call, extra, fini)                       \
  do {                                                                                            \
    if (TUNER_PRESENT(T, var, nfields)) {                                                         \
      memset(constants, CANARY, CONSTANTS_BUF);                                                   \
      ncclResult_t r = init_call;                                                                 \
      report(T, "init", r == ncclSuccess, "init returned %d", r);                                 \
      if (r == ncclSuccess) {                                                                     \
        fill_table(before, table, &nch);                                                          \
        r = coll_info_call;                                                                       \
        check_coll_info(T, r, before, table, nch);                                                \
        extra;                                                                                    \
        report(T, "finalize", var->fini(tctx) == ncclSuccess, #fini "(ctx)");                     \
      }                                                                                           \
    }                                                                                             \
  } while (0)

/* Tuner v6 and later: getChunkSize leaves NCCL's chunk of a gather that is not one-shot. */
#define CHUNK_CHECK(T, var)                                                                                     \
  do {                                                                                                          \
    size_t chunk = 131072;                                                                                      \
    ncclResult_t cr = var->getChunkSize(tctx, ncclFuncAllGather, 4096, NCCL_ALGO_RING, NCCL_PROTO_SIMPLE, 2, &chunk); \
    report(T, "getChunkSize", cr == ncclSuccess && chunk == 131072,                                             \
           "ring AllGather: returned %d, chunk %zu (NCCL's 131072 kept)", cr, chunk);                           \
  } while (0)

int run_abi(const char* path) {
  plugin p;
  char err[512];
  driver_tag = "abi";
  if (plugin_open(path, &p, err, sizeof(err)) != 0) {
    report("library", "dlopen", 0, "%s", err);
    return 1;
  }
  report("library", "dlopen", 1, "%s with RTLD_NOW|RTLD_LOCAL", path);

  ncclNetCommConfig_v12_t config = {.trafficClass = -1};
  void* ctx = NULL;
  void* cctx = NULL;
  const uint64_t comm = 0x5eed0001;

  NET_CHECK("ncclNetPlugin_v12", p.net12, ncclNetProperties_v12_t, 104, 112,
            p.net12->init(&ctx, comm, &config, driver_logger, NULL),
            report("ncclNetPlugin_v12", "finalize", p.net12->finalize(ctx) == ncclSuccess, "finalize(ctx)"));
  NET_CHECK("ncclNetPlugin_v11", p.net11, ncclNetProperties_v11_t, 88, 96,
            p.net11->init(&ctx, comm, &config, driver_logger, NULL),
            report("ncclNetPlugin_v11", "finalize", p.net11->finalize(ctx) == ncclSuccess, "finalize(ctx)"));
  NET_CHECK("ncclNetPlugin_v10", p.net10, ncclNetProperties_v10_t, 88, 96, p.net10->init(driver_logger, NULL), );
  NET_CHECK("ncclNetPlugin_v9", p.net9, ncclNetProperties_v9_t, 88, 96, p.net9->init(driver_logger), );
  NET_CHECK("ncclNetPlugin_v8", p.net8, ncclNetProperties_v8_t, 0, 0, p.net8->init(driver_logger), );

  COLL_CHECK("ncclCollNetPlugin_v12", p.coll12, ncclNetProperties_v12_t, 104, 112,
             p.coll12->init(&cctx, comm, driver_logger),
             report("ncclCollNetPlugin_v12", "finalize", p.coll12->finalize(cctx) == ncclSuccess, "finalize(ctx)"));
  COLL_CHECK("ncclCollNetPlugin_v11", p.coll11, ncclNetProperties_v11_t, 88, 96,
             p.coll11->init(&cctx, comm, driver_logger),
             report("ncclCollNetPlugin_v11", "finalize", p.coll11->finalize(cctx) == ncclSuccess, "finalize(ctx)"));
  COLL_CHECK("ncclCollNetPlugin_v10", p.coll10, ncclNetProperties_v10_t, 88, 96, p.coll10->init(driver_logger), );
  COLL_CHECK("ncclCollNetPlugin_v9", p.coll9, ncclNetProperties_v9_t, 88, 96, p.coll9->init(driver_logger), );
  COLL_CHECK("ncclCollNetPlugin_v8", p.coll8, ncclNetProperties_v8_t, 0, 0, p.coll8->init(driver_logger), );

  float before[21], table[21];
  int nch;
  void* tctx = NULL;
  ncclNvlDomainInfo_v5_t nvl = {1, 1, 1};
  unsigned char* constants = malloc(CONSTANTS_BUF);
  TUNER_CHECK("ncclTunerPlugin_v7", p.tuner7, 4,
              p.tuner7->init(&tctx, comm, 2, 2, driver_logger, &nvl, (ncclTunerConstants_v7_t*)constants),
              p.tuner7->getCollInfo(tctx, ncclFuncAllGather, 4096, 1, (float**)table, 7, 3, 0, &nch),
              CHUNK_CHECK("ncclTunerPlugin_v7", p.tuner7);
              check_constants("ncclTunerPlugin_v7", constants, sizeof(ncclTunerConstants_v7_t)), finalize);
  TUNER_CHECK("ncclTunerPlugin_v6", p.tuner6, 4,
              p.tuner6->init(&tctx, comm, 2, 2, driver_logger, &nvl, (ncclTunerConstants_v6_t*)constants),
              p.tuner6->getCollInfo(tctx, ncclFuncAllGather, 4096, 1, (float**)table, 7, 3, 0, &nch),
              CHUNK_CHECK("ncclTunerPlugin_v6", p.tuner6);
              check_constants("ncclTunerPlugin_v6", constants, sizeof(ncclTunerConstants_v6_t)), finalize);
  TUNER_CHECK("ncclTunerPlugin_v5", p.tuner5, 3,
              p.tuner5->init(&tctx, comm, 2, 2, driver_logger, &nvl, (ncclTunerConstants_v5_t*)constants),
              p.tuner5->getCollInfo(tctx, ncclFuncAllGather, 4096, 1, (float**)table, 7, 3, 0, &nch),
              check_constants("ncclTunerPlugin_v5", constants, sizeof(ncclTunerConstants_v5_t)), finalize);
  TUNER_CHECK("ncclTunerPlugin_v4", p.tuner4, 3, p.tuner4->init(2, 2, driver_logger, &tctx),
              p.tuner4->getCollInfo(tctx, ncclFuncAllGather, 4096, 1, (float**)table, 7, 3, 0, &nch), , destroy);
  TUNER_CHECK("ncclTunerPlugin_v3", p.tuner3, 3, p.tuner3->init(2, 2, driver_logger, &tctx),
              p.tuner3->getCollInfo(tctx, ncclFuncAllGather, 4096, 1, (float**)table, 7, 3, &nch), , destroy);
  free(constants);
  report("library", "warnings", driver_warns == 0, "%d WARN line(s) logged during the check", driver_warns);
  return failures == 0 ? 0 : 1;
}
