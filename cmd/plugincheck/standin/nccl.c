/* A stand-in libnccl for plugincheck's rank program and the interceptor's tests, on machines
 * without a GPU or NCCL. make builds it as build/libnccl-standin.so (that soname, so that it is
 * never taken for a real libnccl); the tests build copies under NCCL's own names.
 *
 * - Each API function is defined once and published under two names at one address, as
 *   NCCL does: pncclX (strong) and ncclX (weak). -DFAKE_DROP_pncclCommSplit publishes
 *   ncclCommSplit alone, as a NCCL that lacks one pnccl name; -DFAKE_DROP_ncclCommSplit
 *   publishes neither. -DFAKE_REFUSED_ENTRY gives ncclCommGetAsyncError an entry whose first
 *   instructions branch into themselves (it runs as usual), which the entry hook refuses.
 *   -DFAKE_ODD_ENTRIES (x86-64) puts the entries of ncclCommFinalize and ncclCommAbort at 13
 *   and 15 bytes past a 16-byte boundary, where the hook's 5 bytes fit in no aligned word.
 * - Communicator init loads NCCL_NET_PLUGIN as NCCL does (dlopen RTLD_NOW|RTLD_LOCAL of the
 *   name as given, then libnccl-net-<name>.so; its ncclNetPlugin_v12, which roce_gather
 *   exports, where NCCL would take the first of v12..v8), calls its init and devices, and its
 *   finalize at destroy and abort: the plugin's init runs from inside this library, as it
 *   does from inside NCCL.
 * - Two ranks in two processes exchange host memory over one TCP connection: the process
 *   that made the unique id (ncclGetUniqueId) listens on loopback, or on the IPv4 address
 *   FAKE_NCCL_ADDR names (two hosts), and puts the address in the id; the other connects. ncclAllGather is synchronous, byte for byte, for any count
 *   and datatype, in place or not; the stream is ignored. ncclAllReduce sums int32 and
 *   float32; every other op and datatype it answers with the bytes of both ranks' buffers
 *   XORed, a result no one-shot engine computes, so that a test sees NCCL produced it. ncclSend and ncclRecv go to this rank itself only.
 * - Groups defer their operations, as NCCL does: inside ncclGroupStart/End (per thread) a
 *   gather, an all-reduce, a send or a receive is queued, returns ncclSuccess at once and
 *   runs when the outermost group ends, in order (a self send meets the self receive of the
 *   same group); that ncclGroupEnd returns the first error among them.
 * - ncclReduceScatter and ncclBroadcast exist, to be looked up; they are not modelled
 *   (ncclInvalidUsage).
 * - Every call is appended to FAKE_NCCL_LOG as one JSON line: the function, its arguments
 *   (pointers as %p prints them), its result, and FAKE_NAME (which copy answered).
 * - FAKE_NCCL_FORCE="ncclCommFinalize=6,..." makes ncclCommFinalize, ncclGroupStart or
 *   ncclGroupEnd return that result without doing anything; FAKE_NCCL_ASYNC_ERROR is what ncclCommGetAsyncError reports.
 * Nothing here is NCCL's code; it models the facts the interceptor relies on. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include "nccl/api.h"
#include "nccl/net.h"

#ifndef FAKE_NAME
#define FAKE_NAME "fake"
#endif
#ifndef FAKE_VERSION
#define FAKE_VERSION 22809
#endif
#define TIMEOUT_MS 60000

/* ---- the record of calls */

static void record(const char* fn, int result, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
static void record(const char* fn, int result, const char* fmt, ...) {
  const char* path = getenv("FAKE_NCCL_LOG");
  if (path == NULL || *path == '\0') return;
  char args[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(args, sizeof(args), fmt, ap);
  va_end(ap);
  char line[2600];
  int n = snprintf(line, sizeof(line), "{\"nccl\":\"%s\",\"pid\":%d,\"fn\":\"%s\",\"args\":{%s},\"result\":%d}\n",
                   FAKE_NAME, (int)getpid(), fn, args, result);
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return;
  ssize_t w = write(fd, line, (size_t)n);
  (void)w;
  close(fd);
}

/* The result FAKE_NCCL_FORCE sets for fn, or -1. */
static int forced(const char* fn) {
  const char* f = getenv("FAKE_NCCL_FORCE");
  size_t len = strlen(fn);
  while (f != NULL && *f) {
    if (strncmp(f, fn, len) == 0 && f[len] == '=') return atoi(f + len + 1);
    f = strchr(f, ',');
    if (f) f++;
  }
  return -1;
}

#define FORCED(fn, ...)                           \
  do {                                            \
    int forced_ = forced(fn);                     \
    if (forced_ >= 0) {                           \
      record(fn, forced_, __VA_ARGS__);           \
      return (ncclResult_t)forced_;               \
    }                                             \
  } while (0)

static void logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)flags, (void)file, (void)line;
  const char* d = getenv("NCCL_DEBUG");
  int want = d && strcasecmp(d, "INFO") == 0 ? NCCL_LOG_INFO : d && strcasecmp(d, "WARN") == 0 ? NCCL_LOG_WARN : 0;
  if (level == NCCL_LOG_NONE || (int)level > want) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  fprintf(stderr, "fake:%d:%ld [%s] NCCL %s %s\n", (int)getpid(), (long)syscall(SYS_gettid), FAKE_NAME,
          level == NCCL_LOG_WARN ? "WARN" : "INFO", msg);
}

/* ---- the net plugin, loaded as NCCL loads it */

static pthread_mutex_t plugin_mu = PTHREAD_MUTEX_INITIALIZER;
static const ncclNet_v12_t* plugin_table;
static int plugin_tried;

static void load_plugin(void) {
  if (plugin_tried) return;
  plugin_tried = 1;
  const char* name = getenv("NCCL_NET_PLUGIN");
  if (name == NULL || *name == '\0') return;
  void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    char alt[512];
    snprintf(alt, sizeof(alt), "libnccl-net-%s.so", name);
    lib = dlopen(alt, RTLD_NOW | RTLD_LOCAL);
  }
  if (lib == NULL) {
    logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "NET/Plugin: could not load %s: %s", name, dlerror());
    return;
  }
  if ((plugin_table = dlsym(lib, "ncclNetPlugin_v12")) == NULL)
    logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "NET/Plugin: %s has no ncclNetPlugin_v12", name);
}

/* Inits the plugin for one communicator; returns its context or NULL. */
static void* init_plugin(uint64_t commId) {
  pthread_mutex_lock(&plugin_mu);
  load_plugin();
  void* ctx = NULL;
  if (plugin_table) {
    int ndev = -1;
    ncclNetCommConfig_v12_t cfg = {.trafficClass = -1};
    ncclResult_t r = plugin_table->init(&ctx, commId, &cfg, logger, NULL);
    if (r == ncclSuccess) plugin_table->devices(&ndev);
    logger(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "net plugin v12 init: %d, %d device(s)", r, ndev);
  }
  pthread_mutex_unlock(&plugin_mu);
  return ctx;
}

static void finalize_plugin(void* ctx) {
  if (ctx == NULL) return;
  pthread_mutex_lock(&plugin_mu);
  plugin_table->finalize(ctx);
  pthread_mutex_unlock(&plugin_mu);
}

/* ---- two ranks over TCP */

typedef struct {
  uint32_t magic;
  uint32_t ip;   /* network order */
  uint16_t port; /* network order */
  uint16_t pad;
  uint64_t serial;
} fake_id;
_Static_assert(sizeof(fake_id) <= sizeof(ncclUniqueId), "the id fits NCCL's 128 bytes");
#define ID_MAGIC 0x46414b45u

typedef struct link {
  int fd;
  int refs;
} link_t;

struct ncclComm {
  int rank, nranks;
  link_t* link;
  void* netctx;
  int cuda_dev;
};

/* Listening sockets of the ids this process made, by port. */
static pthread_mutex_t listen_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  uint16_t port;
  int fd;
} listeners[64];
static int nlisteners;

static int listener_for(uint16_t port) {
  int fd = -1;
  pthread_mutex_lock(&listen_mu);
  for (int i = 0; i < nlisteners; i++)
    if (listeners[i].port == port) fd = listeners[i].fd;
  pthread_mutex_unlock(&listen_mu);
  return fd;
}

static ncclResult_t get_unique_id(ncclUniqueId* out) {
  if (out == NULL) return ncclInvalidArgument;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  const char* addr = getenv("FAKE_NCCL_ADDR");
  if (addr != NULL && *addr != '\0' && inet_pton(AF_INET, addr, &a.sin_addr) != 1) {
    logger(NCCL_LOG_WARN, NCCL_INIT, __FILE__, __LINE__, "FAKE_NCCL_ADDR=%s is not an IPv4 address", addr);
    record("ncclGetUniqueId", ncclInvalidArgument, "\"uniqueId\":\"%p\"", (void*)out);
    return ncclInvalidArgument;
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  socklen_t len = sizeof(a);
  if (fd < 0 || bind(fd, (struct sockaddr*)&a, sizeof(a)) != 0 || listen(fd, 8) != 0 ||
      getsockname(fd, (struct sockaddr*)&a, &len) != 0 || nlisteners == 64) {
    char ip[INET_ADDRSTRLEN] = "";
    inet_ntop(AF_INET, &a.sin_addr, ip, sizeof(ip));
    logger(NCCL_LOG_WARN, NCCL_INIT, __FILE__, __LINE__, "listening on %s for the unique id's peer: %s", ip,
           nlisteners == 64 ? "64 ids made already" : strerror(errno));
    if (fd >= 0) close(fd);
    record("ncclGetUniqueId", ncclSystemError, "\"uniqueId\":\"%p\"", (void*)out);
    return ncclSystemError;
  }
  pthread_mutex_lock(&listen_mu);
  listeners[nlisteners].port = a.sin_port;
  listeners[nlisteners++].fd = fd;
  pthread_mutex_unlock(&listen_mu);
  memset(out, 0, sizeof(*out));
  static uint64_t serial;
  fake_id id = {.magic = ID_MAGIC, .ip = a.sin_addr.s_addr, .port = a.sin_port, .serial = ++serial};
  memcpy(out, &id, sizeof(id));
  record("ncclGetUniqueId", ncclSuccess, "\"uniqueId\":\"%p\",\"port\":%d", (void*)out, ntohs(a.sin_port));
  return ncclSuccess;
}

/* poll of one descriptor for TIMEOUT_MS, the rest of it again after a signal (a Go runtime
 * in the process sends them). */
static int poll_one(struct pollfd* p) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int left = TIMEOUT_MS;;) {
    int r = poll(p, 1, left);
    if (r >= 0 || errno != EINTR) return r;
    clock_gettime(CLOCK_MONOTONIC, &t);
    left = TIMEOUT_MS - (int)((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000);
    if (left <= 0) return 0;
  }
}

/* Sends out and receives in, n bytes each way, at the same time (no deadlock on large n). */
static int exchange(int fd, const void* out, void* in, size_t n) {
  size_t sent = 0, got = 0;
  while (sent < n || got < n) {
    struct pollfd p = {fd, (short)((sent < n ? POLLOUT : 0) | (got < n ? POLLIN : 0)), 0};
    if (poll_one(&p) != 1) return -1;
    if (sent < n && (p.revents & POLLOUT)) {
      ssize_t k = send(fd, (const char*)out + sent, n - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0 && errno != EAGAIN && errno != EINTR) return -1;
      if (k > 0) sent += (size_t)k;
    }
    if (got < n && (p.revents & (POLLIN | POLLHUP | POLLERR))) {
      ssize_t k = recv(fd, (char*)in + got, n - got, MSG_DONTWAIT);
      if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR)) return -1;
      if (k > 0) got += (size_t)k;
    }
  }
  return 0;
}

static link_t* connect_ranks(const fake_id* id) {
  int fd = -1;
  int lfd = listener_for(id->port);
  if (lfd >= 0) {
    struct pollfd p = {lfd, POLLIN, 0};
    if (poll_one(&p) != 1) return NULL;
    fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
  } else {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = id->ip, .sin_port = id->port};
    for (int tries = 0; tries < TIMEOUT_MS / 10; tries++) {
      fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0 && connect(fd, (struct sockaddr*)&a, sizeof(a)) == 0) break;
      if (fd >= 0) close(fd);
      fd = -1;
      usleep(10000);
    }
  }
  if (fd < 0) return NULL;
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  link_t* l = calloc(1, sizeof(*l));
  l->fd = fd;
  l->refs = 1;
  return l;
}

static void release(link_t* l) {
  if (l != NULL && --l->refs == 0) {
    close(l->fd);
    free(l);
  }
}

static ncclResult_t make_comm(ncclComm_t* out, int nranks, const ncclUniqueId* commId, int rank) {
  if (out == NULL || nranks < 1 || nranks > 2 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  fake_id id;
  memcpy(&id, commId, sizeof(id));
  if (nranks == 2 && id.magic != ID_MAGIC) return ncclInvalidArgument;
  struct ncclComm* c = calloc(1, sizeof(*c));
  c->rank = rank;
  c->nranks = nranks;
  c->netctx = init_plugin(id.serial ^ ((uint64_t)id.port << 32) ^ (uint64_t)rank);
  if (nranks == 2) {
    c->link = connect_ranks(&id);
    int ranks[2] = {rank, -1};
    if (c->link == NULL || exchange(c->link->fd, &ranks[0], &ranks[1], sizeof(int)) != 0 || ranks[1] != 1 - rank) {
      logger(NCCL_LOG_WARN, NCCL_INIT, __FILE__, __LINE__, "rank %d could not meet its peer (it said rank %d)", rank,
             ranks[1]);
      finalize_plugin(c->netctx);
      release(c->link);
      free(c);
      return ncclSystemError;
    }
  }
  *out = c;
  return ncclSuccess;
}

static ncclResult_t comm_init_rank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  ncclResult_t r = make_comm(comm, nranks, &commId, rank);
  record("ncclCommInitRank", r, "\"comm\":\"%p\",\"nranks\":%d,\"rank\":%d,\"made\":\"%p\"", (void*)comm, nranks,
         rank, r == ncclSuccess ? (void*)*comm : NULL);
  return r;
}

static ncclResult_t comm_init_rank_config(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                          ncclConfig_t* config) {
  ncclResult_t r = config != NULL && config->magic != NCCL_API_MAGIC ? ncclInvalidArgument
                                                                     : make_comm(comm, nranks, &commId, rank);
  record("ncclCommInitRankConfig", r,
         "\"comm\":\"%p\",\"nranks\":%d,\"rank\":%d,\"config\":\"%p\",\"blocking\":%d,\"made\":\"%p\"", (void*)comm,
         nranks, rank, (void*)config, config ? config->blocking : 1, r == ncclSuccess ? (void*)*comm : NULL);
  return r;
}

static ncclResult_t comm_init_all(ncclComm_t* comms, int ndev, const int* devlist) {
  ncclResult_t r = ncclInvalidArgument;
  /* One device only: several would need one process to drive several ranks at once. */
  if (comms != NULL && ndev == 1) {
    ncclUniqueId none;
    memset(&none, 0, sizeof(none));
    r = make_comm(&comms[0], 1, &none, 0);
    if (r == ncclSuccess) comms[0]->cuda_dev = devlist ? devlist[0] : 0;
  }
  record("ncclCommInitAll", r, "\"comms\":\"%p\",\"ndev\":%d,\"devlist\":\"%p\",\"made\":\"%p\"", (void*)comms, ndev,
         (void*)devlist, r == ncclSuccess ? (void*)comms[0] : NULL);
  return r;
}

static ncclResult_t comm_split(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  ncclResult_t r = ncclSuccess;
  if (comm == NULL || newcomm == NULL) r = ncclInvalidArgument;
  int mine[2] = {color, key}, peer[2] = {NCCL_SPLIT_NOCOLOR, 0};
  if (r == ncclSuccess && comm->nranks == 2 && exchange(comm->link->fd, mine, peer, sizeof(mine)) != 0)
    r = ncclRemoteError;
  if (r == ncclSuccess) {
    *newcomm = NULL;
    if (color != NCCL_SPLIT_NOCOLOR) {
      struct ncclComm* c = calloc(1, sizeof(*c));
      int together = comm->nranks == 2 && peer[0] == color;
      c->nranks = together ? 2 : 1;
      c->rank = together ? (key < peer[1] || (key == peer[1] && comm->rank == 0) ? 0 : 1) : 0;
      c->link = together ? comm->link : NULL;
      if (c->link) c->link->refs++;
      c->cuda_dev = comm->cuda_dev;
      c->netctx = init_plugin(((uint64_t)(uintptr_t)comm << 8) ^ (uint64_t)color);
      *newcomm = c;
    }
  }
  record("ncclCommSplit", r,
         "\"comm\":\"%p\",\"color\":%d,\"key\":%d,\"newcomm\":\"%p\",\"config\":\"%p\",\"made\":\"%p\"", (void*)comm,
         color, key, (void*)newcomm, (void*)config, r == ncclSuccess ? (void*)*newcomm : NULL);
  return r;
}

__attribute__((used)) static ncclResult_t comm_finalize(ncclComm_t comm) {
  FORCED("ncclCommFinalize", "\"comm\":\"%p\"", (void*)comm);
  ncclResult_t r = comm == NULL ? ncclInvalidArgument : ncclSuccess;
  record("ncclCommFinalize", r, "\"comm\":\"%p\"", (void*)comm);
  return r;
}

/* ---- groups: operations queued until the outermost ncclGroupEnd */

enum op_kind { OP_ALLGATHER, OP_ALLREDUCE, OP_SEND, OP_RECV };
typedef struct queued_op {
  enum op_kind kind;
  const void* send;
  void* recv;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t redop;
  int peer;
  ncclComm_t comm;
} queued_op;

static __thread int group_depth;
static __thread queued_op* queued;
static __thread int nqueued, capqueued;

static int enqueue(queued_op o) {
  if (nqueued == capqueued) {
    int cap = capqueued ? 2 * capqueued : 16;
    queued_op* q = realloc(queued, (size_t)cap * sizeof(*q));
    if (q == NULL) return -1;
    queued = q, capqueued = cap;
  }
  queued[nqueued++] = o;
  return 0;
}

static void drop_queued(ncclComm_t comm) {
  int k = 0;
  for (int i = 0; i < nqueued; i++)
    if (queued[i].comm != comm) queued[k++] = queued[i];
  nqueued = k;
}

/* ncclCommDestroy and ncclCommAbort (fn) alike: the communicator goes at once. */
static ncclResult_t free_comm(const char* fn, ncclComm_t comm) {
  if (comm != NULL) {
    drop_queued(comm); /* this thread's operations on it that a group still holds never run */
    finalize_plugin(comm->netctx);
    release(comm->link);
    free(comm);
  }
  record(fn, ncclSuccess, "\"comm\":\"%p\"", (void*)comm);
  return ncclSuccess;
}

static ncclResult_t comm_destroy(ncclComm_t comm) { return free_comm("ncclCommDestroy", comm); }
__attribute__((used)) static ncclResult_t comm_abort(ncclComm_t comm) { return free_comm("ncclCommAbort", comm); }

__attribute__((used)) static ncclResult_t comm_get_async_error(ncclComm_t comm, ncclResult_t* asyncError) {
  ncclResult_t r = comm == NULL || asyncError == NULL ? ncclInvalidArgument : ncclSuccess;
  const char* e = getenv("FAKE_NCCL_ASYNC_ERROR");
  if (r == ncclSuccess) *asyncError = (ncclResult_t)(e && *e ? atoi(e) : ncclSuccess);
  record("ncclCommGetAsyncError", r, "\"comm\":\"%p\",\"asyncError\":\"%p\",\"reported\":%d", (void*)comm,
         (void*)asyncError, r == ncclSuccess ? (int)*asyncError : -1);
  return r;
}

/* The communicator's queries: one field each. */
#define COMM_QUERY(impl, fn, field)                                    \
  static ncclResult_t impl(const ncclComm_t comm, int* out) {         \
    if (comm == NULL || out == NULL) return ncclInvalidArgument;      \
    *out = comm->field;                                               \
    record(fn, ncclSuccess, "\"comm\":\"%p\"", (void*)comm);           \
    return ncclSuccess;                                               \
  }
COMM_QUERY(comm_count, "ncclCommCount", nranks)
COMM_QUERY(comm_user_rank, "ncclCommUserRank", rank)
COMM_QUERY(comm_cu_device, "ncclCommCuDevice", cuda_dev)

static ncclResult_t run_all_gather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                                   ncclComm_t comm) {
  size_t bytes = sendcount * rg_nccl_type_bytes(datatype);
  ncclResult_t r = ncclSuccess;
  if (comm->nranks == 2) {
    char* peer_row = (char*)recvbuff + (size_t)(1 - comm->rank) * bytes;
    uint64_t mine = bytes, theirs = 0;
    if (exchange(comm->link->fd, &mine, &theirs, sizeof(mine)) != 0 || theirs != mine ||
        exchange(comm->link->fd, sendbuff, peer_row, bytes) != 0)
      r = ncclRemoteError;
  }
  if (r == ncclSuccess) memmove((char*)recvbuff + (size_t)comm->rank * bytes, sendbuff, bytes);
  return r;
}

static ncclResult_t run_all_reduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                   ncclRedOp_t op, ncclComm_t comm) {
  size_t bytes = count * rg_nccl_type_bytes(datatype);
  ncclResult_t r = ncclSuccess;
  char* peer = malloc(bytes ? bytes : 1);
  if (comm->nranks == 2 && exchange(comm->link->fd, sendbuff, peer, bytes) != 0) r = ncclRemoteError;
  const int sum = op == ncclSum && (datatype == ncclInt32 || datatype == ncclFloat32);
  for (size_t i = 0; r == ncclSuccess && !sum && i < bytes; i++)
    ((char*)recvbuff)[i] = (char)(((const char*)sendbuff)[i] ^ (comm->nranks == 2 ? peer[i] : 0));
  for (size_t i = 0; r == ncclSuccess && sum && i < count; i++) {
    if (datatype == ncclInt32)
      ((int32_t*)recvbuff)[i] = ((const int32_t*)sendbuff)[i] + (comm->nranks == 2 ? ((int32_t*)peer)[i] : 0);
    else
      ((float*)recvbuff)[i] = ((const float*)sendbuff)[i] + (comm->nranks == 2 ? ((float*)peer)[i] : 0);
  }
  free(peer);
  return r;
}

/* Runs a group's operations: collectives in order, then each self send with the self
 * receive of the same rank in order. */
static ncclResult_t run_group(queued_op* ops, int n) {
  ncclResult_t first = ncclSuccess, r;
  int next_recv = 0;
  for (int i = 0; i < n; i++) {
    queued_op* o = &ops[i];
    r = ncclSuccess;
    if (o->kind == OP_ALLGATHER) r = run_all_gather(o->send, o->recv, o->count, o->type, o->comm);
    if (o->kind == OP_ALLREDUCE) r = run_all_reduce(o->send, o->recv, o->count, o->type, o->redop, o->comm);
    if (o->kind == OP_SEND) {
      while (next_recv < n && ops[next_recv].kind != OP_RECV) next_recv++;
      if (next_recv == n || ops[next_recv].count != o->count || ops[next_recv].type != o->type) {
        r = ncclInvalidUsage; /* a send with no receive to meet it */
      } else {
        memcpy(ops[next_recv].recv, o->send, o->count * rg_nccl_type_bytes(o->type));
        next_recv++;
      }
    }
    if (first == ncclSuccess) first = r;
  }
  return first;
}

/* An operation queued inside a group, or else run at once as a group of its own. */
static ncclResult_t submit(queued_op o) {
  if (group_depth > 0) return enqueue(o) == 0 ? ncclSuccess : ncclSystemError;
  return run_group(&o, 1);
}

static ncclResult_t all_gather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                               ncclComm_t comm, cudaStream_t stream) {
  size_t bytes = sendcount * rg_nccl_type_bytes(datatype);
  ncclResult_t r = ncclSuccess;
  if (comm == NULL || rg_nccl_type_bytes(datatype) == 0 || (bytes > 0 && (sendbuff == NULL || recvbuff == NULL)))
    r = ncclInvalidArgument;
  else
    r = submit((queued_op){.kind = OP_ALLGATHER, .send = sendbuff, .recv = recvbuff, .count = sendcount, .type = datatype,
                           .comm = comm});
  record("ncclAllGather", r,
         "\"sendbuff\":\"%p\",\"recvbuff\":\"%p\",\"sendcount\":%zu,\"datatype\":%d,\"comm\":\"%p\",\"stream\":"
         "\"%p\",\"deferred\":%d",
         sendbuff, (void*)recvbuff, sendcount, (int)datatype, (void*)comm, (void*)stream, group_depth > 0);
  return r;
}

static ncclResult_t all_reduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  ncclResult_t r;
  if (comm == NULL || rg_nccl_type_bytes(datatype) == 0)
    r = ncclInvalidArgument;
  else
    r = submit((queued_op){.kind = OP_ALLREDUCE, .send = sendbuff, .recv = recvbuff, .count = count, .type = datatype,
                           .redop = op, .comm = comm});
  record("ncclAllReduce", r,
         "\"sendbuff\":\"%p\",\"recvbuff\":\"%p\",\"count\":%zu,\"datatype\":%d,\"op\":%d,\"comm\":\"%p\",\"stream\":"
         "\"%p\",\"deferred\":%d",
         sendbuff, recvbuff, count, (int)datatype, (int)op, (void*)comm, (void*)stream, group_depth > 0);
  return r;
}

static ncclResult_t group_start(void) {
  FORCED("ncclGroupStart", "%s", "");
  group_depth++;
  record("ncclGroupStart", ncclSuccess, "\"depth\":%d", group_depth);
  return ncclSuccess;
}

static ncclResult_t group_end(void) {
  FORCED("ncclGroupEnd", "%s", "");
  ncclResult_t r = group_depth == 0 ? ncclInvalidUsage : ncclSuccess;
  if (group_depth > 0 && --group_depth == 0) {
    int n = nqueued;
    nqueued = 0;
    r = run_group(queued, n);
  }
  record("ncclGroupEnd", r, "\"depth\":%d", group_depth);
  return r;
}

/* Self only: a send or receive queued in a group (a lone one is an implicit group of its own). */
static ncclResult_t p2p(enum op_kind kind, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                        int peer, ncclComm_t comm, cudaStream_t stream) {
  const char* fn = kind == OP_SEND ? "ncclSend" : "ncclRecv";
  ncclResult_t r;
  if (comm == NULL || rg_nccl_type_bytes(datatype) == 0 || peer < 0 || peer >= comm->nranks)
    r = ncclInvalidArgument;
  else if (peer != comm->rank || group_depth == 0)
    r = ncclInvalidUsage; /* another rank's: not modelled; alone, it has nothing to meet */
  else
    r = submit((queued_op){.kind = kind, .send = sendbuff, .recv = recvbuff, .count = count, .type = datatype, .peer = peer,
                           .comm = comm});
  record(fn, r, "\"buff\":\"%p\",\"count\":%zu,\"datatype\":%d,\"peer\":%d,\"comm\":\"%p\",\"stream\":\"%p\",\"depth\":%d",
         kind == OP_SEND ? sendbuff : (const void*)recvbuff, count, (int)datatype, peer, (void*)comm, (void*)stream,
         group_depth);
  return r;
}

static ncclResult_t send_to(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                            cudaStream_t stream) {
  return p2p(OP_SEND, sendbuff, NULL, count, datatype, peer, comm, stream);
}

static ncclResult_t recv_from(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                              cudaStream_t stream) {
  return p2p(OP_RECV, NULL, recvbuff, count, datatype, peer, comm, stream);
}

static ncclResult_t reduce_scatter(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                   ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  (void)datatype, (void)op, (void)stream;
  record("ncclReduceScatter", ncclInvalidUsage, "\"sendbuff\":\"%p\",\"recvbuff\":\"%p\",\"count\":%zu,\"comm\":\"%p\"",
         sendbuff, recvbuff, count, (void*)comm);
  return ncclInvalidUsage;
}

static ncclResult_t broadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                              ncclComm_t comm, cudaStream_t stream) {
  (void)datatype, (void)stream;
  record("ncclBroadcast", ncclInvalidUsage, "\"sendbuff\":\"%p\",\"recvbuff\":\"%p\",\"count\":%zu,\"root\":%d,\"comm\":\"%p\"",
         sendbuff, recvbuff, count, root, (void*)comm);
  return ncclInvalidUsage;
}

static ncclResult_t get_version(int* version) {
  if (version == NULL) return ncclInvalidArgument;
  *version = FAKE_VERSION;
  record("ncclGetVersion", ncclSuccess, "\"version\":\"%p\"", (void*)version);
  return ncclSuccess;
}

static const char* get_error_string(ncclResult_t r) {
  static const char* const s[] = {"no error", "unhandled cuda error", "unhandled system error", "internal error",
                                  "invalid argument", "invalid usage", "remote process exited or there was a network error",
                                  "NCCL operation in progress"};
  return (int)r >= 0 && (int)r < 8 ? s[r] : "unknown result code";
}

/* pncclX strong and ncclX weak, both at impl's address, as NCCL publishes its API. */
#define PUBLISH(impl, name)                                             \
  extern __typeof(impl) p##name __attribute__((alias(#impl)));         \
  extern __typeof(impl) name __attribute__((weak, alias(#impl)))

PUBLISH(get_version, ncclGetVersion);
PUBLISH(get_error_string, ncclGetErrorString);
PUBLISH(get_unique_id, ncclGetUniqueId);
PUBLISH(comm_init_rank, ncclCommInitRank);
PUBLISH(comm_init_rank_config, ncclCommInitRankConfig);
PUBLISH(comm_init_all, ncclCommInitAll);
#if defined(FAKE_DROP_pncclCommSplit)
extern __typeof(comm_split) ncclCommSplit __attribute__((alias("comm_split")));
#elif defined(FAKE_DROP_ncclCommSplit)
__attribute__((used)) static void* const keep_comm_split = (void*)comm_split;
#else
PUBLISH(comm_split, ncclCommSplit);
#endif
#if defined(FAKE_ODD_ENTRIES) && defined(__x86_64__)
/* push %rbp; mov %rsp,%rbp; pop %rbp (5 bytes the hook displaces), then a jump to the body. */
#define ODD_ENTRY(name, skip, impl)                                                                   \
  __asm__(".text\n.p2align 4\n.skip " #skip ", 0xcc\n.globl p" #name "\n.type p" #name ", @function\n" \
          ".weak " #name "\n.type " #name ", @function\np" #name ":\n" #name ":\n"                     \
          "  push %rbp\n  mov %rsp, %rbp\n  pop %rbp\n  jmp " #impl "\n"                             \
          ".size p" #name ", .-p" #name "\n.size " #name ", .-" #name "\n")
ODD_ENTRY(ncclCommFinalize, 13, comm_finalize);
ODD_ENTRY(ncclCommAbort, 15, comm_abort);
#else
PUBLISH(comm_finalize, ncclCommFinalize);
PUBLISH(comm_abort, ncclCommAbort);
#endif
PUBLISH(comm_destroy, ncclCommDestroy);
#ifdef FAKE_REFUSED_ENTRY
/* ncclCommGetAsyncError opens with a conditional branch into its own first instructions
 * (test; je to the next instruction; jmp to its body), which run as usual. */
#if defined(__x86_64__)
__asm__(".text\n.globl pncclCommGetAsyncError\n.type pncclCommGetAsyncError, @function\n"
        ".weak ncclCommGetAsyncError\n.type ncclCommGetAsyncError, @function\n"
        "pncclCommGetAsyncError:\nncclCommGetAsyncError:\n"
        "  test %edi, %edi\n  je 1f\n1:\n  jmp comm_get_async_error\n"
        ".size pncclCommGetAsyncError, .-pncclCommGetAsyncError\n.size ncclCommGetAsyncError, .-ncclCommGetAsyncError\n");
#elif defined(__aarch64__)
/* A prefetch of a literal, which the aarch64 relocator refuses. */
__asm__(".text\n.globl pncclCommGetAsyncError\n.type pncclCommGetAsyncError, %function\n"
        ".weak ncclCommGetAsyncError\n.type ncclCommGetAsyncError, %function\n"
        "pncclCommGetAsyncError:\nncclCommGetAsyncError:\n"
        "  prfm pldl1keep, .\n  b comm_get_async_error\n"
        ".size pncclCommGetAsyncError, .-pncclCommGetAsyncError\n.size ncclCommGetAsyncError, .-ncclCommGetAsyncError\n");
#endif
#else
PUBLISH(comm_get_async_error, ncclCommGetAsyncError);
#endif
PUBLISH(comm_count, ncclCommCount);
PUBLISH(comm_user_rank, ncclCommUserRank);
PUBLISH(comm_cu_device, ncclCommCuDevice);
PUBLISH(group_start, ncclGroupStart);
PUBLISH(group_end, ncclGroupEnd);
PUBLISH(all_gather, ncclAllGather);
PUBLISH(all_reduce, ncclAllReduce);
PUBLISH(send_to, ncclSend);
PUBLISH(recv_from, ncclRecv);
PUBLISH(reduce_scatter, ncclReduceScatter);
PUBLISH(broadcast, ncclBroadcast);
