/* plugincheck bench: what a call costs on the hot path, over the local fabric. */
#include <malloc.h>
#include <stdlib.h>
#include <string.h>
#include "rank.h"

static int net_test(void* req, int* done, int* sizes) { return R.net->test(req, done, sizes); }

static void bench_line(const char* name, double value, const char* unit, const char* detail) {
  printf("BENCH %s %.3f %s %s\n", name, value, unit, detail);
  fflush(stdout);
}

static size_t heap_in_use(void) { return mallinfo2().uordblks; }

/* test() on a receive whose message has not been sent: the cost NCCL's proxy pays on
 * every poll of an idle connection. */
static void bench_idle_test(conn_pair* cp, uint8_t* rbuf, void* rmh, uint8_t* sbuf, void* smh) {
  enum { CALLS = 2000000 };
  if (R.rank == 1) {
    void* data[1] = {rbuf};
    size_t sizes[1] = {8};
    int tags[1] = {1};
    void* mh[1] = {rmh};
    void* req = NULL;
    while (req == NULL) R.net->irecv(cp->recv, 1, data, sizes, tags, mh, NULL, &req);
    int done = 0;
    for (int i = 0; i < 10000; i++) R.net->test(req, &done, NULL); /* warm */
    size_t heap0 = heap_in_use();
    uint64_t t0 = now_ns();
    for (int i = 0; i < CALLS && !done; i++) R.net->test(req, &done, NULL);
    uint64_t t1 = now_ns();
    size_t heap1 = heap_in_use();
    char detail[160];
    snprintf(detail, sizeof(detail), "%d calls; heap bytes in use before %zu, after %zu", CALLS, heap0, heap1);
    bench_line("test-nothing-complete", (double)(t1 - t0) / CALLS, "ns/call", detail);
    bench_line("test-heap-growth", (double)heap1 - (double)heap0, "bytes", "heap growth over those calls");
    barrier("idle-done");
    test_until_done("irecv", req, NULL, net_test);
  } else {
    barrier("idle-done");
    void* req = NULL;
    while (req == NULL) R.net->isend(cp->send, sbuf, 8, 1, smh, NULL, &req);
    test_until_done("isend", req, NULL, net_test);
  }
}

/* 8-byte ping-pong: isend, irecv and test to completion, both directions. */
static void bench_pingpong(conn_pair* cp, uint8_t* rbuf, void* rmh, uint8_t* sbuf, void* smh) {
  enum { ROUNDS = 20000, WARM = 1000 };
  void* data[1] = {rbuf};
  size_t sizes[1] = {8};
  int tags[1] = {2};
  void* mh[1] = {rmh};
  uint64_t t0 = 0;
  size_t heap0 = 0;
  for (int i = 0; i < ROUNDS + WARM; i++) {
    if (i == WARM) {
      barrier("pingpong-warm");
      heap0 = heap_in_use();
      t0 = now_ns();
    }
    void *s = NULL, *r = NULL;
    if (R.rank == 0) {
      while (s == NULL) R.net->isend(cp->send, sbuf, 8, 2, smh, NULL, &s);
      while (r == NULL) R.net->irecv(cp->recv, 1, data, sizes, tags, mh, NULL, &r);
      test_until_done("isend", s, NULL, net_test);
      test_until_done("irecv", r, NULL, net_test);
    } else {
      while (r == NULL) R.net->irecv(cp->recv, 1, data, sizes, tags, mh, NULL, &r);
      test_until_done("irecv", r, NULL, net_test);
      while (s == NULL) R.net->isend(cp->send, sbuf, 8, 2, smh, NULL, &s);
      test_until_done("isend", s, NULL, net_test);
    }
  }
  uint64_t t1 = now_ns();
  size_t heap1 = heap_in_use();
  if (R.rank == 0) {
    char detail[160];
    snprintf(detail, sizeof(detail), "%d round trips, half of each; heap growth %ld bytes", ROUNDS,
             (long)heap1 - (long)heap0);
    bench_line("8B-isend-irecv-test", (double)(t1 - t0) / ROUNDS / 2 / 1e3, "us/message", detail);
  }
}

/* 64 MiB messages from rank 0 to rank 1, four in flight. */
static void bench_bandwidth(conn_pair* cp) {
  enum { MSGS = 24, DEPTH = 4 };
  size_t n = 64u << 20;
  uint8_t* buf = malloc(n * DEPTH);
  memset(buf, 0x5a, n * DEPTH);
  void* mh = NULL;
  void* comm = R.rank == 0 ? cp->send : cp->recv;
  R.net->regMr(comm, buf, n * DEPTH, NCCL_PTR_HOST, &mh);
  barrier("bw-start");
  uint64_t t0 = now_ns();
  void* req[DEPTH] = {0};
  for (int m = 0; m < MSGS + DEPTH; m++) {
    int slot = m % DEPTH;
    if (req[slot] != NULL) test_until_done("bandwidth", req[slot], NULL, net_test), req[slot] = NULL;
    if (m >= MSGS) continue;
    void* p = buf + (size_t)slot * n;
    while (req[slot] == NULL) {
      if (R.rank == 0) R.net->isend(cp->send, p, n, 3, mh, NULL, &req[slot]);
      else {
        size_t sizes[1] = {n};
        int tags[1] = {3};
        void* mhs[1] = {mh};
        R.net->irecv(cp->recv, 1, &p, sizes, tags, mhs, NULL, &req[slot]);
      }
    }
  }
  uint64_t t1 = now_ns();
  barrier("bw-done");
  if (R.rank == 1) {
    char detail[128];
    snprintf(detail, sizeof(detail), "%d messages of 64 MiB, %d in flight", MSGS, DEPTH);
    bench_line("p2p-bandwidth-64MiB", (double)MSGS * (double)n / (double)(t1 - t0), "GB/s", detail);
  }
  R.net->deregMr(comm, mh);
  free(buf);
}

int suite_bench(void) {
  conn_pair cp;
  if (connect_pair("bench", &cp) != 0) {
    case_result("bench/connect", 0, "could not connect the two ranks");
    return 1;
  }
  reg_bufs b;
  if (reg_bufs_open(&cp, 4096, &b) != 0) {
    case_result("bench/register", 0, "regMr of two 4 KiB host buffers failed");
    close_pair(&cp);
    return 1;
  }
  memset(b.send, 1, 4096);
  bench_idle_test(&cp, b.recv, b.rmh, b.send, b.smh);
  bench_pingpong(&cp, b.recv, b.rmh, b.send, b.smh);
  bench_bandwidth(&cp);
  reg_bufs_close(&cp, &b);
  close_pair(&cp);
  return 0;
}
