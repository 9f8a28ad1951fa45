/* plugincheck bench: what the net costs on the hot path, each figure beside the wire's
 * own floor measured between the same two processes in the same run (floor.h). */
#include <malloc.h>
#include <stdlib.h>
#include <string.h>
#include "floor.h"
#include "rank.h"

/* Receive slots of the ping-pong, each large enough for its biggest message. */
#define SLOT_BYTES ((size_t)64 << 10)
enum { TAG_IDLE = 1, TAG_PINGPONG = 2, TAG_BANDWIDTH = 3 };

static int net_test(void* req, int* done, int* sizes) { return R.net->test(req, done, sizes); }

/* One row: BENCH {"name":…,"value":…,"unit":…,"floor":…,"how":…}; floor 0 means none. */
static void bench_row(const char* name, double value, const char* unit, double floor, const char* how) {
  printf("BENCH {\"name\":");
  json_string(stdout, name);
  printf(",\"value\":%.4f,\"unit\":", value);
  json_string(stdout, unit);
  printf(",\"floor\":%.4f,\"how\":", floor);
  json_string(stdout, how);
  printf("}\n");
  fflush(stdout);
}

static size_t heap_in_use(void) { return mallinfo2().uordblks; }

static int post_recv(conn_pair* cp, reg_bufs* b, int slot, size_t size, int tag, void** req) {
  void* data[1] = {b->recv + (size_t)slot * SLOT_BYTES};
  size_t sizes[1] = {size};
  int tags[1] = {tag};
  void* mh[1] = {b->rmh};
  uint64_t start = now_ns();
  *req = NULL;
  while (*req == NULL) {
    if (R.net->irecv(cp->recv, 1, data, sizes, tags, mh, NULL, req) != ncclSuccess) return -1;
    if (now_ns() - start > (uint64_t)R.timeout_s * 1000000000ull) return -1;
  }
  return 0;
}

static int send_one(conn_pair* cp, reg_bufs* b, size_t size, int tag) {
  void* req = NULL;
  uint64_t start = now_ns();
  while (req == NULL) {
    if (R.net->isend(cp->send, b->send, size, tag, b->smh, NULL, &req) != ncclSuccess) return -1;
    if (now_ns() - start > (uint64_t)R.timeout_s * 1000000000ull) return -1;
  }
  return test_until_done("isend", req, NULL, net_test);
}

/* test() on a receive whose message has not been sent: the cost NCCL's proxy pays on
 * every poll of an idle connection. */
static void bench_idle_test(conn_pair* cp, reg_bufs* b) {
  enum { CALLS = 2000000 };
  if (R.rank == 1) {
    void* req = NULL;
    if (post_recv(cp, b, 0, 8, TAG_IDLE, &req) != 0) {
      case_result("bench/idle-test", 0, "irecv failed");
      barrier("idle-done");
      return;
    }
    int done = 0;
    for (int i = 0; i < 10000; i++) R.net->test(req, &done, NULL); /* warm */
    /* heap_in_use counts every thread's malloc, and another thread of the process can
     * allocate once during a window (seen: 2,912 bytes under load, with no new thread; one
     * more thread came with 3,216 bytes more heap). A leak in test() grows every window; a
     * window that grew is taken again, at most twice, and its growth is told. */
    enum { WINDOWS = 3 };
    size_t heap0, heap1, retaken_growth[WINDOWS];
    uint64_t t0, t1;
    int w = 0;
    for (;;) {
      heap0 = heap_in_use();
      t0 = now_ns();
      for (int i = 0; i < CALLS && !done; i++) R.net->test(req, &done, NULL);
      t1 = now_ns();
      heap1 = heap_in_use();
      if (heap1 <= heap0 || w == WINDOWS - 1 || done) break;
      retaken_growth[w++] = heap1 - heap0;
    }
    char grew[64] = "none";
    for (int i = 0, at = 0; i < w; i++)
      at += snprintf(grew + at, sizeof(grew) - (size_t)at, "%s%zu", i ? ", " : "", retaken_growth[i]);
    char how[220];
    snprintf(how, sizeof(how),
             "%d calls on a receive nothing was sent to; heap bytes in use before %zu, after %zu; "
             "growth of the windows taken again: %s",
             CALLS, heap0, heap1, grew);
    bench_row("test-nothing-complete", (double)(t1 - t0) / CALLS, "ns/call", 0, how);
    bench_row("test-heap-growth", (double)heap1 - (double)heap0, "bytes", 0, "heap growth over those calls");
    barrier("idle-done");
    test_until_done("irecv", req, NULL, net_test);
  } else {
    barrier("idle-done");
    send_one(cp, b, 8, TAG_IDLE);
  }
}

/* Messages of one size bounced between the ranks: rank 0 sends message k+1 as soon as the
 * echo of message k is in. Receives are posted two ahead, as NCCL's proxy posts them
 * ahead of the data, so a clear-to-send is never what a message waits for. Rank 0 times
 * `rounds` round trips; each message carries its number in its first byte. */
static int pingpong(conn_pair* cp, reg_bufs* b, size_t size, int rounds, double* us, long* heap_growth) {
  int warm = rounds / 10, total = warm + rounds;
  void* req[2] = {NULL, NULL};
  for (int k = 0; k < 2; k++)
    if (post_recv(cp, b, k, size, TAG_PINGPONG, &req[k]) != 0) return -1;
  if (barrier("pingpong-start") != 0) return -1;
  uint64_t t0 = now_ns();
  size_t heap0 = heap_in_use();
  if (R.rank == 0) {
    b->send[0] = 0;
    if (send_one(cp, b, size, TAG_PINGPONG) != 0) return -1;
  }
  for (int k = 0; k < total; k++) {
    int got = -1;
    if (test_until_done("irecv", req[k % 2], &got, net_test) != 0) return -1;
    const uint8_t* msg = b->recv + (size_t)(k % 2) * SLOT_BYTES;
    if (got != (int)size || msg[0] != (uint8_t)k) {
      fprintf(stderr, "[%s] ping-pong message %d of %zu bytes: received %d bytes starting with %u\n", driver_tag, k,
              size, got, msg[0]);
      return -1;
    }
    int next = R.rank == 0 ? k + 1 : k; /* rank 1 echoes message k */
    if (next < total) {
      if (R.rank == 0 && next == warm) t0 = now_ns(), heap0 = heap_in_use();
      b->send[0] = (uint8_t)next;
      if (send_one(cp, b, size, TAG_PINGPONG) != 0) return -1;
    }
    if (k + 2 < total && post_recv(cp, b, k % 2, size, TAG_PINGPONG, &req[k % 2]) != 0) return -1;
  }
  *us = (double)(now_ns() - t0) / rounds / 2 / 1e3;
  *heap_growth = (long)heap_in_use() - (long)heap0;
  return 0;
}

/* 64 MiB messages from rank 0 to rank 1, four in flight; rank 1 times them. */
static int bandwidth(conn_pair* cp, double* gbps) {
  enum { MSGS = 24, DEPTH = 4 };
  size_t n = FLOOR_STREAM_BYTES;
  uint8_t* buf = malloc(n * DEPTH);
  void* mh = NULL;
  void* comm = R.rank == 0 ? cp->send : cp->recv;
  int rc = buf == NULL || R.net->regMr(comm, buf, n * DEPTH, NCCL_PTR_HOST, &mh) != ncclSuccess;
  if (!rc) memset(buf, 0x5a, n * DEPTH);
  int32_t mine = rc, peer = 0;
  if (exchange("bw-start", &mine, &peer, sizeof(mine)) != 0 || peer) rc = 1;
  uint64_t t0 = now_ns();
  void* req[DEPTH] = {0};
  for (int m = 0; m < MSGS + DEPTH && !rc; m++) {
    int slot = m % DEPTH;
    if (req[slot] != NULL && test_until_done("bandwidth", req[slot], NULL, net_test) != 0) rc = 1;
    req[slot] = NULL;
    if (m >= MSGS || rc) continue;
    void* p = buf + (size_t)slot * n;
    while (req[slot] == NULL && !rc) {
      if (R.rank == 0) rc = R.net->isend(cp->send, p, n, TAG_BANDWIDTH, mh, NULL, &req[slot]) != ncclSuccess;
      else {
        size_t sizes[1] = {n};
        int tags[1] = {TAG_BANDWIDTH};
        void* mhs[1] = {mh};
        rc = R.net->irecv(cp->recv, 1, &p, sizes, tags, mhs, NULL, &req[slot]) != ncclSuccess;
      }
    }
  }
  *gbps = (double)MSGS * (double)n / (double)(now_ns() - t0);
  barrier("bw-done");
  if (mh != NULL) R.net->deregMr(comm, mh);
  free(buf);
  return rc;
}

static const char* size_name(size_t n) {
  switch (n) {
  case 8:
    return "8B";
  case 4096:
    return "4KiB";
  case 65536:
    return "64KiB";
  default:
    return "?";
  }
}

static int measure_floor(floor_result* fl) {
  ncclNetProperties_v12_t props;
  memset(&props, 0, sizeof(props));
  if (R.net->getProperties(0, &props) != ncclSuccess || props.name == NULL) {
    snprintf(fl->how, sizeof(fl->how), "the net's device 0 has no properties");
    return -1;
  }
  if (strncmp(props.name, "tcp-", 4) == 0) return floor_tcp(props.name + 4, fl);
  return floor_verbs(props.name, fl);
}

int suite_bench(void) {
  floor_result fl;
  int have_floor = measure_floor(&fl) == 0;
  if (!have_floor) case_result("bench/floor", 0, "%s", fl.how);
  conn_pair cp;
  if (connect_pair("bench", &cp) != 0) {
    case_result("bench/connect", 0, "could not connect the two ranks");
    return 1;
  }
  reg_bufs b;
  if (reg_bufs_open(&cp, 2 * SLOT_BYTES, &b) != 0) {
    case_result("bench/register", 0, "regMr of two 128 KiB host buffers failed");
    close_pair(&cp);
    return 1;
  }
  memset(b.send, 1, 2 * SLOT_BYTES);
  bench_idle_test(&cp, &b);
  for (int i = 0; i < FLOOR_SIZES; i++) {
    double us = 0;
    long growth = 0;
    char name[64], how[400];
    snprintf(name, sizeof(name), "p2p-oneway-%s", size_name(floor_sizes[i]));
    if (pingpong(&cp, &b, floor_sizes[i], floor_rounds[i], &us, &growth) != 0) {
      case_result(name, 0, "the ping-pong failed");
      break;
    }
    snprintf(how, sizeof(how),
             "isend+irecv+test, %d round trips, half of each, receives posted two ahead; heap growth %ld bytes; "
             "floor: %s",
             floor_rounds[i], growth, have_floor ? fl.how : "none");
    if (R.rank == 0) bench_row(name, us, "us", have_floor ? fl.oneway_us[i] : 0, how);
  }
  double gbps = 0;
  if (bandwidth(&cp, &gbps) != 0) case_result("p2p-bandwidth-64MiB", 0, "the transfers failed");
  else if (R.rank == 1) {
    char how[400];
    snprintf(how, sizeof(how), "24 messages of 64 MiB, 4 in flight; floor: %s", have_floor ? fl.how : "none");
    bench_row("p2p-bandwidth-64MiB", gbps, "GB/s", have_floor ? fl.stream_gbps : 0, how);
  }
  reg_bufs_close(&cp, &b);
  close_pair(&cp);
  return 0;
}
