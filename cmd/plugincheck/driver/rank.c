/* One rank of a two-rank run: set-up shared by the suites, and the p2p suite, which
 * drives the net the way NCCL's proxy does and checks every byte. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "rank.h"

rank_env R;

static int case_failures, case_passes;

void case_result(const char* name, int ok, const char* fmt, ...) {
  char detail[600] = "";
  if (fmt) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof(detail), fmt, ap);
    va_end(ap);
  }
  if (ok) case_passes++;
  else case_failures++;
  printf("CASE %s %s %s\n", name, ok ? "PASS" : "FAIL", detail);
  fflush(stdout);
}

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

/* Returns the first offset where b differs from the pattern, or -1. */
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

int test_until_done(const char* what, void* req, int* sizes, int (*test)(void*, int*, int*)) {
  uint64_t start = now_ns();
  for (;;) {
    int done = 0;
    int r = test(req, &done, sizes);
    if (r != ncclSuccess) {
      fprintf(stderr, "[%s] test of %s returned %d\n", driver_tag, what, r);
      return r;
    }
    if (done) return 0;
    if (now_ns() - start > (uint64_t)R.timeout_s * 1000000000ull) {
      fprintf(stderr, "[%s] %s did not complete within %d s\n", driver_tag, what, R.timeout_s);
      return -1;
    }
  }
}

static int net_test(void* req, int* done, int* sizes) { return R.net->test(req, done, sizes); }

int two_sided_net(void) {
  ncclNetProperties_v12_t props;
  memset(&props, 0, sizeof(props));
  return R.net->getProperties(0, &props) == ncclSuccess && props.name != NULL && strncmp(props.name, "tcp-", 4) == 0;
}

int connect_pair(const char* tag, conn_pair* cp) {
  uint8_t mine[NCCL_NET_HANDLE_MAXSIZE], peers[NCCL_NET_HANDLE_MAXSIZE];
  void* listen = NULL;
  memset(cp, 0, sizeof(*cp));
  if (R.net->listen(R.netctx, 0, mine, &listen) != ncclSuccess || listen == NULL) {
    fprintf(stderr, "[%s] listen failed\n", driver_tag);
    return -1;
  }
  if (exchange(tag, mine, peers, sizeof(peers)) != 0) return -1;
  ncclNetDeviceHandle_v12_t* dev = NULL;
  uint64_t start = now_ns();
  /* NCCL passes the same handle on every retry and spins until both comms exist. */
  while (cp->send == NULL || cp->recv == NULL) {
    if (cp->send == NULL) {
      if (R.net->connect(R.netctx, 0, peers, &cp->send, &dev) != ncclSuccess) return -1;
      if (cp->send == NULL) cp->connect_retries++;
    }
    if (cp->recv == NULL) {
      if (R.net->accept(listen, &cp->recv, &dev) != ncclSuccess) return -1;
      if (cp->recv == NULL) cp->accept_retries++;
    }
    if (now_ns() - start > (uint64_t)R.timeout_s * 1000000000ull) {
      fprintf(stderr, "[%s] connect/accept did not finish within %d s\n", driver_tag, R.timeout_s);
      return -1;
    }
    if (cp->send == NULL || cp->recv == NULL) usleep(50);
  }
  R.net->closeListen(listen);
  return 0;
}

void close_pair(conn_pair* cp) {
  if (cp->send) R.net->closeSend(cp->send);
  if (cp->recv) R.net->closeRecv(cp->recv);
  cp->send = cp->recv = NULL;
}

int reg_bufs_open(conn_pair* cp, size_t n, reg_bufs* b) {
  *b = (reg_bufs){.send = malloc(n), .recv = malloc(n)};
  if (b->send != NULL && b->recv != NULL &&
      R.net->regMr(cp->send, b->send, n, NCCL_PTR_HOST, &b->smh) == ncclSuccess &&
      R.net->regMr(cp->recv, b->recv, n, NCCL_PTR_HOST, &b->rmh) == ncclSuccess)
    return 0;
  reg_bufs_close(cp, b);
  return -1;
}

void reg_bufs_close(conn_pair* cp, reg_bufs* b) {
  if (b->smh) R.net->deregMr(cp->send, b->smh);
  if (b->rmh) R.net->deregMr(cp->recv, b->rmh);
  free(b->send);
  free(b->recv);
  *b = (reg_bufs){0};
}

/* Both ranks send one message to each other at once; returns the size the receive saw. */
static int exchange_message(conn_pair* cp, const uint8_t* sbuf, size_t ssize, void* smh, uint8_t* rbuf, size_t rsize,
                            void* rmh, int tag, int* got) {
  void *sreq = NULL, *rreq = NULL;
  void* data[1] = {rbuf};
  size_t sizes[1] = {rsize};
  int tags[1] = {tag};
  void* mh[1] = {rmh};
  uint64_t start = now_ns();
  while (rreq == NULL) {
    if (R.net->irecv(cp->recv, 1, data, sizes, tags, mh, NULL, &rreq) != ncclSuccess) return -1;
    if (now_ns() - start > (uint64_t)R.timeout_s * 1000000000ull) return -1;
  }
  while (sreq == NULL) {
    if (R.net->isend(cp->send, (void*)sbuf, ssize, tag, smh, NULL, &sreq) != ncclSuccess) return -1;
    if (now_ns() - start > (uint64_t)R.timeout_s * 1000000000ull) return -1;
  }
  int ssz = -1;
  if (test_until_done("isend", sreq, &ssz, net_test) != 0) return -1;
  if (test_until_done("irecv", rreq, got, net_test) != 0) return -1;
  if (ssz != (int)ssize) {
    fprintf(stderr, "[%s] isend reported %d bytes, sent %zu\n", driver_tag, ssz, ssize);
    return -1;
  }
  return 0;
}

static void case_sizes(conn_pair* cp) {
  static const size_t sizes[] = {0, 1, 7, 8, 100, 4096, 65536, 1 << 20, 4 << 20, 64 << 20};
  size_t maxsz = 64 << 20;
  reg_bufs b;
  if (reg_bufs_open(cp, maxsz, &b) != 0) {
    case_result("p2p/register", 0, "regMr of two 64 MiB host buffers failed");
    return;
  }
  uint8_t *sbuf = b.send, *rbuf = b.recv;
  void *smh = b.smh, *rmh = b.rmh;
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    size_t n = sizes[i];
    char name[64];
    snprintf(name, sizeof(name), "p2p/size-%zu", n);
    fill_pattern(sbuf, n, 1000 + n * 2 + (uint64_t)R.rank);
    memset(rbuf, 0xEE, n + 16 < maxsz ? n + 16 : maxsz);
    int got = -1;
    uint64_t t0 = now_ns();
    if (exchange_message(cp, sbuf, n, smh, rbuf, maxsz, rmh, 7, &got) != 0) {
      case_result(name, 0, "transfer failed");
      continue;
    }
    double us = (double)(now_ns() - t0) / 1e3;
    long bad = check_pattern(rbuf, n, 1000 + n * 2 + (uint64_t)(1 - R.rank));
    int tail_ok = n + 16 > maxsz || rbuf[n] == 0xEE;
    char where[64] = "";
    if (bad >= 0) snprintf(where, sizeof(where), ", first wrong byte at %ld", bad);
    else if (!tail_ok) snprintf(where, sizeof(where), ", a byte past the message was written");
    case_result(name, got == (int)n && bad < 0 && tail_ok, "received %d of %zu bytes%s, %.0f us", got, n, where, us);
  }
  /* A receive buffer larger than the message: the actual size comes back, nothing more is written. */
  fill_pattern(sbuf, 1000, 77 + (uint64_t)R.rank);
  memset(rbuf, 0xEE, 1 << 20);
  int got = -1;
  int ok = exchange_message(cp, sbuf, 1000, smh, rbuf, 1 << 20, rmh, 3, &got) == 0;
  ok = ok && got == 1000 && check_pattern(rbuf, 1000, 77 + (uint64_t)(1 - R.rank)) < 0 && rbuf[1000] == 0xEE &&
       rbuf[(1 << 20) - 1] == 0xEE;
  case_result("p2p/recv-larger-than-send", ok, "1000-byte message into a 1 MiB buffer: test reported %d", got);
  reg_bufs_close(cp, &b);
}

/* One irecv of 8 buffers with distinct tags, filled by 8 sends issued in another order. */
static void case_multi_recv(conn_pair* cp) {
  enum { N = 8 };
  size_t bsz = 8192;
  reg_bufs b;
  if (reg_bufs_open(cp, N * bsz, &b) != 0) {
    case_result("p2p/register", 0, "regMr of two 64 KiB host buffers failed");
    return;
  }
  uint8_t *sbuf = b.send, *rbuf = b.recv;
  void *smh = b.smh, *rmh = b.rmh;
  void* data[N];
  size_t sizes[N];
  int tags[N];
  void* mh[N];
  for (int i = 0; i < N; i++) {
    data[i] = rbuf + (size_t)i * bsz;
    sizes[i] = bsz;
    tags[i] = 100 + i;
    mh[i] = rmh;
  }
  memset(rbuf, 0xEE, N * bsz);
  void* rreq = NULL;
  int ok = 1;
  while (rreq == NULL && ok) ok = R.net->irecv(cp->recv, N, data, sizes, tags, mh, NULL, &rreq) == ncclSuccess;
  void* sreq[N] = {0};
  /* Send tag 107 first, then 100..106; message i is 1000+i*100 bytes. */
  for (int k = 0; k < N && ok; k++) {
    int i = (k + N - 1) % N;
    size_t len = 1000 + (size_t)i * 100;
    fill_pattern(sbuf + (size_t)i * bsz, len, 500 + (uint64_t)i + 16 * (uint64_t)R.rank);
    while (sreq[i] == NULL && ok)
      ok = R.net->isend(cp->send, sbuf + (size_t)i * bsz, len, 100 + i, smh, NULL, &sreq[i]) == ncclSuccess;
  }
  for (int i = 0; i < N && ok; i++) ok = test_until_done("isend", sreq[i], NULL, net_test) == 0;
  int got[N];
  memset(got, -1, sizeof(got));
  ok = ok && test_until_done("irecv", rreq, got, net_test) == 0;
  char detail[256] = "";
  for (int i = 0; i < N && ok; i++) {
    size_t len = 1000 + (size_t)i * 100;
    if (got[i] != (int)len || check_pattern(rbuf + (size_t)i * bsz, len, 500 + (uint64_t)i + 16 * (uint64_t)(1 - R.rank)) >= 0) {
      snprintf(detail, sizeof(detail), "buffer %d (tag %d): size %d, expected %zu or bytes differ", i, 100 + i, got[i],
               len);
      ok = 0;
    }
  }
  case_result("p2p/multi-recv-8-tags", ok, "%s", ok ? "8 buffers matched by tag, sent out of order" : detail);
  reg_bufs_close(cp, &b);
}

/* A send whose tag belongs to a receive not yet posted is refused without error (no
 * request, NCCL retries) until that receive comes; then it is delivered where it belongs. */
static void case_send_ahead_of_its_receive(conn_pair* cp) {
  size_t bsz = 4096;
  reg_bufs b;
  if (reg_bufs_open(cp, 2 * bsz, &b) != 0) {
    case_result("p2p/register", 0, "regMr of two 8 KiB host buffers failed");
    return;
  }
  uint8_t *sbuf = b.send, *rbuf = b.recv;
  void *smh = b.smh, *rmh = b.rmh;
  int ok = 1;
  char detail[160] = "";
  fill_pattern(sbuf, bsz, 900 + (uint64_t)R.rank);
  fill_pattern(sbuf + bsz, bsz, 950 + (uint64_t)R.rank);
  memset(rbuf, 0xEE, 2 * bsz);
  void* data[1] = {rbuf};
  size_t sizes[1] = {bsz};
  int tag8[1] = {8}, tag9[1] = {9};
  void* mh[1] = {rmh};
  void *r8 = NULL, *r9 = NULL, *s8 = NULL, *s9 = NULL;
  while (ok && r8 == NULL) ok = R.net->irecv(cp->recv, 1, data, sizes, tag8, mh, NULL, &r8) == ncclSuccess;
  if (two_sided_net()) {
    /* The tcp fabric takes the early send at once; its lane holds it until its receive exists. */
    while (ok && s9 == NULL) ok = R.net->isend(cp->send, sbuf + bsz, bsz, 9, smh, NULL, &s9) == ncclSuccess;
  } else {
    /* The peer's receive for tag 8 is at the head; tag 9 must wait, for 200 ms of retries. */
    for (uint64_t t0 = now_ns(); ok && now_ns() - t0 < 200000000ull;) {
      int r = R.net->isend(cp->send, sbuf + bsz, bsz, 9, smh, NULL, &s9);
      if (r != ncclSuccess || s9 != NULL) {
        snprintf(detail, sizeof(detail), "isend of tag 9 before its receive returned %d with %s request", r,
                 s9 ? "a" : "no");
        ok = 0;
      }
    }
  }
  while (ok && s8 == NULL) ok = R.net->isend(cp->send, sbuf, bsz, 8, smh, NULL, &s8) == ncclSuccess;
  data[0] = rbuf + bsz;
  while (ok && r9 == NULL) ok = R.net->irecv(cp->recv, 1, data, sizes, tag9, mh, NULL, &r9) == ncclSuccess;
  while (ok && s9 == NULL) ok = R.net->isend(cp->send, sbuf + bsz, bsz, 9, smh, NULL, &s9) == ncclSuccess;
  int got8 = -1, got9 = -1;
  ok = ok && test_until_done("isend tag 8", s8, NULL, net_test) == 0 &&
       test_until_done("isend tag 9", s9, NULL, net_test) == 0 && test_until_done("irecv tag 8", r8, &got8, net_test) == 0 &&
       test_until_done("irecv tag 9", r9, &got9, net_test) == 0;
  if (ok && (got8 != (int)bsz || got9 != (int)bsz || check_pattern(rbuf, bsz, 900 + (uint64_t)(1 - R.rank)) >= 0 ||
             check_pattern(rbuf + bsz, bsz, 950 + (uint64_t)(1 - R.rank)) >= 0)) {
    snprintf(detail, sizeof(detail), "tag 8 got %d bytes, tag 9 got %d; expected %zu each with the peer's bytes", got8,
             got9, bsz);
    ok = 0;
  }
  case_result("p2p/send-ahead-of-its-receive", ok, "%s",
              !ok ? detail
              : two_sided_net() ? "the early send was taken at once and landed by its tag"
                                : "the early send waited, then landed by its tag");
  reg_bufs_close(cp, &b);
}

/* 256 receives posted before any send, then 256 sends, all outstanding at once. */
static void case_outstanding(conn_pair* cp) {
  enum { N = 256 };
  size_t bsz = 512;
  reg_bufs b;
  if (reg_bufs_open(cp, N * bsz, &b) != 0) {
    case_result("p2p/register", 0, "regMr of two 128 KiB host buffers failed");
    return;
  }
  uint8_t *sbuf = b.send, *rbuf = b.recv;
  void *smh = b.smh, *rmh = b.rmh;
  void* rreq[N] = {0};
  void* sreq[N] = {0};
  int ok = 1, posted_recv = 0;
  for (int i = 0; i < N && ok; i++) {
    void* data[1] = {rbuf + (size_t)i * bsz};
    size_t sizes[1] = {bsz};
    int tags[1] = {i};
    void* mh[1] = {rmh};
    ok = R.net->irecv(cp->recv, 1, data, sizes, tags, mh, NULL, &rreq[i]) == ncclSuccess && rreq[i] != NULL;
    posted_recv += ok;
  }
  barrier("outstanding-recvs");
  int posted_send = 0;
  for (int i = 0; i < N && ok; i++) {
    fill_pattern(sbuf + (size_t)i * bsz, bsz, 9000 + (uint64_t)i * 2 + (uint64_t)R.rank);
    uint64_t start = now_ns();
    while (sreq[i] == NULL && ok) {
      ok = R.net->isend(cp->send, sbuf + (size_t)i * bsz, bsz, i, smh, NULL, &sreq[i]) == ncclSuccess;
      if (now_ns() - start > (uint64_t)R.timeout_s * 1000000000ull) ok = 0;
    }
    posted_send += ok;
  }
  for (int i = 0; i < N && ok; i++) ok = test_until_done("isend", sreq[i], NULL, net_test) == 0;
  int bad = -1;
  for (int i = 0; i < N && ok; i++) {
    int got = -1;
    ok = test_until_done("irecv", rreq[i], &got, net_test) == 0;
    if (ok && (got != (int)bsz || check_pattern(rbuf + (size_t)i * bsz, bsz, 9000 + (uint64_t)i * 2 + (uint64_t)(1 - R.rank)) >= 0)) {
      bad = i;
      ok = 0;
    }
  }
  case_result("p2p/256-outstanding", ok, "%d receives and %d sends in flight at once%s", posted_recv, posted_send,
              bad >= 0 ? ", a message arrived wrong" : "");
  reg_bufs_close(cp, &b);
}

static void case_optional_completion_and_flush(conn_pair* cp) {
  uint8_t sbuf[256], rbuf[256];
  void *smh, *rmh;
  R.net->regMr(cp->send, sbuf, sizeof(sbuf), NCCL_PTR_HOST, &smh);
  R.net->regMr(cp->recv, rbuf, sizeof(rbuf), NCCL_PTR_HOST, &rmh);
  fill_pattern(sbuf, sizeof(sbuf), 31 + (uint64_t)R.rank);
  void* data[1] = {rbuf};
  size_t sizes[1] = {sizeof(rbuf)};
  int tags[1] = {1};
  void* mh[1] = {rmh};
  /* NCCL marks receives whose completion it does not need (LL protocols) this way. */
  void* rreq = (void*)(uintptr_t)NCCL_NET_OPTIONAL_RECV_COMPLETION;
  int ok = R.net->irecv(cp->recv, 1, data, sizes, tags, mh, NULL, &rreq) == ncclSuccess && rreq != NULL &&
           rreq != (void*)(uintptr_t)NCCL_NET_OPTIONAL_RECV_COMPLETION;
  void* sreq = NULL;
  while (ok && sreq == NULL) ok = R.net->isend(cp->send, sbuf, sizeof(sbuf), 1, smh, NULL, &sreq) == ncclSuccess;
  int got = -1;
  ok = ok && test_until_done("isend", sreq, NULL, net_test) == 0 && test_until_done("irecv", rreq, &got, net_test) == 0;
  ok = ok && got == (int)sizeof(rbuf) && check_pattern(rbuf, sizeof(rbuf), 31 + (uint64_t)(1 - R.rank)) < 0;
  case_result("p2p/optional-recv-completion", ok, "a receive posted with NCCL_NET_OPTIONAL_RECV_COMPLETION still completes with its size (%d)", got);
  void* freq = (void*)1;
  int fsizes[1] = {(int)sizeof(rbuf)};
  int fr = R.net->iflush(cp->recv, 1, data, fsizes, mh, &freq);
  int fok = fr == ncclSuccess && (freq == NULL || test_until_done("iflush", freq, NULL, net_test) == 0);
  case_result("p2p/iflush", fok, "iflush of host memory returned %d, request %s", fr, freq == NULL ? "NULL (nothing to flush)" : "completed");
  R.net->deregMr(cp->send, smh);
  R.net->deregMr(cp->recv, rmh);
}

/* Several comms on several threads, all interleaving traffic at once. */
typedef struct thread_arg {
  int index;
  conn_pair cp;
  int ok;
  char why[160];
} thread_arg;

static void* thread_main(void* p) {
  thread_arg* a = p;
  enum { MSGS = 300 };
  size_t maxsz = 256 << 10;
  uint8_t* sbuf = malloc(maxsz);
  uint8_t* rbuf = malloc(maxsz);
  void *smh, *rmh;
  a->ok = R.net->regMr(a->cp.send, sbuf, maxsz, NCCL_PTR_HOST, &smh) == ncclSuccess &&
          R.net->regMr(a->cp.recv, rbuf, maxsz, NCCL_PTR_HOST, &rmh) == ncclSuccess;
  for (int m = 0; m < MSGS && a->ok; m++) {
    size_t len = ((size_t)m * 7919 + (size_t)a->index * 104729) % maxsz;
    uint64_t seed = (uint64_t)a->index * 1000000 + (uint64_t)m * 2;
    fill_pattern(sbuf, len, seed + (uint64_t)R.rank);
    int got = -1;
    if (exchange_message(&a->cp, sbuf, len, smh, rbuf, maxsz, rmh, m, &got) != 0) {
      snprintf(a->why, sizeof(a->why), "thread %d message %d failed", a->index, m);
      a->ok = 0;
    } else if (got != (int)len || check_pattern(rbuf, len, seed + (uint64_t)(1 - R.rank)) >= 0) {
      snprintf(a->why, sizeof(a->why), "thread %d message %d (%zu bytes) arrived wrong (size %d)", a->index, m, len, got);
      a->ok = 0;
    }
  }
  R.net->deregMr(a->cp.send, smh);
  R.net->deregMr(a->cp.recv, rmh);
  free(sbuf);
  free(rbuf);
  return NULL;
}

static void case_threads(void) {
  enum { T = 4 };
  thread_arg args[T];
  memset(args, 0, sizeof(args));
  int ok = 1;
  for (int i = 0; i < T && ok; i++) {
    char tag[32];
    snprintf(tag, sizeof(tag), "threads-%d", i);
    args[i].index = i;
    ok = connect_pair(tag, &args[i].cp) == 0;
  }
  pthread_t th[T];
  for (int i = 0; i < T && ok; i++) pthread_create(&th[i], NULL, thread_main, &args[i]);
  const char* why = "";
  for (int i = 0; i < T && ok; i++) {
    pthread_join(th[i], NULL);
    if (!args[i].ok && why[0] == '\0') why = args[i].why;
  }
  int all = ok;
  for (int i = 0; i < T; i++) {
    all = all && args[i].ok;
    close_pair(&args[i].cp);
  }
  case_result("p2p/4-comms-on-4-threads", all, "%s", all ? "300 messages of mixed sizes each, interleaved" : (ok ? why : "connecting failed"));
}

/* Connect and close a comm pair n times, with a message each time; what the process holds
 * must not grow. The first cycle is a warm-up (lane threads, CUDA probe). */
int suite_cycles(int n) {
  uint8_t sbuf[64], rbuf[64];
  for (int c = 0; c <= n; c++) {
    if (c == 1) snapshot("first", 1);
    if (c == n / 2) snapshot("mid", c);
    char tag[32];
    snprintf(tag, sizeof(tag), "cycle-%d", c);
    conn_pair cp;
    if (connect_pair(tag, &cp) != 0) {
      case_result("cycles/connect-close", 0, "connecting failed at cycle %d", c);
      return 1;
    }
    void *smh, *rmh;
    R.net->regMr(cp.send, sbuf, sizeof(sbuf), NCCL_PTR_HOST, &smh);
    R.net->regMr(cp.recv, rbuf, sizeof(rbuf), NCCL_PTR_HOST, &rmh);
    fill_pattern(sbuf, sizeof(sbuf), (uint64_t)c * 2 + (uint64_t)R.rank);
    int got = -1;
    if (exchange_message(&cp, sbuf, sizeof(sbuf), smh, rbuf, sizeof(rbuf), rmh, 0, &got) != 0 || got != 64 ||
        check_pattern(rbuf, sizeof(rbuf), (uint64_t)c * 2 + (uint64_t)(1 - R.rank)) >= 0) {
      case_result("cycles/connect-close", 0, "the message of cycle %d failed", c);
      return 1;
    }
    R.net->deregMr(cp.send, smh);
    R.net->deregMr(cp.recv, rmh);
    close_pair(&cp);
  }
  barrier("cycles-done");
  snapshot("last", n);
  case_result("cycles/connect-close", 1, "%d connect/message/close cycles", n);
  return 0;
}

int suite_p2p(void) {
  conn_pair cp;
  int fds_before = count_fds();
  if (connect_pair("p2p", &cp) != 0) {
    case_result("p2p/connect", 0, "could not connect the two ranks");
    return 1;
  }
  if (two_sided_net()) { /* a socket and the helper's eventfd, for both directions */
    int fds = count_fds() - fds_before;
    case_result("p2p/one-connection-both-ways", fds == 2,
                "the send and receive comms to the peer hold %d descriptors (one connection: 2)", fds);
  }
  /* The first connect and accept return no comm: NCCL must retry, and does. */
  case_result("p2p/connect-accept-retries", cp.connect_retries > 0,
              "connect returned no comm %d time(s) and accept %d time(s) before both completed", cp.connect_retries,
              cp.accept_retries);
  case_sizes(&cp);
  case_multi_recv(&cp);
  case_send_ahead_of_its_receive(&cp);
  case_outstanding(&cp);
  case_optional_completion_and_flush(&cp);
  close_pair(&cp);
  case_threads();
  return 0;
}

int run_rank(const char* path, int rank, const char* suite) {
  static char tag[16];
  snprintf(tag, sizeof(tag), "rank %d", rank);
  driver_tag = tag;
  memset(&R, 0, sizeof(R));
  R.rank = rank;
  R.timeout_s = 60;
  char err[512];
  if (plugin_open(path, &R.p, err, sizeof(err)) != 0) {
    fprintf(stderr, "[%s] %s\n", driver_tag, err);
    return 2;
  }
  if (R.p.net12 == NULL) {
    fprintf(stderr, "[%s] the library exports no ncclNetPlugin_v12\n", driver_tag);
    return 2;
  }
  R.net = R.p.net12;
  ncclNetCommConfig_v12_t config = {.trafficClass = -1};
  R.comm_id = 0xC0FFEE;
  if (R.net->init(&R.netctx, R.comm_id, &config, driver_logger, NULL) != ncclSuccess) {
    fprintf(stderr, "[%s] net init failed\n", driver_tag);
    return 2;
  }
  int rc = 0;
  if (strcmp(suite, "p2p") == 0) rc = suite_p2p();
  else if (strcmp(suite, "gather") == 0) rc = suite_gather();
  else if (strcmp(suite, "bench") == 0) rc = suite_bench();
  else if (strncmp(suite, "fault-", 6) == 0) rc = suite_fault(suite);
  else if (strncmp(suite, "cycles-", 7) == 0) rc = suite_cycles(atoi(suite + 7));
  else if (strncmp(suite, "load-", 5) == 0) rc = suite_load(atoi(suite + 5));
  else {
    fprintf(stderr, "[%s] unknown suite %s\n", driver_tag, suite);
    return 2;
  }
  if (strncmp(suite, "fault-", 6) != 0) barrier("done"); /* after a fault the peer may be gone */
  R.net->finalize(R.netctx);
  printf("SUMMARY %d passed, %d failed, %d warnings\n", case_passes, case_failures, driver_warns);
  fflush(stdout);
  return rc != 0 || case_failures ? 1 : 0;
}
