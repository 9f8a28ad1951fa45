#define _GNU_SOURCE
#include "driver.h"
#include <dlfcn.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

int driver_verbose;
int driver_warns;
const char* driver_tag = "driver";

void driver_logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)flags, (void)file, (void)line;
  if (level == NCCL_LOG_WARN) __atomic_add_fetch(&driver_warns, 1, __ATOMIC_RELAXED);
  if (level != NCCL_LOG_WARN && !(driver_verbose && level == NCCL_LOG_INFO)) return;
  char msg[1200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  fprintf(stderr, "[%s] NCCL %s %s\n", driver_tag, level == NCCL_LOG_WARN ? "WARN" : "INFO", msg);
}

int plugin_open(const char* path, plugin* p, char* err, int errlen) {
  memset(p, 0, sizeof(*p));
  /* As NCCL opens a net plugin: every symbol resolved now, nothing leaked into the global scope. */
  p->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (p->lib == NULL) {
    snprintf(err, errlen, "dlopen(%s): %s", path, dlerror());
    return -1;
  }
  p->net12 = dlsym(p->lib, "ncclNetPlugin_v12");
  p->net11 = dlsym(p->lib, "ncclNetPlugin_v11");
  p->net10 = dlsym(p->lib, "ncclNetPlugin_v10");
  p->net9 = dlsym(p->lib, "ncclNetPlugin_v9");
  p->net8 = dlsym(p->lib, "ncclNetPlugin_v8");
  return 0;
}

static int usage(void) {
  fprintf(stderr,
          "usage: plugincheck-driver [-v] abi LIB\n"
          "       plugincheck-driver [-v] lifecycle LIB CYCLES [reopen]\n");
  return 2;
}

int main(int argc, char** argv) {
  int a = 1;
  if (a < argc && strcmp(argv[a], "-v") == 0) {
    driver_verbose = 1;
    a++;
  }
  if (a + 1 < argc && strcmp(argv[a], "abi") == 0) return run_abi(argv[a + 1]);
  if (a + 2 < argc && strcmp(argv[a], "lifecycle") == 0)
    return run_lifecycle(argv[a + 1], atoi(argv[a + 2]), a + 3 < argc && strcmp(argv[a + 3], "reopen") == 0);
  return usage();
}
