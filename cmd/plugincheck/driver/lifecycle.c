/* NCCL's life cycle of the net table, repeated: init (one a communicator from NCCL 2.28),
 * devices, finalize; and for "reopen", dlclose and dlopen around each cycle as NCCL 2.28
 * does when its last communicator goes. Prints what the process holds before and after. */
#include <dirent.h>
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include "driver.h"

static int count_fds(void) {
  DIR* d = opendir("/proc/self/fd");
  int n = 0;
  if (d == NULL) return -1;
  while (readdir(d) != NULL) n++;
  closedir(d);
  return n - 3; /* ".", ".." and the directory's own descriptor */
}

static long status_field(const char* key) {
  FILE* f = fopen("/proc/self/status", "r");
  char line[256];
  long v = -1;
  size_t kl = strlen(key);
  while (f && fgets(line, sizeof(line), f))
    if (strncmp(line, key, kl) == 0) v = atol(line + kl);
  if (f) fclose(f);
  return v;
}

static void snapshot(const char* label, int cycle) {
  printf("CYCLE %s %d fds=%d threads=%ld rss_kb=%ld\n", label, cycle, count_fds(), status_field("Threads:"),
         status_field("VmRSS:"));
  fflush(stdout);
}

static int one_cycle(const plugin* p, int cycle) {
  void* ctx = NULL;
  ncclNetCommConfig_v12_t cfg = {.trafficClass = -1};
  int n = -1;
  if (p->net12->init(&ctx, 0x100 + (uint64_t)cycle, &cfg, driver_logger, NULL) != ncclSuccess) return -1;
  if (p->net12->devices(&n) != ncclSuccess || n != 0) return -1;
  if (p->net12->finalize(ctx) != ncclSuccess) return -1;
  return 0;
}

int run_lifecycle(const char* path, int cycles, int reopen) {
  driver_tag = "lifecycle";
  plugin p;
  char err[512];
  if (plugin_open(path, &p, err, sizeof(err)) != 0 || p.net12 == NULL) {
    fprintf(stderr, "[lifecycle] %s\n", p.lib ? "the library lacks ncclNetPlugin_v12" : err);
    return 2;
  }
  /* The first cycle starts the runtime's threads; measure from the second. */
  if (one_cycle(&p, 0) != 0) {
    printf("FAILED cycle 0\n");
    return 1;
  }
  snapshot("first", 1);
  for (int c = 1; c <= cycles; c++) {
    if (reopen) {
      dlclose(p.lib);
      if (plugin_open(path, &p, err, sizeof(err)) != 0) {
        printf("FAILED reopening at cycle %d: %s\n", c, err);
        return 1;
      }
    }
    if (one_cycle(&p, c) != 0) {
      printf("FAILED cycle %d\n", c);
      return 1;
    }
  }
  snapshot("last", cycles);
  printf("OK %d cycles%s\n", cycles, reopen ? " with dlclose/dlopen" : "");
  return 0;
}
