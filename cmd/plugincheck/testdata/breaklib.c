/* A stand-in library for plugincheck's own tests: it loads the real library and exports
 * copies of its net tables with one thing broken, as RG_BREAK says:
 *   TABLE:N         sets entry N (counting from 0 after the name) of TABLE to NULL
 *   TABLE:devices1  makes TABLE's devices offer NCCL one device
 * It defines the interceptor's functions too (never to be called: the ABI check only looks
 * them up), each but the one -DDROP_<name> leaves out. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "nccl/net.h"

ncclNet_v12_t ncclNetPlugin_v12;
ncclNet_v11_t ncclNetPlugin_v11;
ncclNet_v10_t ncclNetPlugin_v10;
ncclNet_v9_t ncclNetPlugin_v9;
ncclNet_v8_t ncclNetPlugin_v8;

static struct {
  const char* name;
  void* copy;
  size_t size;
} tables[] = {
#define T(n) {#n, &n, sizeof(n)}
    T(ncclNetPlugin_v12), T(ncclNetPlugin_v11), T(ncclNetPlugin_v10), T(ncclNetPlugin_v9), T(ncclNetPlugin_v8),
#undef T
};

static ncclResult_t one_device(int* ndev) {
  *ndev = 1;
  return ncclSuccess;
}

static void not_for_calling(void) {
  fprintf(stderr, "breaklib: an interceptor function was called\n");
  abort();
}

#define WRAPPER(name) extern __typeof(not_for_calling) name __attribute__((alias("not_for_calling")))
#ifndef DROP_ncclAllGather
WRAPPER(ncclAllGather);
#endif
#ifndef DROP_ncclAllReduce
WRAPPER(ncclAllReduce);
#endif
#ifndef DROP_ncclCommInitRank
WRAPPER(ncclCommInitRank);
#endif
#ifndef DROP_ncclCommInitRankConfig
WRAPPER(ncclCommInitRankConfig);
#endif
#ifndef DROP_ncclCommInitAll
WRAPPER(ncclCommInitAll);
#endif
#ifndef DROP_ncclCommSplit
WRAPPER(ncclCommSplit);
#endif
#ifndef DROP_ncclCommFinalize
WRAPPER(ncclCommFinalize);
#endif
#ifndef DROP_ncclCommDestroy
WRAPPER(ncclCommDestroy);
#endif
#ifndef DROP_ncclCommAbort
WRAPPER(ncclCommAbort);
#endif
#ifndef DROP_ncclCommGetAsyncError
WRAPPER(ncclCommGetAsyncError);
#endif
#ifndef DROP_ncclGroupStart
WRAPPER(ncclGroupStart);
#endif
#ifndef DROP_ncclGroupEnd
WRAPPER(ncclGroupEnd);
#endif

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
    void** slots = (void**)((char*)tables[i].copy + sizeof(char*));
    if (strcmp(colon + 1, "devices1") == 0) slots[1] = (void*)one_device; /* devices is entry 1 of every version */
    else slots[atoi(colon + 1)] = NULL;
  }
}
