/* The ABI check: every net table NCCL looks up present and complete, init and finalize
 * called for every version as NCCL would, no device offered (NCCL carries its traffic over
 * its own transports), and the interceptor's functions exported by the library itself. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include "driver.h"

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

static const char* net_fields[] = {"init",    "devices", "getProperties", "listen",      "connect",
                                   "accept",  "regMr",   "regMrDmaBuf",   "deregMr",     "isend",
                                   "irecv",   "iflush",  "test",          "closeSend",   "closeRecv",
                                   "closeListen", "getDeviceMr", "irecvConsumed", "makeVDevice", "finalize",
                                   "setNetAttr"};

/* Every slot after the name is a function pointer: all must be set. */
static int check_complete(const char* table, const void* t, size_t size) {
  int nslots = (int)((size - sizeof(char*)) / sizeof(void*));
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
      strncat(missing, net_fields[i], sizeof(missing) - strlen(missing) - 1);
    }
  if (missing[0]) {
    report(table, "complete", 0, "NULL entries: %s", missing);
    return 0;
  }
  report(table, "complete", 1, "name roce_gather, %d entries set", nslots);
  return 1;
}

/* NCCL asks how many devices there are right after init: none, so NCCL keeps its own. */
static void check_devices(const char* table, ncclResult_t (*devices)(int*)) {
  int n = -1;
  ncclResult_t r = devices(&n);
  report(table, "devices", r == ncclSuccess && n == 0,
         "devices returned %d with %d device(s) (0: NCCL carries its traffic over its own transports)", r, n);
}

/* The checks every net table gets; versions 11 and 12 have a finalize, called last. */
#define NET_CHECK(T, var, init_call, finalize_call)                                                       \
  do {                                                                                                    \
    const char* tname = T;                                                                                \
    if (var == NULL) {                                                                                    \
      report(tname, "present", 0, "dlsym found no %s", tname);                                            \
      break;                                                                                              \
    }                                                                                                     \
    report(tname, "present", 1, "exported");                                                              \
    _Static_assert(sizeof(*var) - sizeof(char*) <= sizeof(net_fields), "a name for every entry");         \
    if (!check_complete(tname, var, sizeof(*var))) break;                                                 \
    ncclResult_t r = init_call;                                                                           \
    report(tname, "init", r == ncclSuccess, "init returned %d", r);                                       \
    if (r != ncclSuccess) break;                                                                          \
    check_devices(tname, var->devices);                                                                   \
    finalize_call;                                                                                        \
  } while (0)

/* The functions the interceptor defines (plugin/intercept.c), NCCL's API names. */
static const char* interceptor_names[] = {"ncclAllGather",   "ncclAllReduce",  "ncclCommInitRank", "ncclCommInitRankConfig",
                                          "ncclCommInitAll", "ncclCommSplit",  "ncclCommFinalize", "ncclCommDestroy",
                                          "ncclCommAbort",   "ncclCommGetAsyncError", "ncclGroupStart", "ncclGroupEnd"};

/* Each name must resolve in the library itself, not in an object it depends on. */
static void check_interceptor(const plugin* p, const char* path) {
  Dl_info self;
  void* anchor = dlsym(p->lib, "ncclNetPlugin_v12");
  if (anchor == NULL || dladdr(anchor, &self) == 0) {
    report("interceptor", "exports", 0, "cannot locate the library in memory (no ncclNetPlugin_v12)");
    return;
  }
  for (size_t i = 0; i < sizeof(interceptor_names) / sizeof(interceptor_names[0]); i++) {
    const char* name = interceptor_names[i];
    void* f = dlsym(p->lib, name);
    Dl_info in;
    if (f == NULL) report("interceptor", name, 0, "dlsym found no %s in %s", name, path);
    else if (dladdr(f, &in) == 0 || in.dli_fbase != self.dli_fbase)
      report("interceptor", name, 0, "%s resolves in %s, not in the library", name, in.dli_fname ? in.dli_fname : "?");
    else report("interceptor", name, 1, "defined by the library");
  }
}

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
  const uint64_t comm = 0x5eed0001;
  NET_CHECK("ncclNetPlugin_v12", p.net12, p.net12->init(&ctx, comm, &config, driver_logger, NULL),
            report("ncclNetPlugin_v12", "finalize", p.net12->finalize(ctx) == ncclSuccess, "finalize(ctx)"));
  NET_CHECK("ncclNetPlugin_v11", p.net11, p.net11->init(&ctx, comm, &config, driver_logger, NULL),
            report("ncclNetPlugin_v11", "finalize", p.net11->finalize(ctx) == ncclSuccess, "finalize(ctx)"));
  NET_CHECK("ncclNetPlugin_v10", p.net10, p.net10->init(driver_logger, NULL), );
  NET_CHECK("ncclNetPlugin_v9", p.net9, p.net9->init(driver_logger), );
  NET_CHECK("ncclNetPlugin_v8", p.net8, p.net8->init(driver_logger), );
  check_interceptor(&p, path);
  report("library", "warnings", driver_warns == 0, "%d WARN line(s) logged during the check", driver_warns);
  return failures == 0 ? 0 : 1;
}
