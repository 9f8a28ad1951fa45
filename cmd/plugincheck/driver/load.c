/* plugincheck bench --load: two communicators, each driven by its own thread, doing
 * one-shot gathers and p2p messages back to back for a given time, every byte checked.
 * plugincheck then compares ROCE_GATHER_STATS with the work counted here. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "rank.h"

typedef struct comm_load {
  int index;
  void* netctx;
  void* cctx;
  void* coll;
  conn_pair cp;
  long iters;
  long gathers, messages, errors;
  char why[160];
} comm_load;

static int coll_test(void* req, int* done, int* size) { return R.p.coll12->test(req, done, size); }

static int make_comm(comm_load* c) {
  const ncclCollNet_v12_t* CN = R.p.coll12;
  ncclNetCommConfig_v12_t cfg = {.trafficClass = -1};
  uint64_t id = 0x10AD0000 + (uint64_t)c->index;
  if (R.net->init(&c->netctx, id, &cfg, driver_logger, NULL) != ncclSuccess) return -1;
  if (CN->init(&c->cctx, id, driver_logger) != ncclSuccess) return -1;
  uint8_t h[2][NCCL_NET_HANDLE_MAXSIZE];
  void* listen = NULL;
  char tag[32];
  snprintf(tag, sizeof(tag), "load-coll-%d", c->index);
  if (CN->listen(c->cctx, 0, h[R.rank], &listen) != ncclSuccess) return -1;
  if (exchange(tag, h[R.rank], h[1 - R.rank], NCCL_NET_HANDLE_MAXSIZE) != 0) return -1;
  void* hp[2] = {h[0], h[1]};
  CN->connect(hp, 2, R.rank, listen, &c->coll);
  CN->closeListen(listen);
  if (c->coll == NULL) return -1;
  snprintf(tag, sizeof(tag), "load-p2p-%d", c->index);
  return connect_pair(tag, &c->cp);
}

static int one_round(comm_load* c, uint8_t* shard, uint8_t* rows, void* smh, void* rmh, uint8_t* msg, uint8_t* got,
                     void* msmh, void* mrmh, long i) {
  const ncclCollNet_v12_t* CN = R.p.coll12;
  size_t S = 64 << 10;
  uint64_t seed = (uint64_t)c->index << 40 | (uint64_t)i << 1;
  fill_pattern(shard, S, seed + (uint64_t)R.rank);
  ncclNetSGE_v12_t part = {.mhandle = rmh, .address = rows, .size = 2 * S};
  void* req = NULL;
  while (req == NULL)
    if (CN->iallgather(c->coll, shard, 1, &part, S, 0, 2 * S, smh, &req) != ncclSuccess) return -1;
  if (test_until_done("iallgather", req, NULL, coll_test) != 0) return -1;
  if (check_pattern(rows, S, seed) >= 0 || check_pattern(rows + S, S, seed + 1) >= 0) return -2;
  c->gathers++;
  fill_pattern(msg, S, seed + 7 + (uint64_t)R.rank);
  void *sreq = NULL, *rreq = NULL;
  void* data[1] = {got};
  size_t sizes[1] = {S};
  int tags[1] = {0};
  void* mh[1] = {mrmh};
  while (rreq == NULL)
    if (R.net->irecv(c->cp.recv, 1, data, sizes, tags, mh, NULL, &rreq) != ncclSuccess) return -1;
  while (sreq == NULL)
    if (R.net->isend(c->cp.send, msg, S, 0, msmh, NULL, &sreq) != ncclSuccess) return -1;
  int (*nt)(void*, int*, int*) = (int (*)(void*, int*, int*))R.net->test;
  if (test_until_done("isend", sreq, NULL, nt) != 0 || test_until_done("irecv", rreq, NULL, nt) != 0) return -1;
  if (check_pattern(got, S, seed + 7 + (uint64_t)(1 - R.rank)) >= 0) return -2;
  c->messages++;
  return 0;
}

static void* run(void* arg) {
  comm_load* c = arg;
  const ncclCollNet_v12_t* CN = R.p.coll12;
  size_t S = 64 << 10;
  uint8_t *shard = malloc(S), *rows = malloc(2 * S), *msg = malloc(S), *got = malloc(S);
  void *smh, *rmh, *msmh, *mrmh;
  CN->regMr(c->coll, shard, S, NCCL_PTR_HOST, &smh);
  CN->regMr(c->coll, rows, 2 * S, NCCL_PTR_HOST, &rmh);
  R.net->regMr(c->cp.send, msg, S, NCCL_PTR_HOST, &msmh);
  R.net->regMr(c->cp.recv, got, S, NCCL_PTR_HOST, &mrmh);
  for (long i = 0; i < c->iters; i++) {
    int rc = one_round(c, shard, rows, smh, rmh, msg, got, msmh, mrmh, i);
    if (rc != 0) {
      c->errors++;
      snprintf(c->why, sizeof(c->why), "communicator %d, round %ld: %s", c->index, i,
               rc == -2 ? "wrong bytes" : "a call failed");
      break;
    }
  }
  CN->deregMr(c->coll, smh);
  CN->deregMr(c->coll, rmh);
  R.net->deregMr(c->cp.send, msmh);
  R.net->deregMr(c->cp.recv, mrmh);
  free(shard), free(rows), free(msg), free(got);
  return NULL;
}

int suite_load(int seconds) {
  comm_load comms[2];
  memset(comms, 0, sizeof(comms));
  for (int i = 0; i < 2; i++) {
    comms[i].index = i;
    if (make_comm(&comms[i]) != 0) {
      case_result("load/setup", 0, "communicator %d did not form its one-shot group and p2p comms", i);
      return 1;
    }
  }
  /* Both ranks must run the same number of rounds: rank 0 times a short run and decides. */
  comms[0].iters = comms[1].iters = 50;
  uint64_t t0 = now_ns();
  pthread_t th[2];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, run, &comms[i]);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  double per_round = (double)(now_ns() - t0) / 50.0;
  long iters = (long)((double)seconds * 1e9 / per_round);
  long peer_iters = 0;
  exchange("load-iters", &iters, &peer_iters, sizeof(iters));
  if (R.rank == 1) iters = peer_iters;
  if (iters < 1) iters = 1;
  long warm_g = comms[0].gathers + comms[1].gathers;
  t0 = now_ns();
  for (int i = 0; i < 2; i++) {
    comms[i].iters = iters;
    pthread_create(&th[i], NULL, run, &comms[i]);
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  double secs = (double)(now_ns() - t0) / 1e9;
  long g = comms[0].gathers + comms[1].gathers, m = comms[0].messages + comms[1].messages;
  long e = comms[0].errors + comms[1].errors;
  printf("LOAD gathers=%ld messages=%ld errors=%ld seconds=%.1f\n", g, m, e, secs);
  fflush(stdout);
  case_result("load/two-communicators-two-threads", e == 0 && g == 2 * (50 + iters) && g - warm_g == 2 * iters,
              "%ld one-shot gathers and %ld p2p messages of 64 KiB in %.1f s on two threads, %ld errors%s%s", g, m,
              secs, e, e ? ": " : "", e ? (comms[0].errors ? comms[0].why : comms[1].why) : "");
  for (int i = 0; i < 2; i++) {
    close_pair(&comms[i].cp);
    R.p.coll12->closeColl(comms[i].coll);
    R.p.coll12->finalize(comms[i].cctx);
    R.net->finalize(comms[i].netctx);
  }
  return 0;
}
