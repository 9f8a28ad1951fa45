#define _GNU_SOURCE
#include "driver.h"
#include <dlfcn.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int driver_verbose;
int driver_warns;
const char* driver_tag = "driver";

uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

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

void json_string(FILE* f, const char* s) {
  fputc('"', f);
  for (; s && *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
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
  p->coll12 = dlsym(p->lib, "ncclCollNetPlugin_v12");
  p->coll11 = dlsym(p->lib, "ncclCollNetPlugin_v11");
  p->coll10 = dlsym(p->lib, "ncclCollNetPlugin_v10");
  p->coll9 = dlsym(p->lib, "ncclCollNetPlugin_v9");
  p->coll8 = dlsym(p->lib, "ncclCollNetPlugin_v8");
  p->tuner7 = dlsym(p->lib, "ncclTunerPlugin_v7");
  p->tuner6 = dlsym(p->lib, "ncclTunerPlugin_v6");
  p->tuner5 = dlsym(p->lib, "ncclTunerPlugin_v5");
  p->tuner4 = dlsym(p->lib, "ncclTunerPlugin_v4");
  p->tuner3 = dlsym(p->lib, "ncclTunerPlugin_v3");
  return 0;
}

/* ---- the handle exchange through the parent */

static void to_hex(const uint8_t* b, int n, char* out) {
  static const char* d = "0123456789abcdef";
  for (int i = 0; i < n; i++) {
    out[2 * i] = d[b[i] >> 4];
    out[2 * i + 1] = d[b[i] & 15];
  }
  out[2 * n] = '\0';
}

static int from_hex(const char* s, uint8_t* out, int n) {
  for (int i = 0; i < n; i++) {
    unsigned v;
    if (sscanf(s + 2 * i, "%2x", &v) != 1) return -1;
    out[i] = (uint8_t)v;
  }
  return s[2 * n] == '\0' || s[2 * n] == '\n' ? 0 : -1;
}

int exchange(const char* tag, const void* mine, void* peers, int len) {
  char* hex = malloc(2 * (size_t)len + 1);
  to_hex(mine, len, hex);
  printf("XCHG %s %s\n", tag, len ? hex : "-");
  fflush(stdout);
  free(hex);
  char* line = NULL;
  size_t cap = 0;
  ssize_t n = getline(&line, &cap, stdin);
  int rc = -1;
  if (n > 0) {
    char want[128];
    snprintf(want, sizeof(want), "XCHG %s ", tag);
    size_t wl = strlen(want);
    if (strncmp(line, want, wl) == 0) rc = len == 0 ? 0 : from_hex(line + wl, peers, len);
    else fprintf(stderr, "[%s] expected %s, got %s", driver_tag, want, line);
  } else {
    fprintf(stderr, "[%s] the parent closed the exchange at %s\n", driver_tag, tag);
  }
  free(line);
  return rc;
}

int barrier(const char* tag) { return exchange(tag, NULL, NULL, 0); }

static int usage(void) {
  fprintf(stderr,
          "usage: plugincheck-driver [-v] abi LIB\n"
          "       plugincheck-driver [-v] rank R LIB SUITE   (SUITE: p2p, gather, bench)\n"
          "       plugincheck-driver [-v] lifecycle LIB CYCLES [reopen]\n");
  return 2;
}

int main(int argc, char** argv) {
  /* The driver exercises the net and collNet tables, which offer NCCL a device only where
   * ROCE_GATHER_NET=1 (the library's default leaves NCCL on its own transports). */
  setenv("ROCE_GATHER_NET", "1", 0);
  int a = 1;
  if (a < argc && strcmp(argv[a], "-v") == 0) {
    driver_verbose = 1;
    a++;
  }
  if (a + 1 < argc && strcmp(argv[a], "abi") == 0) return run_abi(argv[a + 1]);
  if (a + 3 < argc && strcmp(argv[a], "rank") == 0) return run_rank(argv[a + 2], atoi(argv[a + 1]), argv[a + 3]);
  if (a + 2 < argc && strcmp(argv[a], "lifecycle") == 0)
    return run_lifecycle(argv[a + 1], atoi(argv[a + 2]), a + 3 < argc && strcmp(argv[a + 3], "reopen") == 0);
  return usage();
}
