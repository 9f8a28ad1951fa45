/* A stand-in libnccl.so.2 for testing the version matrix's scripts on a machine without a
 * GPU or NCCL: two ranks exchange through a shared file, and the net plugin is loaded and
 * initialised as the NCCL release FAKE_VERSION (e.g. 22809) would: the net table it looks up
 * first, init once per process (net v8-v10) or per communicator with finalize (v11, v12), and
 * its unload after the last communicator (2.27 to 2.29 forget the plugin's name unless
 * NCCL_NET_PLUGIN_REF_COUNT > 0); a plugin not found leaves NCCL's internal network, or fails
 * the communicator when NCCL_NET names one; NCCL_NET_PLUGIN=none (2.28 on) loads no plugin.
 * Each API function is a strong pncclX with a weak ncclX at the same address, as in NCCL, so
 * that the library's interceptor finds what it forwards to. Nothing here is NCCL's code: it
 * models only what the scripts read (docs/compatibility.md has the facts). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include "nccl/net.h"

#ifndef FAKE_VERSION
#error "build with -DFAKE_VERSION=22809 (major*10000 + minor*100 + patch)"
#endif
#define MINOR (FAKE_VERSION / 100 % 100)
#define SLOT (40u << 20)
#define MAX_OPS 64

typedef struct {
  char path[120];
  char pad[8];
} fake_id; /* 128 bytes, like ncclUniqueId */

typedef struct {
  volatile int pid[2];
  volatile unsigned long long arrive[2];
  size_t seg[2][MAX_OPS];
  int nseg[2];
} shared_hdr;

struct fake_comm {
  int rank;
  shared_hdr* h;
  char* data;
  unsigned long long seq;
  int error;
  void* netctx;
};

typedef struct fake_comm* comm_t;

static int debug_level(void) {
  const char* d = getenv("NCCL_DEBUG");
  if (d && strcasecmp(d, "INFO") == 0) return NCCL_LOG_INFO;
  if (d && strcasecmp(d, "WARN") == 0) return NCCL_LOG_WARN;
  return NCCL_LOG_NONE;
}

static void logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)flags;
  (void)file;
  (void)line;
  if ((int)level > debug_level() || level == NCCL_LOG_NONE) return;
  char host[64] = "host";
  gethostname(host, sizeof(host) - 1);
  printf("%s:%d:%ld [0] NCCL %s ", host, getpid(), (long)syscall(SYS_gettid), level == NCCL_LOG_WARN ? "WARN" : "INFO");
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  printf("\n");
  fflush(stdout);
}

/* ---- the plugin, as this release loads it ---- */
static int net_abi(void) { return MINOR >= 30 ? 12 : MINOR >= 28 ? 11 : MINOR >= 26 ? 10 : MINOR >= 24 ? 9 : 8; }
static char plugin_name[256];
static int name_read, live_comms;
static void* plugin;
static void* net; /* the net table of version net_abi() */
static int process_init_done;

static long refcount_param(void) {
  const char* v = getenv("NCCL_NET_PLUGIN_REF_COUNT");
  long def = (MINOR == 26 || MINOR == 27) ? 1 : 0;
  return v && *v ? strtol(v, NULL, 0) : def;
}

static int internal_net; /* NCCL_NET_PLUGIN=none (2.28 and later): NCCL's own transports, no plugin */

static int load_plugin(void) {
  if (plugin || internal_net) return 0;
  if (!name_read) {
    const char* e = getenv("NCCL_NET_PLUGIN");
    snprintf(plugin_name, sizeof(plugin_name), "%s", e ? e : "");
    name_read = 1;
  }
  if (MINOR >= 28 && strcasecmp(plugin_name, "none") == 0) {
    internal_net = 1;
    logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "NET/Plugin: NCCL_NET_PLUGIN=none: internal network only");
    return 0;
  }
  char lib[300];
  if (plugin_name[0] == 0)
    snprintf(lib, sizeof(lib), "libnccl-net.so");
  else if (strchr(plugin_name, '/'))
    snprintf(lib, sizeof(lib), "%s", plugin_name);
  else
    snprintf(lib, sizeof(lib), "libnccl-net-%s.so", plugin_name);
  plugin = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (!plugin) {
    logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "NET/Plugin: Could not find: %s", lib);
    return -1;
  }
  char sym[64];
  snprintf(sym, sizeof(sym), "ncclNetPlugin_v%d", net_abi());
  net = dlsym(plugin, sym);
  if (!net) return -1;
  if (MINOR >= 26) /* 2.26 on, the table's own loader (src/plugin/net/net_vN.cc) names its version */
    logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "NET/Plugin: Loaded net plugin %s (v%d)", *(const char**)net,
           net_abi());
  logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "Successfully loaded external network plugin %s", lib);
  return 0;
}

static int init_plugin(comm_t c, unsigned long long commId) {
  if (load_plugin() != 0) {
    const char* want = getenv("NCCL_NET");
    if (want && *want) {
      logger(NCCL_LOG_WARN, NCCL_INIT, __FILE__, __LINE__, "Failed to initialize any NET plugin");
      return ncclInvalidUsage;
    }
    logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "NET/Plugin: no plugin found: using the internal network");
    internal_net = 1;
  }
  if (internal_net) {
    live_comms++;
    return ncclSuccess;
  }
  int abi = net_abi();
  ncclNetCommConfig_v12_t cfg = {.trafficClass = -1};
  ncclResult_t r = ncclSuccess;
  if (abi >= 11) {
    r = abi == 12 ? ((ncclNet_v12_t*)net)->init(&c->netctx, commId, &cfg, logger, NULL)
                  : ((ncclNet_v11_t*)net)->init(&c->netctx, commId, &cfg, logger, NULL);
  } else if (!process_init_done) {
    r = abi == 10 ? ((ncclNet_v10_t*)net)->init(logger, NULL)
                  : abi == 9 ? ((ncclNet_v9_t*)net)->init(logger) : ((ncclNet_v8_t*)net)->init(logger);
    process_init_done = r == ncclSuccess;
  }
  if (r != ncclSuccess) {
    logger(NCCL_LOG_WARN, NCCL_INIT, __FILE__, __LINE__, "Failed to initialize any NET plugin");
    return ncclInvalidUsage;
  }
  logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "Initialized NET plugin %s", *(const char**)net);
  live_comms++;
  return ncclSuccess;
}

static void finalize_plugin(comm_t c) {
  if (internal_net) {
    live_comms--;
    internal_net = 0; /* the next communicator looks for the plugin again */
    return;
  }
  int abi = net_abi();
  if (abi == 12)
    ((ncclNet_v12_t*)net)->finalize(c->netctx);
  else if (abi == 11)
    ((ncclNet_v11_t*)net)->finalize(c->netctx);
  if (--live_comms > 0 || MINOR < 27) return;
  if (refcount_param() > 0) return; /* the count never reaches zero: never unloaded */
  logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "Unloading plugin %s", plugin_name);
  dlclose(plugin);
  plugin = NULL;
  process_init_done = 0;
  if (MINOR <= 29) plugin_name[0] = 0; /* 2.27-2.29 clear the entry, name included */
}

/* ---- two ranks through a shared file ---- */

/* NCCL's layout: the strong pncclX, and ncclX a weak alias at its address. */
#define NCCL_NAME(f) __typeof__(p##f) f __attribute__((weak, alias("p" #f)));
static int peer_alive(comm_t c) {
  int p = c->h->pid[1 - c->rank];
  return p == 0 || kill(p, 0) == 0 || errno != ESRCH;
}

static int barrier(comm_t c) {
  unsigned long long s = ++c->seq;
  __atomic_store_n(&c->h->arrive[c->rank], s, __ATOMIC_RELEASE);
  for (long i = 0; __atomic_load_n(&c->h->arrive[1 - c->rank], __ATOMIC_ACQUIRE) < s; i++) {
    if (i % 1000 == 0 && !peer_alive(c)) {
      c->error = ncclRemoteError;
      logger(NCCL_LOG_WARN, NCCL_NET, __FILE__, __LINE__, "peer %d is gone", 1 - c->rank);
      return ncclRemoteError;
    }
    usleep(20);
  }
  return ncclSuccess;
}

int pncclGetVersion(int* v) {
  *v = FAKE_VERSION;
  return ncclSuccess;
}

const char* pncclGetErrorString(int r) {
  static const char* s[] = {"no error", "unhandled cuda error", "unhandled system error", "internal error",
                            "invalid argument", "invalid usage", "remote process exited or there was a network error",
                            "NCCL operation in progress"};
  return r >= 0 && r < 8 ? s[r] : "unknown result code";
}

int pncclGetUniqueId(fake_id* id) {
  memset(id, 0, sizeof(*id));
  const char* tmp = getenv("TMPDIR");
  snprintf(id->path, sizeof(id->path), "%s/fake-nccl.XXXXXX", tmp && *tmp ? tmp : "/tmp");
  int fd = mkstemp(id->path);
  if (fd < 0) return ncclSystemError;
  close(fd);
  return ncclSuccess;
}

int pncclCommInitRank(comm_t* out, int nranks, fake_id id, int rank) {
  if (nranks != 2 || rank < 0 || rank > 1) return ncclInvalidArgument;
  comm_t c = calloc(1, sizeof(*c));
  c->rank = rank;
  static unsigned long long comms;
  int r = init_plugin(c, 0x1000 + ++comms);
  if (r != ncclSuccess) {
    free(c);
    return r;
  }
  int fd = open(id.path, O_RDWR);
  size_t bytes = sizeof(shared_hdr) + 2 * (size_t)SLOT;
  if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) return ncclSystemError;
  c->h = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (c->h == MAP_FAILED) return ncclSystemError;
  c->data = (char*)(c->h + 1);
  c->h->pid[rank] = getpid();
  if (barrier(c) != ncclSuccess) return ncclRemoteError;
  *out = c;
  return ncclSuccess;
}

int pncclAllGather(const void* send, void* recv, size_t n, int type, comm_t c, void* stream) {
  (void)type;
  (void)stream;
  if (c->error) return c->error;
  memmove(c->data + (size_t)c->rank * SLOT, send, n);
  if (barrier(c) != ncclSuccess) return ncclRemoteError;
  memmove((char*)recv + (size_t)c->rank * n, c->data + (size_t)c->rank * SLOT, n);
  memcpy((char*)recv + (size_t)(1 - c->rank) * n, c->data + (size_t)(1 - c->rank) * SLOT, n);
  return barrier(c) != ncclSuccess ? ncclRemoteError : ncclSuccess;
}

/* Point to point: the ops of a group are exchanged at its end, the k-th receive taking
 * the peer's k-th send; a group whose ops all name this rank (a self send/receive, as the
 * library's group probe issues) is copied in place without the peer, as NCCL does. */
static struct {
  int depth, nsend, nrecv, nself;
  const void* sbuf[MAX_OPS];
  size_t sn[MAX_OPS];
  void* rbuf[MAX_OPS];
  size_t rn[MAX_OPS];
  comm_t comm;
} grp;

static int flush_group(void) {
  comm_t c = grp.comm;
  int rc = ncclSuccess;
  if (c && grp.nself == grp.nsend + grp.nrecv) {
    for (int k = 0; k < grp.nrecv && k < grp.nsend; k++)
      memmove(grp.rbuf[k], grp.sbuf[k], grp.sn[k] < grp.rn[k] ? grp.sn[k] : grp.rn[k]);
  } else if (c) {
    size_t off = 0;
    for (int k = 0; k < grp.nsend; k++) {
      memcpy(c->data + (size_t)c->rank * SLOT + off, grp.sbuf[k], grp.sn[k]);
      c->h->seg[c->rank][k] = grp.sn[k];
      off += grp.sn[k];
    }
    c->h->nseg[c->rank] = grp.nsend;
    rc = barrier(c);
    off = 0;
    int p = 1 - c->rank;
    for (int k = 0; rc == ncclSuccess && k < grp.nrecv && k < c->h->nseg[p]; k++) {
      size_t n = c->h->seg[p][k] < grp.rn[k] ? c->h->seg[p][k] : grp.rn[k];
      memcpy(grp.rbuf[k], c->data + (size_t)p * SLOT + off, n);
      off += c->h->seg[p][k];
    }
    if (rc == ncclSuccess) rc = barrier(c);
  }
  grp.nsend = grp.nrecv = grp.nself = 0;
  grp.comm = NULL;
  return rc;
}

int pncclGroupStart(void) {
  grp.depth++;
  return ncclSuccess;
}

int pncclGroupEnd(void) {
  if (--grp.depth > 0) return ncclSuccess;
  return flush_group();
}

int pncclSend(const void* buf, size_t n, int type, int peer, comm_t c, void* stream) {
  (void)type;
  (void)stream;
  if (grp.nsend == MAX_OPS) return ncclInvalidUsage;
  grp.nself += peer == c->rank;
  grp.comm = c;
  grp.sbuf[grp.nsend] = buf;
  grp.sn[grp.nsend++] = n;
  return grp.depth ? ncclSuccess : flush_group();
}

int pncclRecv(void* buf, size_t n, int type, int peer, comm_t c, void* stream) {
  (void)type;
  (void)stream;
  if (grp.nrecv == MAX_OPS) return ncclInvalidUsage;
  grp.nself += peer == c->rank;
  grp.comm = c;
  grp.rbuf[grp.nrecv] = buf;
  grp.rn[grp.nrecv++] = n;
  return grp.depth ? ncclSuccess : flush_group();
}

int pncclCommGetAsyncError(comm_t c, int* e) {
  *e = c->error;
  return ncclSuccess;
}

int pncclCommAbort(comm_t c) {
  (void)c;
  return ncclSuccess;
}

int pncclCommFinalize(comm_t c) { return barrier(c); }

int pncclCommDestroy(comm_t c) {
  finalize_plugin(c);
  return ncclSuccess;
}

/* The queries the interceptor asks of a communicator it learns at its first gather. */
int pncclCommCount(comm_t c, int* n) {
  (void)c;
  *n = 2;
  return ncclSuccess;
}

int pncclCommUserRank(comm_t c, int* r) {
  *r = c->rank;
  return ncclSuccess;
}

int pncclCommCuDevice(comm_t c, int* d) {
  (void)c;
  *d = 0;
  return ncclSuccess;
}

NCCL_NAME(ncclGetVersion)
NCCL_NAME(ncclGetErrorString)
NCCL_NAME(ncclGetUniqueId)
NCCL_NAME(ncclCommInitRank)
NCCL_NAME(ncclAllGather)
NCCL_NAME(ncclGroupStart)
NCCL_NAME(ncclGroupEnd)
NCCL_NAME(ncclSend)
NCCL_NAME(ncclRecv)
NCCL_NAME(ncclCommGetAsyncError)
NCCL_NAME(ncclCommAbort)
NCCL_NAME(ncclCommFinalize)
NCCL_NAME(ncclCommDestroy)
NCCL_NAME(ncclCommCount)
NCCL_NAME(ncclCommUserRank)
NCCL_NAME(ncclCommCuDevice)
