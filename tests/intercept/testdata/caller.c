/* A NCCL application for the interceptor's tests: it calls NCCL's API by the steps named on
 * its command line and prints one JSON line a step (what it passed, what came back).
 *
 * Built as an executable linked with -lnccl, its own relocations call NCCL; built with
 * -DCALLER_LIBRARY as a shared library (exporting caller_step), the library's relocations
 * do. Built with -DCALLER_NO_NCCL the executable does not link NCCL at all and runs NCCL
 * steps only through a library it loads ("load:PATH", then "via:lib"). Built with
 * -DCALLER_LOOKS_UP it finds NCCL as XLA does: it opens CALLER_NCCL (a path) and takes each
 * function from that handle with dlsym at the function's first call. Built with
 * -DCALLER_UPFRONT it takes every function from that handle before its first step, in the
 * order of the serving engines' ctypes bindings (pynccl: ncclGetErrorString, ncclGetVersion,
 * ncclGetUniqueId, ncclCommInitRank, ncclAllReduce, ncclAllGather, ncclReduceScatter, ncclSend,
 * ncclRecv, ncclBroadcast, ncclCommDestroy, ncclGroupStart, ncclGroupEnd, then the rest).
 * Built with -DCALLER_STATIC it calls through function pointers in its own data, set by the
 * loader from NCCL's addresses when it starts (static initialisers).
 *
 * Usage: caller RANK IDFILE STEP...   (IDFILE: where rank 0 leaves each unique id)
 * Steps: init, initcfg:BLOCKING, init1, initcfg1:BLOCKING, initall, gather:COUNT:TYPE[:inplace],
 * (a gather inside an open groupstart is checked, and its line printed, at the groupend that
 * closes the group: NCCL runs it then),
 * prevgather:COUNT:TYPE and prevdestroy (on the communicator made before the current one),
 * group:COUNT:TYPE, groupstart, groupend, split:COLOR:KEY, asyncerr, allreduce:COUNT (int32 sums),
 * allreduce:COUNT:TYPE:OP:EXPECT[:inplace] (EXPECT "ref": the result must be op(x0, x1) as this
 * program computes it, for sum and max on int8, int32 and float32 and avg on float32; "xor":
 * the stand-in NCCL's answer to what it does not model, both buffers XORed), finalize,
 * destroy, abort, abortafter:MS, destroyafter:MS and join (another thread aborts or destroys while the
 * next steps run), sleepms:MS, die (SIGKILL), stop (SIGSTOP), entry (the first bytes of the NCCL's own
 * pncclAllGather, CALLER_NCCL, where a jump there goes, the library's ncclAllGather, and NCCL's
 * file's mappings), load:PATH, via:libN,
 * via:lib, via:main, snap:LABEL (a copy of the ROCE_GATHER_STATS file as it is now), next:NAME
 * (the object where dlsym(RTLD_NEXT, NAME) from this object finds NAME: the next one after it),
 * bg:STEP (STEP on a second thread that lives as long as the program; the main thread waits
 * for it, and group depths are per thread as NCCL's are), altstack (a signal stack of this
 * thread's own, as Python's faulthandler installs), dropaltstack (that stack taken away and
 * freed, as faulthandler does at interpreter shutdown), urgstorm:MS (another thread sends this
 * one SIGURG, Go's preemption signal, every 20 us for MS ms, while the next steps run). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "nccl/api.h"

/* What the executable keeps between steps. */
typedef struct caller_state {
  int rank;
  const char* idfile;
  int inits;       /* communicators made so far: names each id's file */
  ncclComm_t comm; /* the current communicator */
  ncclComm_t prev; /* the one before it (prevgather) */
} caller_state;

#ifndef CALLER_NO_NCCL
ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config);
ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist);
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream);

#if defined(CALLER_LOOKS_UP) || defined(CALLER_UPFRONT)
/* Each function from NCCL's handle at its first call, as XLA's trampolines take them
 * (CALLER_UPFRONT takes them all before the first step: resolve_upfront). */
static void* looked_up(void** cache, const char* name) {
  static void* nccl;
  if (*cache != NULL) return *cache;
  if (nccl == NULL && (nccl = dlopen(getenv("CALLER_NCCL"), RTLD_NOW | RTLD_LOCAL)) == NULL) {
    fprintf(stderr, "caller: CALLER_NCCL=%s: %s\n", getenv("CALLER_NCCL"), dlerror());
    exit(3);
  }
  if ((*cache = dlsym(nccl, name)) == NULL) {
    fprintf(stderr, "caller: %s: %s\n", name, dlerror());
    exit(3);
  }
  return *cache;
}
#define LOOKED_UP(f) ((__typeof__(&f))looked_up(&looked_up_##f, #f))
#define LOOKUP(f) static void* looked_up_##f;
LOOKUP(ncclGetUniqueId) LOOKUP(ncclCommInitRank) LOOKUP(ncclCommInitRankConfig) LOOKUP(ncclCommInitAll)
LOOKUP(ncclCommSplit) LOOKUP(ncclCommFinalize) LOOKUP(ncclCommDestroy) LOOKUP(ncclCommAbort)
LOOKUP(ncclCommGetAsyncError) LOOKUP(ncclCommCount) LOOKUP(ncclCommUserRank) LOOKUP(ncclGroupStart)
LOOKUP(ncclGroupEnd) LOOKUP(ncclAllGather) LOOKUP(ncclAllReduce)
#ifdef CALLER_UPFRONT
static void* looked_up_ncclGetErrorString;
static void* looked_up_ncclGetVersion;
static void* looked_up_ncclReduceScatter;
static void* looked_up_ncclSend;
static void* looked_up_ncclRecv;
static void* looked_up_ncclBroadcast;
/* pynccl's order, then what the steps use besides. */
static void resolve_upfront(void) {
  void** const order[] = {&looked_up_ncclGetErrorString, &looked_up_ncclGetVersion, &looked_up_ncclGetUniqueId,
                          &looked_up_ncclCommInitRank, &looked_up_ncclAllReduce, &looked_up_ncclAllGather,
                          &looked_up_ncclReduceScatter, &looked_up_ncclSend, &looked_up_ncclRecv,
                          &looked_up_ncclBroadcast, &looked_up_ncclCommDestroy, &looked_up_ncclGroupStart,
                          &looked_up_ncclGroupEnd, &looked_up_ncclCommInitRankConfig, &looked_up_ncclCommInitAll,
                          &looked_up_ncclCommSplit, &looked_up_ncclCommFinalize, &looked_up_ncclCommAbort,
                          &looked_up_ncclCommGetAsyncError, &looked_up_ncclCommCount, &looked_up_ncclCommUserRank};
  static const char* const names[] = {"ncclGetErrorString", "ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank",
                                      "ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclSend", "ncclRecv",
                                      "ncclBroadcast", "ncclCommDestroy", "ncclGroupStart", "ncclGroupEnd",
                                      "ncclCommInitRankConfig", "ncclCommInitAll", "ncclCommSplit", "ncclCommFinalize",
                                      "ncclCommAbort", "ncclCommGetAsyncError", "ncclCommCount", "ncclCommUserRank"};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) looked_up(order[i], names[i]);
}
#endif
#define ncclGetUniqueId(...) LOOKED_UP(ncclGetUniqueId)(__VA_ARGS__)
#define ncclCommInitRank(...) LOOKED_UP(ncclCommInitRank)(__VA_ARGS__)
#define ncclCommInitRankConfig(...) LOOKED_UP(ncclCommInitRankConfig)(__VA_ARGS__)
#define ncclCommInitAll(...) LOOKED_UP(ncclCommInitAll)(__VA_ARGS__)
#define ncclCommSplit(...) LOOKED_UP(ncclCommSplit)(__VA_ARGS__)
#define ncclCommFinalize(...) LOOKED_UP(ncclCommFinalize)(__VA_ARGS__)
#define ncclCommDestroy(...) LOOKED_UP(ncclCommDestroy)(__VA_ARGS__)
#define ncclCommAbort(...) LOOKED_UP(ncclCommAbort)(__VA_ARGS__)
#define ncclCommGetAsyncError(...) LOOKED_UP(ncclCommGetAsyncError)(__VA_ARGS__)
#define ncclCommCount(...) LOOKED_UP(ncclCommCount)(__VA_ARGS__)
#define ncclCommUserRank(...) LOOKED_UP(ncclCommUserRank)(__VA_ARGS__)
#define ncclGroupStart(...) LOOKED_UP(ncclGroupStart)(__VA_ARGS__)
#define ncclGroupEnd(...) LOOKED_UP(ncclGroupEnd)(__VA_ARGS__)
#define ncclAllGather(...) LOOKED_UP(ncclAllGather)(__VA_ARGS__)
#define ncclAllReduce(...) LOOKED_UP(ncclAllReduce)(__VA_ARGS__)
#endif

#ifdef CALLER_STATIC
/* Pointers in this program's data, set from NCCL's addresses by the loader at start (data
 * relocations); volatile, so that every call reads them. */
#define STATIC_POINTER(f) static __typeof__(&f) volatile static_##f = f;
STATIC_POINTER(ncclGetUniqueId) STATIC_POINTER(ncclCommInitRank) STATIC_POINTER(ncclCommInitRankConfig)
STATIC_POINTER(ncclCommInitAll) STATIC_POINTER(ncclCommSplit) STATIC_POINTER(ncclCommFinalize)
STATIC_POINTER(ncclCommDestroy) STATIC_POINTER(ncclCommAbort) STATIC_POINTER(ncclCommGetAsyncError)
STATIC_POINTER(ncclCommCount) STATIC_POINTER(ncclCommUserRank) STATIC_POINTER(ncclGroupStart)
STATIC_POINTER(ncclGroupEnd) STATIC_POINTER(ncclAllGather) STATIC_POINTER(ncclAllReduce)
#define ncclGetUniqueId(...) static_ncclGetUniqueId(__VA_ARGS__)
#define ncclCommInitRank(...) static_ncclCommInitRank(__VA_ARGS__)
#define ncclCommInitRankConfig(...) static_ncclCommInitRankConfig(__VA_ARGS__)
#define ncclCommInitAll(...) static_ncclCommInitAll(__VA_ARGS__)
#define ncclCommSplit(...) static_ncclCommSplit(__VA_ARGS__)
#define ncclCommFinalize(...) static_ncclCommFinalize(__VA_ARGS__)
#define ncclCommDestroy(...) static_ncclCommDestroy(__VA_ARGS__)
#define ncclCommAbort(...) static_ncclCommAbort(__VA_ARGS__)
#define ncclCommGetAsyncError(...) static_ncclCommGetAsyncError(__VA_ARGS__)
#define ncclCommCount(...) static_ncclCommCount(__VA_ARGS__)
#define ncclCommUserRank(...) static_ncclCommUserRank(__VA_ARGS__)
#define ncclGroupStart(...) static_ncclGroupStart(__VA_ARGS__)
#define ncclGroupEnd(...) static_ncclGroupEnd(__VA_ARGS__)
#define ncclAllGather(...) static_ncclAllGather(__VA_ARGS__)
#define ncclAllReduce(...) static_ncclAllReduce(__VA_ARGS__)
#endif

/* A stream value NCCL must receive as it was passed (the stand-in ignores it). */
#define STREAM ((cudaStream_t)(uintptr_t)0x5157)

static void out(const caller_state* s, const char* step, int result, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void out(const caller_state* s, const char* step, int result, const char* fmt, ...) {
  char args[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(args, sizeof(args), fmt, ap);
  va_end(ap);
  printf("{\"rank\":%d,\"pid\":%d,\"step\":\"%s\",\"result\":%d%s%s}\n", s->rank, (int)getpid(), step, result,
         args[0] ? "," : "", args);
  fflush(stdout);
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Rank 0 makes the id of the n-th communicator and leaves it in IDFILE.n; rank 1 reads it. */
static int unique_id(caller_state* s, ncclUniqueId* id) {
  char path[4096], tmp[4200];
  snprintf(path, sizeof(path), "%s.%d", s->idfile, s->inits);
  if (s->rank == 0) {
    ncclResult_t r = ncclGetUniqueId(id);
    if (r != ncclSuccess) return r;
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE* f = fopen(tmp, "w");
    if (f == NULL || fwrite(id, sizeof(*id), 1, f) != 1 || fclose(f) != 0 || rename(tmp, path) != 0) return -1;
    return 0;
  }
  for (int i = 0; i < 6000; i++) {
    FILE* f = fopen(path, "r");
    if (f != NULL) {
      size_t n = fread(id, sizeof(*id), 1, f);
      fclose(f);
      if (n == 1) return 0;
    }
    usleep(10000);
  }
  return -1;
}

static size_t type_size(ncclDataType_t t) {
  switch (t) {
  case ncclInt8: case ncclUint8: return 1;
  case ncclFloat16: case ncclBfloat16: return 2;
  case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
  default: return 8;
  }
}

/* The byte rank r holds at i. */
static unsigned char pattern(int r, size_t i) { return (unsigned char)(i * 7 + (size_t)r * 101 + (i >> 8)); }

/* A gather issued and not yet checked: inside a group, NCCL runs it at the group's end. */
typedef struct issued {
  const char* step;
  ncclComm_t comm;
  size_t count, bytes;
  ncclDataType_t t;
  int in_place, nranks, rank;
  unsigned char *send, *recv;
  ncclResult_t r, gs, ge;
  double t0;
} issued;

/* This thread's group depth as the program counts it (starts that succeeded, less ends), and
 * the gathers waiting for its groups to end. */
static __thread int depth;
static __thread issued waiting[64];
static __thread int nwaiting;

static void check(caller_state* s, issued* g) {
  const size_t bytes = g->bytes;
  const int nranks = g->nranks;
  size_t bad = nranks == 0; /* a communicator NCCL did not know */
  for (int row = 0; row < nranks && g->r == ncclSuccess; row++)
    for (size_t i = 0; i < bytes; i++) bad += g->recv[(size_t)row * bytes + i] != pattern(row, i);
  /* A failed gather writes no row: every byte still holds the poison where the data differs from it. */
  int unwritten = 1;
  for (int row = 0; row < nranks; row++)
    for (size_t i = 0; i < bytes; i++)
      if (pattern(row, i) != 0xee && g->recv[(size_t)row * bytes + i] != 0xee) unwritten = 0;
  out(s, g->step, g->r,
      "\"sendbuff\":\"%p\",\"recvbuff\":\"%p\",\"sendcount\":%zu,\"datatype\":%d,\"comm\":\"%p\",\"stream\":\"%p\","
      "\"wrong_bytes\":%zu,\"group_start\":%d,\"group_end\":%d,\"rows_unwritten\":%d,\"ms\":%.1f",
      (void*)g->send, (void*)g->recv, g->count, (int)g->t, (void*)g->comm, (void*)STREAM, bad, g->gs, g->ge, unwritten,
      now_ms() - g->t0);
  if (!g->in_place) free(g->send);
  free(g->recv);
}

/* One gather of count elements of type t (in place: the send buffer is this rank's row). */
static void gather(caller_state* s, const char* step, ncclComm_t comm, size_t count, ncclDataType_t t, int in_place,
                   int grouped) {
  issued g = {.step = step, .comm = comm, .count = count, .bytes = count * type_size(t), .t = t, .in_place = in_place,
              .nranks = 2};
  if (ncclCommCount(comm, &g.nranks) != ncclSuccess || ncclCommUserRank(comm, &g.rank) != ncclSuccess) g.nranks = 0;
  g.recv = malloc((size_t)g.nranks * g.bytes + 1);
  g.send = in_place ? g.recv + (size_t)g.rank * g.bytes : malloc(g.bytes + 1);
  memset(g.recv, 0xee, (size_t)g.nranks * g.bytes + 1);
  for (size_t i = 0; i < g.bytes; i++) g.send[i] = pattern(g.rank, i);
  g.t0 = now_ms();
  if (grouped && (g.gs = ncclGroupStart()) == ncclSuccess) depth++;
  g.r = ncclAllGather(g.send, g.recv, count, t, comm, STREAM);
  if (grouped) {
    g.ge = ncclGroupEnd();
    if (depth > 0) depth--;
  }
  if (depth > 0 && nwaiting < 64) waiting[nwaiting++] = g;
  else check(s, &g);
}

/* The end of this thread's outermost group: NCCL has run its gathers. */
static void group_closed(caller_state* s) {
  for (int i = 0; i < nwaiting; i++) check(s, &waiting[i]);
  nwaiting = 0;
}

/* abortafter:MS, destroyafter:MS: another thread aborts or destroys the communicator while
 * the next steps run (a gather waiting in the one-shot path); the step's line comes at the
 * next "join". */
typedef struct later {
  caller_state* s;
  ncclComm_t comm;
  int ms, destroy;
  ncclResult_t r;
  double took;
  pthread_t thread;
} later;
static later pending;

static void* later_main(void* arg) {
  later* l = arg;
  struct timespec ts = {l->ms / 1000, (long)(l->ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
  const double t0 = now_ms();
  l->r = l->destroy ? ncclCommDestroy(l->comm) : ncclCommAbort(l->comm);
  l->took = now_ms() - t0;
  return NULL;
}

/* altstack, dropaltstack, urgstorm:MS. */
static void* own_stack;
static pthread_t storm_target;
static double storm_until;

static void* storm_main(void* arg) {
  (void)arg;
  while (now_ms() < storm_until) {
    pthread_kill(storm_target, SIGURG);
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
  }
  return NULL;
}

static int signal_stack_step(caller_state* s, const char* step) {
  int a = 0;
  if (strcmp(step, "altstack") == 0) {
    const size_t n = 1 << 16;
    own_stack = malloc(n);
    stack_t st = {.ss_sp = own_stack, .ss_size = n, .ss_flags = 0};
    out(s, step, sigaltstack(&st, NULL), "\"bytes\":%zu", n);
    return 1;
  }
  if (strcmp(step, "dropaltstack") == 0) {
    stack_t off = {.ss_sp = NULL, .ss_size = 0, .ss_flags = SS_DISABLE};
    int r = sigaltstack(&off, NULL);
    free(own_stack);
    own_stack = NULL;
    out(s, step, r, "\"disabled\":true");
    return 1;
  }
  if (sscanf(step, "urgstorm:%d", &a) == 1) {
    pthread_t t;
    storm_target = pthread_self();
    storm_until = now_ms() + a;
    pthread_create(&t, NULL, storm_main, NULL);
    pthread_detach(t);
    out(s, "urgstorm", 0, "\"ms\":%d", a);
    return 1;
  }
  return 0;
}

/* Rank r's element i of an all-reduce operand: small integers, so that float sums are exact. */
static int ar_value(int rank, size_t i) { return (int)((i * 7 + (size_t)rank * 13) % 97) - 40; }

/* allreduce:COUNT:TYPE:OP:EXPECT[:inplace]: checks every element and prints how many differ. */
static void allreduce_step(caller_state* s, size_t count, int type, int op, const char* expect, int inplace) {
  const size_t esz = type == ncclInt32 || type == ncclFloat32 ? 4 : 1;
  unsigned char* in = malloc(count * esz + 8);
  unsigned char* res = inplace ? in : malloc(count * esz + 8);
  unsigned char* x[2] = {malloc(count * esz + 8), malloc(count * esz + 8)};
  for (int r = 0; r < 2; r++)
    for (size_t i = 0; i < count; i++) {
      const int v = ar_value(r, i);
      if (esz == 1) x[r][i] = (unsigned char)(signed char)(v * 3);
      else if (type == ncclInt32) ((int32_t*)x[r])[i] = v * 100000;
      else ((float*)x[r])[i] = (float)v;
    }
  memcpy(in, x[s->rank], count * esz);
  ncclResult_t r = ncclAllReduce(in, res, count, (ncclDataType_t)type, (ncclRedOp_t)op, s->comm, STREAM);
  size_t bad = 0;
  for (size_t i = 0; i < count && r == ncclSuccess; i++) {
    if (strcmp(expect, "xor") == 0) {
      for (size_t k = 0; k < esz; k++) bad += res[i * esz + k] != (x[0][i * esz + k] ^ x[1][i * esz + k]);
      continue;
    }
    if (esz == 1) {
      const signed char p = (signed char)x[0][i], q = (signed char)x[1][i];
      const signed char want = op == ncclMax ? (p > q ? p : q) : (signed char)(unsigned char)((unsigned)p + (unsigned)q);
      bad += (signed char)res[i] != want;
    } else if (type == ncclInt32) {
      const int32_t p = ((int32_t*)x[0])[i], q = ((int32_t*)x[1])[i];
      bad += ((int32_t*)res)[i] != (op == ncclMax ? (p > q ? p : q) : p + q);
    } else {
      const float p = ((float*)x[0])[i], q = ((float*)x[1])[i];
      const float want = op == ncclMax ? (p > q ? p : q) : op == ncclAvg ? p * 0.5f + q * 0.5f : p + q;
      bad += ((float*)res)[i] != want;
    }
  }
  out(s, "allreduce", r, "\"sendbuff\":\"%p\",\"recvbuff\":\"%p\",\"count\":%zu,\"datatype\":%d,\"op\":%d,\"wrong\":%zu",
      (void*)in, (void*)res, count, type, op, bad);
  free(x[0]);
  free(x[1]);
  if (!inplace) free(res);
  free(in);
}

/* Runs one NCCL step; returns 1 if it knew the step. */
static int nccl_step(caller_state* s, const char* step) {
  size_t count = 0;
  int a = 0, b = 0;
  char kind[16] = "";
  /* init, initcfg:BLOCKING: a communicator of the two ranks; init1, initcfg1:BLOCKING: of this rank alone. */
  int alone = strcmp(step, "init1") == 0 || sscanf(step, "initcfg1:%d", &a) == 1;
  if (alone || strcmp(step, "init") == 0 || sscanf(step, "initcfg:%d", &a) == 1) {
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    int nranks = alone ? 1 : 2, rank = alone ? 0 : s->rank;
    int r = alone ? 0 : unique_id(s, &id);
    if (!alone) s->inits++;
    s->prev = s->comm;
    ncclComm_t* where = &s->comm;
    if (r == 0 && strncmp(step, "initcfg", 7) != 0) {
      r = ncclCommInitRank(where, nranks, id, rank);
      out(s, "init", r, "\"comm\":\"%p\",\"nranks\":%d,\"rank\":%d,\"made\":\"%p\"", (void*)where, nranks, rank,
          (void*)s->comm);
    } else if (r == 0) {
      ncclConfig_t cfg = {sizeof(ncclConfig_t), NCCL_API_MAGIC, 22809, a};
      r = ncclCommInitRankConfig(where, nranks, id, rank, &cfg);
      out(s, "initcfg", r,
          "\"comm\":\"%p\",\"nranks\":%d,\"rank\":%d,\"config\":\"%p\",\"blocking\":%d,\"made\":\"%p\"",
          (void*)where, nranks, rank, (void*)&cfg, a, (void*)s->comm);
    } else {
      out(s, step, r, "\"error\":\"no unique id\"");
    }
    return 1;
  }
  if (strcmp(step, "initall") == 0) {
    ncclComm_t comms[1] = {NULL};
    int devs[1] = {0};
    ncclResult_t r = ncclCommInitAll(comms, 1, devs);
    out(s, step, r, "\"comms\":\"%p\",\"ndev\":1,\"devlist\":\"%p\",\"made\":\"%p\"", (void*)comms, (void*)devs,
        (void*)comms[0]);
    if (r == ncclSuccess) {
      r = ncclCommDestroy(comms[0]);
      out(s, "destroy", r, "\"comm\":\"%p\"", (void*)comms[0]);
    }
    return 1;
  }
  if (sscanf(step, "gather:%zu:%d:%15s", &count, &a, kind) >= 2) {
    gather(s, "gather", s->comm, count, (ncclDataType_t)a, strcmp(kind, "inplace") == 0, 0);
    return 1;
  }
  if (sscanf(step, "prevgather:%zu:%d", &count, &a) == 2) {
    gather(s, "gather", s->prev, count, (ncclDataType_t)a, 0, 0);
    return 1;
  }
  if (sscanf(step, "group:%zu:%d", &count, &a) == 2) {
    gather(s, "group", s->comm, count, (ncclDataType_t)a, 0, 1);
    return 1;
  }
  if (strcmp(step, "groupstart") == 0) {
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess) depth++;
    out(s, step, r, "%s", "");
    return 1;
  }
  if (strcmp(step, "groupend") == 0) {
    ncclResult_t r = ncclGroupEnd();
    if (depth > 0 && --depth == 0) group_closed(s);
    out(s, step, r, "%s", "");
    return 1;
  }
  if (sscanf(step, "split:%d:%d", &a, &b) == 2) {
    ncclComm_t child = NULL;
    ncclResult_t r = ncclCommSplit(s->comm, a, b, &child, NULL);
    out(s, "split", r, "\"comm\":\"%p\",\"color\":%d,\"key\":%d,\"newcomm\":\"%p\",\"config\":\"%p\",\"made\":\"%p\"",
        (void*)s->comm, a, b, (void*)&child, (void*)NULL, (void*)child);
    if (r == ncclSuccess && child != NULL) {
      gather(s, "gather", child, 1000, ncclInt32, 0, 0);
      r = ncclCommDestroy(child);
      out(s, "destroy", r, "\"comm\":\"%p\"", (void*)child);
    }
    return 1;
  }
  if (strcmp(step, "asyncerr") == 0) {
    ncclResult_t e = (ncclResult_t)-1;
    ncclResult_t r = ncclCommGetAsyncError(s->comm, &e);
    out(s, step, r, "\"comm\":\"%p\",\"asyncError\":\"%p\",\"reported\":%d", (void*)s->comm, (void*)&e, (int)e);
    return 1;
  }
  char expect[8] = "";
  if (sscanf(step, "allreduce:%zu:%d:%d:%7[a-z]:%15s", &count, &a, &b, expect, kind) >= 4) {
    allreduce_step(s, count, a, b, expect, strcmp(kind, "inplace") == 0);
    return 1;
  }
  if (sscanf(step, "allreduce:%zu", &count) == 1) {
    int32_t* in = malloc(count * 4 + 4);
    int32_t* res = malloc(count * 4 + 4);
    for (size_t i = 0; i < count; i++) in[i] = (int32_t)(i * 3 + (size_t)s->rank);
    ncclResult_t r = ncclAllReduce(in, res, count, ncclInt32, ncclSum, s->comm, STREAM);
    size_t bad = 0;
    for (size_t i = 0; i < count && r == ncclSuccess; i++) bad += res[i] != (int32_t)(i * 6 + 1);
    out(s, "allreduce", r, "\"sendbuff\":\"%p\",\"recvbuff\":\"%p\",\"count\":%zu,\"wrong\":%zu", (void*)in, (void*)res,
        count, bad);
    free(in);
    free(res);
    return 1;
  }
  if (strcmp(step, "finalize") == 0) {
    out(s, step, ncclCommFinalize(s->comm), "\"comm\":\"%p\"", (void*)s->comm);
    return 1;
  }
  if (sscanf(step, "abortafter:%d", &a) == 1 || sscanf(step, "destroyafter:%d", &a) == 1) {
    pending = (later){.s = s, .comm = s->comm, .ms = a, .destroy = step[0] == 'd'};
    pthread_create(&pending.thread, NULL, later_main, &pending);
    return 1;
  }
  if (strcmp(step, "join") == 0) {
    pthread_join(pending.thread, NULL);
    out(s, pending.destroy ? "destroy" : "abort", pending.r, "\"comm\":\"%p\",\"ms\":%.1f", (void*)pending.comm,
        pending.took);
    s->comm = NULL;
    return 1;
  }
  if (sscanf(step, "sleepms:%d", &a) == 1) {
    struct timespec ts = {a / 1000, (long)(a % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    return 1;
  }
  if (strncmp(step, "next:", 5) == 0) {
    void* f = dlsym(RTLD_NEXT, step + 5);
    Dl_info info;
    const char* where = f != NULL && dladdr(f, &info) != 0 && info.dli_fname != NULL ? info.dli_fname : "";
    out(s, "next", 0, "\"name\":\"%s\",\"found_in\":\"%s\"", step + 5, where);
    return 1;
  }
  if (strcmp(step, "die") == 0) raise(SIGKILL);
  if (strcmp(step, "stop") == 0) raise(SIGSTOP); /* silent as a cut link: the test kills it */
  if (strcmp(step, "prevdestroy") == 0) {
    out(s, "destroy", ncclCommDestroy(s->prev), "\"comm\":\"%p\"", (void*)s->prev);
    s->prev = NULL;
    return 1;
  }
  if (strcmp(step, "destroy") == 0 || strcmp(step, "abort") == 0) {
    ncclResult_t r = step[0] == 'd' ? ncclCommDestroy(s->comm) : ncclCommAbort(s->comm);
    out(s, step, r, "\"comm\":\"%p\"", (void*)s->comm);
    s->comm = NULL;
    return 1;
  }
  return 0;
}

/* ---- NCCL's ncclAllGather entry and the protection of NCCL's pages */

/* Every mapping of file, from /proc/self/maps ("lo-hi perms,..."), anonymous ones excluded. */
static void mappings(const char* file, char* all, size_t allsize) {
  FILE* f = fopen("/proc/self/maps", "r");
  char line[4096];
  size_t n = 0;
  all[0] = '\0';
  while (f && fgets(line, sizeof(line), f)) {
    unsigned long lo, hi;
    char p[8], path[4096] = "";
    if (sscanf(line, "%lx-%lx %7s %*s %*s %*s %4095s", &lo, &hi, p, path) < 3) continue;
    if (strcmp(path, file) == 0 && n + 64 < allsize)
      n += (size_t)snprintf(all + n, allsize - n, "%s%lx-%lx %s", n ? "," : "", lo, hi, p);
  }
  if (f) fclose(f);
}

/* Where a jump at the start of entry f goes, NULL when it starts with none: x86-64's jmp rel32
 * after an endbr64, aarch64's b after a bti and a return-address signing (as the hook writes
 * them; the test checks the encoding, this only says where to look next). */
static const unsigned char* jump_target(const unsigned char* f) {
#if defined(__x86_64__)
  if (memcmp(f, "\xf3\x0f\x1e\xfa", 4) == 0) f += 4;
  if (f[0] != 0xe9) return NULL;
  int32_t rel;
  memcpy(&rel, f + 1, 4);
  return f + 5 + rel;
#elif defined(__aarch64__)
  uint32_t w;
  memcpy(&w, f, 4);
  if (w == 0xd503245fu || w == 0xd503249fu || w == 0xd50324dfu) { /* bti c, j, jc */
    f += 4;
    memcpy(&w, f, 4);
  }
  if (w == 0xd503233fu || w == 0xd503237fu) { /* paciasp, pacibsp */
    f += 4;
    memcpy(&w, f, 4);
  }
  if (w >> 26 != 0x05) return NULL;
  return f + (intptr_t)((int32_t)(w << 6) >> 6) * 4; /* imm26 words, signed */
#else
  (void)f;
  return NULL;
#endif
}

static void hex_of(const unsigned char* p, int n, char* dst, size_t size) {
  dst[0] = '\0';
  for (int i = 0; p != NULL && i < n && 2 * (size_t)i + 2 < size; i++) snprintf(dst + 2 * i, size - 2 * (size_t)i, "%02x", p[i]);
}

/* entry: the first 16 bytes of the NCCL's own pncclAllGather (CALLER_NCCL) and its address,
 * where a jump there goes and the first 24 bytes at that place, the address of the library's
 * ncclAllGather (NCCL_NET_PLUGIN, once loaded; 0 before), and every mapping of NCCL's file. */
static int entry_step(caller_state* s, const char* step) {
  if (strcmp(step, "entry") != 0) return 0;
  void* h = dlopen(getenv("CALLER_NCCL"), RTLD_NOLOAD | RTLD_LAZY);
  const unsigned char* f = h ? dlsym(h, "pncclAllGather") : NULL;
  const unsigned char* to = f ? jump_target(f) : NULL;
  const char* plugin = getenv("NCCL_NET_PLUGIN");
  void* lib = plugin ? dlopen(plugin, RTLD_NOLOAD | RTLD_LAZY) : NULL;
  void* wrapper = lib ? dlsym(lib, "ncclAllGather") : NULL;
  char bytes[64], there[64], all[4096] = "", real[4096] = "";
  Dl_info info;
  if (f != NULL && dladdr(f, &info) != 0 && realpath(info.dli_fname, real) != NULL) mappings(real, all, sizeof(all));
  hex_of(f, 16, bytes, sizeof(bytes));
  hex_of(to, 24, there, sizeof(there));
  out(s, step, f ? 0 : 1,
      "\"bytes\":\"%s\",\"at\":\"%lx\",\"jumps_to\":\"%lx\",\"there\":\"%s\",\"wrapper\":\"%lx\",\"file\":\"%s\","
      "\"mappings\":\"%s\"",
      bytes, (unsigned long)(uintptr_t)f, (unsigned long)(uintptr_t)to, there, (unsigned long)(uintptr_t)wrapper, real, all);
  if (lib) dlclose(lib);
  if (h) dlclose(h);
  return 1;
}
#endif /* !CALLER_NO_NCCL */

#ifdef CALLER_LIBRARY
/* The executable runs NCCL steps through here after "via:lib". */
int caller_step(caller_state* s, const char* step) {
  return nccl_step(s, step) || entry_step(s, step) || signal_stack_step(s, step);
}
#else

typedef int (*step_fn)(caller_state*, const char*);

/* Copies the ROCE_GATHER_STATS file as it is now to that path + "." + label. */
static void snapshot_stats(const char* label) {
  const char* path = getenv("ROCE_GATHER_STATS");
  char to[4200], buf[65536];
  snprintf(to, sizeof(to), "%s.%s", path ? path : "", label);
  FILE* in = path ? fopen(path, "r") : NULL;
  FILE* dst = fopen(to, "w");
  size_t n = in && dst ? fread(buf, 1, sizeof(buf), in) : 0;
  if (dst) fwrite(buf, 1, n, dst);
  if (in) fclose(in);
  if (dst) fclose(dst);
}

static step_fn libs[8];
static int nlibs, via = -1; /* the library NCCL steps go through; -1: this executable */

static int run_step(caller_state* s, const char* step) {
  if (via >= 0) return libs[via](s, step);
#ifndef CALLER_NO_NCCL
  return nccl_step(s, step) || entry_step(s, step) || signal_stack_step(s, step);
#else
  return 0;
#endif
}

/* bg:STEP: one more thread, alive from its first step on, runs the step while main waits. */
static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pthread_t thread;
  int started, busy, known;
  caller_state* s;
  const char* step;
} bg = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void* bg_main(void* arg) {
  (void)arg;
  pthread_mutex_lock(&bg.mu);
  for (;;) {
    while (!bg.busy) pthread_cond_wait(&bg.cv, &bg.mu);
    pthread_mutex_unlock(&bg.mu);
    int known = run_step(bg.s, bg.step);
    pthread_mutex_lock(&bg.mu);
    bg.known = known;
    bg.busy = 0;
    pthread_cond_broadcast(&bg.cv);
  }
  return NULL;
}

static int run_on_bg(caller_state* s, const char* step) {
  pthread_mutex_lock(&bg.mu);
  if (!bg.started) {
    bg.started = 1;
    pthread_create(&bg.thread, NULL, bg_main, NULL);
  }
  bg.s = s, bg.step = step, bg.busy = 1;
  pthread_cond_broadcast(&bg.cv);
  while (bg.busy) pthread_cond_wait(&bg.cv, &bg.mu);
  int known = bg.known;
  pthread_mutex_unlock(&bg.mu);
  return known;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s RANK IDFILE STEP...\n", argv[0]);
    return 2;
  }
  caller_state s = {.rank = atoi(argv[1]), .idfile = argv[2]};
#ifdef CALLER_UPFRONT
  resolve_upfront();
#endif
  for (int i = 3; i < argc; i++) {
    const char* step = argv[i];
    /* load:PATH opens a caller library; via:libN runs the NCCL steps after it through the
     * N-th one loaded, via:lib through the last, via:main through this executable. */
    if (strncmp(step, "load:", 5) == 0) {
      void* h = dlopen(step + 5, RTLD_NOW | RTLD_LOCAL);
      step_fn f = h ? (step_fn)dlsym(h, "caller_step") : NULL;
      printf("{\"rank\":%d,\"step\":\"load\",\"result\":%d,\"error\":\"%s\"}\n", s.rank, f ? 0 : 1,
             h ? "" : dlerror());
      fflush(stdout);
      if (f == NULL || nlibs == 8) return 1;
      libs[nlibs++] = f;
      continue;
    }
    if (strncmp(step, "via:", 4) == 0) {
      via = strcmp(step + 4, "main") == 0 ? -1 : strcmp(step + 4, "lib") == 0 ? nlibs - 1 : atoi(step + 7);
      if (via >= nlibs) {
        fprintf(stderr, "caller: %s: only %d libraries loaded\n", step, nlibs);
        return 2;
      }
      continue;
    }
    if (strncmp(step, "snap:", 5) == 0) {
      snapshot_stats(step + 5);
      continue;
    }
    int known = strncmp(step, "bg:", 3) == 0 ? run_on_bg(&s, step + 3) : run_step(&s, step);
    if (!known) {
      fprintf(stderr, "caller: unknown step %s\n", step);
      return 2;
    }
  }
  return 0;
}
#endif
