/* plugincheck-rank's main and its steps (rank.h). Usage:
 *
 *   plugincheck-rank RANK STEP...
 *
 * Steps:
 *   init                      a communicator of two ranks (the unique id through the parent);
 *                             the steps after it use it
 *   gather:COUNT:TYPE[:MODE]  ncclAllGather of COUNT elements of NCCL type TYPE a rank; MODE
 *                             inplace (the shard in its row) or misaligned (both buffers off
 *                             their alignment). The rows are filled with a pattern first; the
 *                             line says whether both rows came out exact, untouched, or wrong
 *   asyncerr                  ncclCommGetAsyncError
 *   barrier:TAG               waits for the peer's barrier of the same tag
 *   abortafter:MS, destroyafter:MS
 *                             another thread aborts or destroys the communicator after MS
 *                             while the next steps run; join waits for it and prints its line
 *   destroy                   ncclCommDestroy
 *   victim                    says so and waits to be killed
 *   exit:_exit, exit:sigterm  leaves at once without closing anything
 *   bench:FABRIC:TARGET       the fabric's floor, then the gather at every bench size (bench.c)
 *   load:SECONDS              two communicators on two threads (load.c)
 *
 * The first line names this process and the arena every gather's buffers come from, so that
 * the parent can tell the program's gathers in the stand-in's call record from the library's. */
#define _GNU_SOURCE
#include "rank.h"
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

rank_env R;

static pthread_mutex_t out_mu = PTHREAD_MUTEX_INITIALIZER;

void out_line(const char* step, const char* fields_fmt, ...) {
  char fields[2048] = "";
  if (fields_fmt != NULL) {
    va_list ap;
    va_start(ap, fields_fmt);
    vsnprintf(fields, sizeof(fields), fields_fmt, ap);
    va_end(ap);
  }
  pthread_mutex_lock(&out_mu);
  printf("{\"step\":\"%s\"%s%s}\n", step, fields[0] ? "," : "", fields);
  fflush(stdout);
  pthread_mutex_unlock(&out_mu);
}

/* ---- the exchange through the parent */

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
  pthread_mutex_lock(&out_mu);
  printf("XCHG %s %s\n", tag, len ? hex : "-");
  fflush(stdout);
  pthread_mutex_unlock(&out_mu);
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
    else fprintf(stderr, "[rank %d] expected %s, got %s", R.rank, want, line);
  } else {
    fprintf(stderr, "[rank %d] the parent closed the exchange at %s\n", R.rank, tag);
  }
  free(line);
  return rc;
}

int barrier(const char* tag) { return exchange(tag, NULL, NULL, 0); }

ncclResult_t make_comm(const char* tag, ncclComm_t* comm) {
  struct {
    int32_t result;
    ncclUniqueId id;
  } mine, peers;
  memset(&mine, 0, sizeof(mine));
  if (R.rank == 0) mine.result = ncclGetUniqueId(&mine.id);
  if (exchange(tag, &mine, &peers, sizeof(mine)) != 0) return ncclSystemError;
  if (R.rank == 1) mine = peers;
  if (mine.result != ncclSuccess) {
    fprintf(stderr, "[rank %d] rank 0's ncclGetUniqueId returned %d\n", R.rank, mine.result);
    return (ncclResult_t)mine.result;
  }
  return ncclCommInitRank(comm, 2, mine.id, R.rank);
}

/* ---- patterns */

void fill_pattern(uint8_t* b, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    memcpy(b + i, &x, 8);
  }
  x ^= x << 13, x ^= x >> 7, x ^= x << 17;
  for (; i < n; i++) b[i] = (uint8_t)(x >> (8 * (i & 7)));
}

long check_pattern(const uint8_t* b, size_t n, uint64_t seed) {
  uint8_t* want = malloc(n ? n : 1);
  fill_pattern(want, n, seed);
  long bad = -1;
  for (size_t i = 0; i < n; i++)
    if (b[i] != want[i]) {
      bad = (long)i;
      break;
    }
  free(want);
  return bad;
}

uint64_t shard_seed(uint64_t k, uint64_t n, int r) { return k << 40 | n << 1 | (uint64_t)r; }

/* ---- the steps */

/* What a step sees between calls: the communicator, its gathers so far, the buffers. */
static struct {
  ncclComm_t comm;
  int comms;         /* communicators made: keys the patterns */
  uint64_t gathers;  /* on the current communicator */
  uint8_t *send, *recv;
  size_t max_bytes;  /* a rank's largest gather the arena holds */
} S;

#define MISALIGN_SEND 3
#define MISALIGN_RECV 5

static double ms_since(uint64_t t0) { return (double)(now_ns() - t0) / 1e6; }

static int step_gather(const char* arg) {
  size_t count = 0;
  int type = -1, used = 0;
  char mode[16] = "";
  if (sscanf(arg, "%zu:%d%n", &count, &type, &used) != 2 || rg_nccl_type_bytes(type) == 0 ||
      (arg[used] != '\0' && (sscanf(arg + used, ":%15s", mode) != 1 ||
                             (strcmp(mode, "inplace") != 0 && strcmp(mode, "misaligned") != 0)))) {
    fprintf(stderr, "[rank %d] gather:%s: want gather:COUNT:TYPE[:inplace|:misaligned] with a NCCL type 0-11\n",
            R.rank, arg);
    return -1;
  }
  const size_t bytes = count * rg_nccl_type_bytes(type);
  if (bytes > S.max_bytes) {
    fprintf(stderr, "[rank %d] gather:%s: %zu bytes a rank is more than the arena's %zu\n", R.rank, arg, bytes,
            S.max_bytes);
    return -1;
  }
  const int inplace = strcmp(mode, "inplace") == 0, misaligned = strcmp(mode, "misaligned") == 0;
  uint8_t* recv = S.recv + (misaligned ? MISALIGN_RECV : 0);
  uint8_t* send = inplace ? recv + (size_t)R.rank * bytes : S.send + (misaligned ? MISALIGN_SEND : 0);
  const uint64_t n = ++S.gathers, key = (uint64_t)S.comms;
  const uint64_t before = shard_seed(key, n, 0) ^ 0xBEF0BEF0ull;
  /* The rows as they stand before the call, which a failed gather must leave. */
  uint8_t* kept = malloc(2 * bytes + 1);
  fill_pattern(recv, 2 * bytes, before);
  fill_pattern(send, bytes, shard_seed(key, n, R.rank));
  memcpy(kept, recv, 2 * bytes);
  uint64_t t0 = now_ns();
  ncclResult_t r = ncclAllGather(send, recv, count, (ncclDataType_t)type, S.comm, RANK_STREAM);
  double ms = ms_since(t0);
  long wrong0 = check_pattern(recv, bytes, shard_seed(key, n, 0));
  long wrong1 = check_pattern(recv + bytes, bytes, shard_seed(key, n, 1));
  const char* rows = "exact";
  long wrong_at = -1;
  if (wrong0 >= 0 || wrong1 >= 0) {
    rows = memcmp(recv, kept, 2 * bytes) == 0 ? "untouched" : "wrong";
    wrong_at = wrong0 >= 0 ? wrong0 : (long)bytes + wrong1;
  }
  free(kept);
  out_line("gather",
           "\"n\":%llu,\"count\":%zu,\"type\":%d,\"bytes\":%zu,\"inplace\":%d,\"misaligned\":%d,\"result\":%d,"
           "\"rows\":\"%s\",\"wrong_at\":%ld,\"ms\":%.3f,\"send\":\"%p\",\"recv\":\"%p\"",
           (unsigned long long)n, count, type, bytes, inplace, misaligned, (int)r, rows, wrong_at, ms, (void*)send,
           (void*)recv);
  return 0;
}

/* abortafter / destroyafter: the call another thread makes while the next steps run. */
static struct {
  pthread_t thread;
  int running, abort, delay_ms;
  ncclComm_t comm;
  ncclResult_t result;
  double ms;
} later;

static void* later_main(void* arg) {
  (void)arg;
  usleep((useconds_t)later.delay_ms * 1000);
  uint64_t t0 = now_ns();
  later.result = later.abort ? ncclCommAbort(later.comm) : ncclCommDestroy(later.comm);
  later.ms = ms_since(t0);
  return NULL;
}

static int step_later(int abort, const char* arg) {
  if (later.running || S.comm == NULL) {
    fprintf(stderr, "[rank %d] %s: %s\n", R.rank, abort ? "abortafter" : "destroyafter",
            later.running ? "one is running already" : "no communicator");
    return -1;
  }
  later.running = 1;
  later.abort = abort;
  later.delay_ms = atoi(arg);
  later.comm = S.comm;
  return pthread_create(&later.thread, NULL, later_main, NULL) == 0 ? 0 : -1;
}

static int step_join(void) {
  if (!later.running) {
    fprintf(stderr, "[rank %d] join: no abortafter or destroyafter runs\n", R.rank);
    return -1;
  }
  pthread_join(later.thread, NULL);
  later.running = 0;
  S.comm = NULL; /* gone: the steps after it must not use it */
  out_line(later.abort ? "abort" : "destroy", "\"result\":%d,\"ms\":%.3f,\"after_ms\":%d", (int)later.result, later.ms,
           later.delay_ms);
  return 0;
}

static int step_destroy(void) {
  if (S.comm == NULL) {
    fprintf(stderr, "[rank %d] destroy: no communicator\n", R.rank);
    return -1;
  }
  uint64_t t0 = now_ns();
  ncclResult_t r = ncclCommDestroy(S.comm);
  S.comm = NULL;
  out_line("destroy", "\"result\":%d,\"ms\":%.3f", (int)r, ms_since(t0));
  return 0;
}

static int step(const char* s) {
  const char* colon = strchr(s, ':');
  size_t nl = colon ? (size_t)(colon - s) : strlen(s);
  const char* arg = colon ? colon + 1 : "";
#define IS(name) (nl == strlen(name) && strncmp(s, name, nl) == 0)
  if (IS("init")) {
    char tag[32];
    snprintf(tag, sizeof(tag), "uid-%d", S.comms);
    uint64_t t0 = now_ns();
    ncclResult_t r = make_comm(tag, &S.comm);
    S.comms++;
    S.gathers = 0;
    out_line("init", "\"result\":%d,\"ms\":%.3f", (int)r, ms_since(t0));
    return r == ncclSuccess ? 0 : -1;
  }
  if ((IS("gather") || IS("bench")) && S.comm == NULL) {
    fprintf(stderr, "[rank %d] %s: no communicator (init first)\n", R.rank, s);
    return -1;
  }
  if (IS("gather")) return step_gather(arg);
  if (IS("asyncerr")) {
    ncclResult_t a = ncclSuccess;
    ncclResult_t r = S.comm ? ncclCommGetAsyncError(S.comm, &a) : ncclInvalidArgument;
    out_line("asyncerr", "\"result\":%d,\"async\":%d", (int)r, (int)a);
    return 0;
  }
  if (IS("barrier")) {
    int r = barrier(arg);
    out_line("barrier", "\"tag\":\"%s\",\"result\":%d", arg, r);
    return r;
  }
  if (IS("abortafter")) return step_later(1, arg);
  if (IS("destroyafter")) return step_later(0, arg);
  if (IS("join")) return step_join();
  if (IS("destroy")) return step_destroy();
  if (IS("victim")) {
    out_line("victim", NULL);
    alarm(120); /* a harness that forgot it: do not linger */
    for (;;) pause();
  }
  if (IS("exit")) {
    out_line("exit", "\"how\":\"%s\"", arg);
    if (strcmp(arg, "sigterm") == 0) raise(SIGTERM);
    _exit(0);
  }
  if (IS("bench")) return step_bench(S.comm, arg, S.send, S.recv);
  if (IS("load")) return step_load(atoi(arg));
#undef IS
  fprintf(stderr, "[rank %d] unknown step %s\n", R.rank, s);
  return -1;
}

/* The largest gather the steps make, bytes a rank. */
static size_t arena_bytes(int n, char** steps) {
  size_t most = 0;
  for (int i = 0; i < n; i++) {
    size_t count = 0, b = 0;
    int type = 0;
    if (sscanf(steps[i], "gather:%zu:%d", &count, &type) == 2) b = count * rg_nccl_type_bytes(type);
    if (strncmp(steps[i], "bench:", 6) == 0) b = bench_max_bytes();
    if (strncmp(steps[i], "load:", 5) == 0) b = load_max_bytes();
    if (b > most) most = b;
  }
  return most;
}

int main(int argc, char** argv) {
  if (argc < 2 || (strcmp(argv[1], "0") != 0 && strcmp(argv[1], "1") != 0)) {
    fprintf(stderr, "usage: plugincheck-rank RANK STEP...   (RANK 0 or 1; rank.c lists the steps)\n");
    return 2;
  }
  R.rank = atoi(argv[1]);
  S.max_bytes = arena_bytes(argc - 2, argv + 2);
  /* Never freed, so that no buffer of the library's can come from inside it. */
  size_t len = S.max_bytes + 64 + 2 * S.max_bytes + 64;
  uint8_t* arena = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (arena == MAP_FAILED) {
    perror("plugincheck-rank: mapping the arena");
    return 2;
  }
  S.send = arena;
  S.recv = arena + S.max_bytes + 64;
  out_line("start", "\"rank\":%d,\"pid\":%d,\"arena\":\"%p\",\"arena_end\":\"%p\"", R.rank, (int)getpid(),
           (void*)arena, (void*)(arena + len));
  for (int i = 2; i < argc; i++)
    if (step(argv[i]) != 0) {
      out_line("failed", "\"at\":\"%s\"", argv[i]);
      return 1;
    }
  out_line("end", NULL);
  return 0;
}
