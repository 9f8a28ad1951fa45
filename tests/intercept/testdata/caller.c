/* A NCCL application for the interceptor's tests: it calls NCCL's API by the steps named on
 * its command line and prints one JSON line a step (what it passed, what came back).
 *
 * Built as an executable linked with -lnccl, its own relocations call NCCL; built with
 * -DCALLER_LIBRARY as a shared library (exporting caller_step), the library's relocations
 * do. Built with -DCALLER_NO_NCCL the executable does not link NCCL at all and runs NCCL
 * steps only through a library it loads ("load:PATH", then "via:lib"). Built with
 * -DCALLER_LOOKS_UP it finds NCCL as XLA does: it opens CALLER_NCCL (a path) and takes each
 * function from that handle with dlsym at the function's first call.
 *
 * Usage: caller RANK IDFILE STEP...   (IDFILE: where rank 0 leaves each unique id)
 * Steps: init, initcfg:BLOCKING, init1, initcfg1:BLOCKING, initall, gather:COUNT:TYPE[:inplace],
 * prevgather:COUNT:TYPE and prevdestroy (on the communicator made before the current one),
 * group:COUNT:TYPE, groupstart, groupend, split:COLOR:KEY, asyncerr, allreduce:COUNT, finalize,
 * destroy, abort, abortafter:MS, destroyafter:MS and join (another thread aborts or destroys while the
 * next steps run), sleepms:MS, die (SIGKILL), stop (SIGSTOP), got (this object's ncclAllGather slot and its page), load:PATH, via:libN,
 * via:lib, via:main, snap:LABEL (a copy of the ROCE_GATHER_STATS file as it is now), next:NAME
 * (the object where dlsym(RTLD_NEXT, NAME) from this object finds NAME: the next one after it). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <errno.h>
#include <link.h>
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

#ifdef CALLER_LOOKS_UP
/* Each function from NCCL's handle at its first call, as XLA's trampolines take them. */
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

/* One gather of count elements of type t (in place: the send buffer is this rank's row). */
static void gather(caller_state* s, const char* step, ncclComm_t comm, size_t count, ncclDataType_t t, int in_place,
                   int grouped) {
  size_t bytes = count * type_size(t);
  int nranks = 2, rank = 0;
  if (ncclCommCount(comm, &nranks) != ncclSuccess || ncclCommUserRank(comm, &rank) != ncclSuccess) nranks = 0;
  unsigned char* recv = malloc((size_t)nranks * bytes + 1);
  unsigned char* send = in_place ? recv + (size_t)rank * bytes : malloc(bytes + 1);
  memset(recv, 0xee, (size_t)nranks * bytes + 1);
  for (size_t i = 0; i < bytes; i++) send[i] = pattern(rank, i);
  ncclResult_t gs = ncclSuccess, ge = ncclSuccess;
  const double t0 = now_ms();
  if (grouped) gs = ncclGroupStart();
  ncclResult_t r = ncclAllGather(send, recv, count, t, comm, STREAM);
  if (grouped) ge = ncclGroupEnd();
  const double took = now_ms() - t0;
  size_t bad = nranks == 0; /* a communicator NCCL did not know */
  for (int row = 0; row < nranks && r == ncclSuccess; row++)
    for (size_t i = 0; i < bytes; i++) bad += recv[(size_t)row * bytes + i] != pattern(row, i);
  /* A failed gather writes no row: every byte still holds the poison where the data differs from it. */
  int unwritten = 1;
  for (int row = 0; row < nranks; row++)
    for (size_t i = 0; i < bytes; i++)
      if (pattern(row, i) != 0xee && recv[(size_t)row * bytes + i] != 0xee) unwritten = 0;
  out(s, step, r,
      "\"sendbuff\":\"%p\",\"recvbuff\":\"%p\",\"sendcount\":%zu,\"datatype\":%d,\"comm\":\"%p\",\"stream\":\"%p\","
      "\"wrong_bytes\":%zu,\"group_start\":%d,\"group_end\":%d,\"rows_unwritten\":%d,\"ms\":%.1f",
      (void*)send, (void*)recv, count, (int)t, (void*)comm, (void*)STREAM, bad, gs, ge, unwritten, took);
  if (!in_place) free(send);
  free(recv);
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
    out(s, step, ncclGroupStart(), "%s", "");
    return 1;
  }
  if (strcmp(step, "groupend") == 0) {
    out(s, step, ncclGroupEnd(), "%s", "");
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

/* ---- where this object's call to ncclAllGather goes, and its page's protection */

typedef struct slot_query {
  uintptr_t self_base;
  uintptr_t slot;
} slot_query;

static int find_slot(struct dl_phdr_info* info, size_t size, void* arg) {
  (void)size;
  slot_query* q = arg;
  if (info->dlpi_addr != q->self_base) return 0;
  const ElfW(Dyn)* dyn = NULL;
  for (int i = 0; i < info->dlpi_phnum; i++)
    if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) dyn = (const ElfW(Dyn)*)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
  const ElfW(Sym)* sym = NULL;
  const char* str = NULL;
  const ElfW(Rela)* rel[2] = {NULL, NULL};
  size_t relsz[2] = {0, 0};
  for (; dyn && dyn->d_tag != DT_NULL; dyn++) {
    uintptr_t p = dyn->d_un.d_ptr;
    if (p < info->dlpi_addr) p += info->dlpi_addr;
    if (dyn->d_tag == DT_SYMTAB) sym = (const ElfW(Sym)*)p;
    if (dyn->d_tag == DT_STRTAB) str = (const char*)p;
    if (dyn->d_tag == DT_JMPREL) rel[0] = (const ElfW(Rela)*)p;
    if (dyn->d_tag == DT_PLTRELSZ) relsz[0] = dyn->d_un.d_val;
    if (dyn->d_tag == DT_RELA) rel[1] = (const ElfW(Rela)*)p;
    if (dyn->d_tag == DT_RELASZ) relsz[1] = dyn->d_un.d_val;
  }
  for (int k = 0; k < 2 && sym && str; k++)
    for (size_t i = 0; rel[k] && i < relsz[k] / sizeof(ElfW(Rela)); i++)
      if (ELF64_R_SYM(rel[k][i].r_info) != 0 && strcmp(str + sym[ELF64_R_SYM(rel[k][i].r_info)].st_name, "ncclAllGather") == 0)
        q->slot = info->dlpi_addr + rel[k][i].r_offset;
  return 1;
}

/* The protection of the mapping that holds addr, from /proc/self/maps; every mapping of the
 * object's file is listed too, so that a test sees that none of them changed. */
static void protections(uintptr_t addr, const char* file, char* prot, char* all, size_t allsize) {
  FILE* f = fopen("/proc/self/maps", "r");
  char line[4096];
  size_t n = 0;
  strcpy(prot, "?");
  all[0] = '\0';
  while (f && fgets(line, sizeof(line), f)) {
    unsigned long lo, hi;
    char p[8], path[4096] = "";
    if (sscanf(line, "%lx-%lx %7s %*s %*s %*s %4095s", &lo, &hi, p, path) < 3) continue;
    if (addr >= lo && addr < hi) strcpy(prot, p);
    if (strcmp(path, file) == 0 && n + 64 < allsize)
      n += (size_t)snprintf(all + n, allsize - n, "%s%lx-%lx %s", n ? "," : "", lo, hi, p);
  }
  if (f) fclose(f);
}

static int got_step(caller_state* s, const char* step) {
  if (strcmp(step, "got") != 0) return 0;
  Dl_info self;
  struct link_map* lm = NULL;
  dladdr1((void*)got_step, &self, (void**)&lm, RTLD_DL_LINKMAP);
  slot_query q = {lm->l_addr, 0};
  dl_iterate_phdr(find_slot, &q);
  char prot[8], all[2048], file[4096];
  ssize_t len = readlink("/proc/self/exe", file, sizeof(file) - 1);
  file[len > 0 ? len : 0] = '\0';
  char real[4096];
  const char* mine = lm->l_name[0] ? (realpath(lm->l_name, real) ? real : lm->l_name) : file;
  protections(q.slot, mine, prot, all, sizeof(all));
  uintptr_t value = q.slot ? *(uintptr_t*)q.slot : 0;
  Dl_info to;
  const char* target = value && dladdr((void*)value, &to) && to.dli_fname ? to.dli_fname : "";
  out(s, step, 0, "\"slot\":\"%p\",\"target\":\"%s\",\"page\":\"%s\",\"mappings\":\"%s\"", (void*)q.slot, target, prot,
      all);
  return 1;
}
#endif /* !CALLER_NO_NCCL */

#ifdef CALLER_LIBRARY
/* The executable runs NCCL steps through here after "via:lib". */
int caller_step(caller_state* s, const char* step) { return nccl_step(s, step) || got_step(s, step); }
#else

typedef int (*step_fn)(caller_state*, const char*);

/* Exported (-Wl,--export-dynamic-symbol): a library's constructor opens through here, that
 * is through this executable's own dlopen slot. */
__attribute__((visibility("default"))) void* caller_dlopen(const char* path) { return dlopen(path, RTLD_NOW | RTLD_LOCAL); }

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

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s RANK IDFILE STEP...\n", argv[0]);
    return 2;
  }
  caller_state s = {.rank = atoi(argv[1]), .idfile = argv[2]};
  step_fn libs[8] = {NULL};
  int nlibs = 0, via = -1; /* the library NCCL steps go through; -1: this executable */
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
    int known = 0;
    if (via >= 0) known = libs[via](&s, step);
#ifndef CALLER_NO_NCCL
    else known = nccl_step(&s, step) || got_step(&s, step);
#endif
    if (!known) {
      fprintf(stderr, "caller: unknown step %s\n", step);
      return 2;
    }
  }
  return 0;
}
#endif
