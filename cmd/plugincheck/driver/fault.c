/* Fault suites, driven by a harness that kills rank 1 or cuts its link when rank 1
 * prints "VICTIM". Rank 0 survives and reports how its requests ended: an NCCL error
 * within ROCE_GATHER_TIMEOUT_MS plus a second, nothing written into a failed gather's
 * rows, and every close prompt. */
#define _GNU_SOURCE
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "rank.h"

/* What this process's descriptors point at: "\nfd:target" for each. */
static void fd_targets(char* out, size_t n) {
  snprintf(out, n, "\n");
  DIR* d = opendir("/proc/self/fd");
  if (d == NULL) return;
  size_t used = 1;
  for (struct dirent* e; (e = readdir(d)) != NULL;) {
    if (e->d_name[0] == '.' || atoi(e->d_name) == dirfd(d)) continue;
    char path[300], target[256];
    snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
    ssize_t k = readlink(path, target, sizeof(target) - 1);
    target[k > 0 ? k : 0] = '\0';
    int w = snprintf(out + used, n - used, "%s:%s\n", e->d_name, target);
    if (w < 0 || (size_t)w >= n - used) break;
    used += (size_t)w;
  }
  closedir(d);
}

/* The entries of after that before lacks, joined by ", " into out. */
static void fd_new(const char* before, const char* after, char* out, size_t n) {
  out[0] = '\0';
  size_t used = 0;
  for (const char* l = after + 1; *l;) {
    const char* end = strchr(l, '\n');
    int len = (int)(end - l);
    char entry[320];
    snprintf(entry, sizeof(entry), "\n%.*s\n", len, l);
    if (strstr(before, entry) == NULL) {
      int w = snprintf(out + used, n - used, "%s%.*s", used ? ", " : "", len, l);
      if (w < 0 || (size_t)w >= n - used) break;
      used += (size_t)w;
    }
    l = end + 1;
  }
}

static uint64_t timeout_ns(void) {
  const char* v = getenv("ROCE_GATHER_TIMEOUT_MS");
  return (uint64_t)(v ? atoll(v) : 30000) * 1000000ull;
}

/* The victim announces it is ready to be killed, then waits to be. */
static void play_dead(void) {
  printf("VICTIM\n");
  fflush(stdout);
  for (;;) pause();
}

/* Tests req until it completes or fails; returns the NCCL result and the time it took. */
static int wait_outcome(int (*test)(void*, int*, int*), void* req, uint64_t limit_ns, uint64_t* took, int* done) {
  uint64_t t0 = now_ns();
  *done = 0;
  for (;;) {
    int sizes[8] = {0};
    int rc = test(req, done, sizes);
    *took = now_ns() - t0;
    if (rc != ncclSuccess || *done || *took > limit_ns) return rc;
    usleep(100);
  }
}

static int net_test(void* req, int* done, int* sizes) { return R.net->test(req, done, sizes); }
static const ncclCollNet_v12_t* CN;
static int coll_test(void* req, int* done, int* size) { return CN->test(req, done, size); }

static void report_failure(const char* name, int rc, int done, uint64_t took, int warns_before, const char* extra) {
  uint64_t limit = timeout_ns() + 1000000000ull;
  int warns = driver_warns - warns_before;
  int ok = rc != ncclSuccess && !done && took <= limit && warns == 1;
  case_result(name, ok, "test returned %d after %.0f ms (limit %.0f ms), %d WARN line(s)%s", rc, (double)took / 1e6,
              (double)limit / 1e6, warns, extra);
}

/* A 64 MiB message in flight when the sender dies (or its link is cut). */
static int fault_p2p(void) {
  conn_pair cp;
  if (connect_pair("fault-p2p", &cp) != 0) {
    case_result("fault/p2p-connect", 0, "could not connect");
    return 1;
  }
  size_t n = 64u << 20;
  uint8_t* buf = malloc(n);
  memset(buf, 0x5a, n);
  void* mh = NULL;
  if (R.rank == 1) {
    R.net->regMr(cp.send, buf, n, NCCL_PTR_HOST, &mh);
    barrier("fault-posted");
    void* req = NULL;
    while (req == NULL) R.net->isend(cp.send, buf, n, 0, mh, NULL, &req);
    play_dead();
  }
  R.net->regMr(cp.recv, buf, n, NCCL_PTR_HOST, &mh);
  void* data[1] = {buf};
  size_t sizes[1] = {n};
  int tags[1] = {0};
  void* mhs[1] = {mh};
  void* req = NULL;
  while (req == NULL) R.net->irecv(cp.recv, 1, data, sizes, tags, mhs, NULL, &req);
  barrier("fault-posted");
  int w0 = driver_warns, done;
  uint64_t took;
  int rc = wait_outcome(net_test, req, timeout_ns() + 5000000000ull, &took, &done);
  report_failure("fault/p2p-peer-gone-mid-transfer", rc, done, took, w0, "");
  uint64_t t0 = now_ns();
  close_pair(&cp);
  double ms = (double)(now_ns() - t0) / 1e6;
  case_result("fault/p2p-close-after-failure", ms < 1000, "closeSend and closeRecv took %.1f ms", ms);
  free(buf);
  return 0;
}

/* Forms a one-shot group as NCCL would; returns the collComm or NULL. */
static void* form_group(void** cctx) {
  CN = R.p.coll12;
  uint8_t handles[2][NCCL_NET_HANDLE_MAXSIZE];
  void* listen = NULL;
  void* coll = NULL;
  if (CN->init(cctx, R.comm_id, driver_logger) != ncclSuccess) return NULL;
  if (CN->listen(*cctx, 0, handles[R.rank], &listen) != ncclSuccess) return NULL;
  if (exchange("fault-coll", handles[R.rank], handles[1 - R.rank], NCCL_NET_HANDLE_MAXSIZE) != 0) return NULL;
  void* hp[2] = {handles[0], handles[1]};
  CN->connect(hp, 2, R.rank, listen, &coll);
  CN->closeListen(listen);
  return coll;
}

/* A gather the peer never joins: it dies (stall=0) or just does not come (stall=1). */
static int fault_gather(int stall) {
  void* cctx = NULL;
  void* coll = form_group(&cctx);
  const char* name = stall ? "fault/gather-peer-never-comes" : "fault/gather-peer-gone";
  if (coll == NULL) {
    case_result(name, 0, "the one-shot group did not form");
    return 1;
  }
  size_t S = 64 << 10;
  if (R.rank == 1) {
    barrier("fault-posted");
    if (!stall) play_dead();
    /* Alive but absent: stay away past the survivor's timeout, then leave quietly. */
    usleep((useconds_t)(timeout_ns() / 1000 + 3000000));
    _exit(0);
  }
  uint8_t* shard = malloc(S);
  uint8_t* rows = malloc(2 * S);
  memset(shard, 0x11, S);
  memset(rows, 0xEE, 2 * S);
  void *smh = NULL, *rmh = NULL;
  CN->regMr(coll, shard, S, NCCL_PTR_HOST, &smh);
  CN->regMr(coll, rows, 2 * S, NCCL_PTR_HOST, &rmh);
  ncclNetSGE_v12_t part = {.mhandle = rmh, .address = rows, .size = 2 * S};
  void* req = NULL;
  while (req == NULL) CN->iallgather(coll, shard, 1, &part, S, 0, 2 * S, smh, &req);
  barrier("fault-posted");
  int w0 = driver_warns, done;
  uint64_t took;
  int rc = wait_outcome(coll_test, req, timeout_ns() + 5000000000ull, &took, &done);
  size_t touched = 0;
  for (size_t i = 0; i < 2 * S; i++) touched += rows[i] != 0xEE;
  char extra[96];
  snprintf(extra, sizeof(extra), ", %zu of %zu row bytes changed", touched, 2 * S);
  report_failure(name, rc, done, took, w0, extra);
  case_result(stall ? "fault/gather-rows-untouched-after-timeout" : "fault/gather-rows-untouched-after-death",
              touched == 0, "%zu of %zu bytes of the output rows changed", touched, 2 * S);
  /* Once failed, the group answers at once: far below the timeout a wait would take, with
   * room for a loaded or emulated machine (the bound of 1 ms failed in soft-RoCE's guest). */
  void* again = NULL;
  uint64_t t0 = now_ns();
  int rc2 = CN->iallgather(coll, shard, 1, &part, S, 0, 2 * S, smh, &again);
  double again_ms = (double)(now_ns() - t0) / 1e6;
  case_result("fault/gather-after-failure", rc2 != ncclSuccess && again == NULL && again_ms < 100,
              "the next iallgather returned %d in %.2f ms (limit 100 ms)", rc2, again_ms);
  CN->deregMr(coll, smh);
  CN->deregMr(coll, rmh);
  t0 = now_ns();
  CN->closeColl(coll);
  CN->finalize(cctx);
  double ms = (double)(now_ns() - t0) / 1e6;
  case_result("fault/gather-close-after-failure", ms < 1000, "closeColl took %.1f ms", ms);
  free(shard);
  free(rows);
  return 0;
}

/* Close with requests in flight: prompt, and nothing left behind that the process did not
 * already hold after its first connection. */
static int fault_abort(void) {
  static char fd0[8192], fd1[8192], added[400];
  conn_pair cp;
  /* The first connection brings up what a process keeps for good: Go's network poller
   * (an epoll and an eventfd descriptor, made on the library's first listen). */
  if (connect_pair("fault-abort-warmup", &cp) != 0) {
    case_result("fault/abort-connect", 0, "could not connect");
    return 1;
  }
  close_pair(&cp);
  fd_targets(fd0, sizeof(fd0));
  int fds0 = count_fds();
  if (connect_pair("fault-abort", &cp) != 0) {
    case_result("fault/abort-connect", 0, "could not connect");
    return 1;
  }
  enum { N = 8 };
  size_t n = 1 << 20;
  uint8_t* buf = malloc(N * n);
  void *rmh = NULL, *smh = NULL;
  R.net->regMr(cp.recv, buf, N * n, NCCL_PTR_HOST, &rmh);
  R.net->regMr(cp.send, buf, N * n, NCCL_PTR_HOST, &smh);
  int posted = 0;
  for (int i = 0; i < N; i++) {
    void* data[1] = {buf + (size_t)i * n};
    size_t sizes[1] = {n};
    int tags[1] = {1}; /* the peer sends nothing: these never complete */
    void* mhs[1] = {rmh};
    void* req = NULL;
    R.net->irecv(cp.recv, 1, data, sizes, tags, mhs, NULL, &req);
    posted += req != NULL;
  }
  barrier("abort-posted");
  uint64_t t0 = now_ns();
  R.net->deregMr(cp.recv, rmh);
  R.net->deregMr(cp.send, smh);
  close_pair(&cp);
  double ms = (double)(now_ns() - t0) / 1e6;
  barrier("abort-closed");
  int fds1 = count_fds();
  fd_targets(fd1, sizeof(fd1));
  fd_new(fd0, fd1, added, sizeof(added));
  case_result("fault/abort-with-requests-in-flight", ms < 1000 && fds1 == fds0,
              "%d receives in flight, closed in %.1f ms; descriptors %d before connecting, %d after closing%s%s",
              posted, ms, fds0, fds1, added[0] ? ": new " : "", added);
  free(buf);
  return 0;
}

static long count_threads(void) {
  DIR* d = opendir("/proc/self/task");
  long n = 0;
  if (d == NULL) return -1;
  for (struct dirent* e; (e = readdir(d)) != NULL;) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

/* One message each way on a connected pair. */
static int ping(conn_pair* cp, uint8_t* sbuf, uint8_t* rbuf, void* smh, void* rmh, int tag) {
  void *sreq = NULL, *rreq = NULL;
  void* data[1] = {rbuf};
  size_t sizes[1] = {64};
  int tags[1] = {tag};
  void* mhs[1] = {rmh};
  uint64_t t0 = now_ns();
  while (rreq == NULL && now_ns() - t0 < 10000000000ull)
    if (R.net->irecv(cp->recv, 1, data, sizes, tags, mhs, NULL, &rreq) != ncclSuccess) return -1;
  while (sreq == NULL && now_ns() - t0 < 10000000000ull)
    if (R.net->isend(cp->send, sbuf, 64, tag, smh, NULL, &sreq) != ncclSuccess) return -1;
  if (rreq == NULL || sreq == NULL) return -1;
  return test_until_done("isend", sreq, NULL, net_test) || test_until_done("irecv", rreq, NULL, net_test);
}

/* Nine connections at once hold no more threads than one: a fabric with a thread per
 * connection or per lane shows eight or more new ones. */
static int threads_per_connection(void) {
  enum { N = 9 };
  static uint8_t sbuf[N][64], rbuf[N][64];
  conn_pair cp[N];
  void *smh[N], *rmh[N];
  long one = -1;
  int ok = 1, made = 0;
  for (int i = 0; i < N && ok; i++) {
    char tag[32];
    snprintf(tag, sizeof(tag), "threads-%d", i);
    ok = connect_pair(tag, &cp[i]) == 0;
    if (!ok) break;
    made++;
    ok = R.net->regMr(cp[i].send, sbuf[i], 64, NCCL_PTR_HOST, &smh[i]) == ncclSuccess &&
         R.net->regMr(cp[i].recv, rbuf[i], 64, NCCL_PTR_HOST, &rmh[i]) == ncclSuccess &&
         ping(&cp[i], sbuf[i], rbuf[i], smh[i], rmh[i], i) == 0;
    if (i == 0) one = count_threads();
  }
  long nine = count_threads();
  case_result("threads/none-per-connection", ok && nine <= one + 2,
              "%ld threads with one connection, %ld with %d (messages %s)", one, nine, made, ok ? "delivered" : "failed");
  barrier("threads-counted");
  for (int i = 0; i < made; i++) {
    R.net->deregMr(cp[i].send, smh[i]);
    R.net->deregMr(cp[i].recv, rmh[i]);
    close_pair(&cp[i]);
  }
  return ok ? 0 : 1;
}

int suite_fault(const char* which) {
  if (strcmp(which, "fault-threads") == 0) return threads_per_connection();
  if (strcmp(which, "fault-p2p") == 0) return fault_p2p();
  if (strcmp(which, "fault-gather") == 0) return fault_gather(0);
  if (strcmp(which, "fault-stall") == 0) return fault_gather(1);
  if (strcmp(which, "fault-abort") == 0) return fault_abort();
  fprintf(stderr, "[%s] unknown fault suite %s\n", driver_tag, which);
  return 2;
}
