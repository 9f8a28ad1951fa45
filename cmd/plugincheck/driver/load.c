/* step load:SECONDS: two communicators, each driven by its own thread, doing intercepted
 * gathers back to back for about SECONDS, every byte checked. The parent then holds the
 * library's ROCE_GATHER_STATS to the gathers and bytes counted here. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "rank.h"

/* Sizes the gathers cycle through, bytes a rank: within every fabric's default window. */
static const size_t load_sizes[] = {16, 4096, 65536};
#define NSIZES (sizeof(load_sizes) / sizeof(load_sizes[0]))
#define WARM_ROUNDS 30

size_t load_max_bytes(void) { return load_sizes[NSIZES - 1]; }

typedef struct comm_load {
  int index;
  ncclComm_t comm;
  long rounds, done;
  long gathers, errors;
  unsigned long long bytes;
  uint8_t *send, *recv;
  char why[200];
} comm_load;

static void* run(void* arg) {
  comm_load* c = arg;
  for (long i = 0; i < c->rounds && c->errors == 0; i++, c->done++) {
    const size_t size = load_sizes[c->done % NSIZES];
    const uint64_t key = 100 + (uint64_t)c->index;
    fill_pattern(c->send, size, shard_seed(key, (uint64_t)c->done, R.rank));
    ncclResult_t r = ncclAllGather(c->send, c->recv, size, ncclUint8, c->comm, RANK_STREAM);
    c->gathers++;
    c->bytes += size;
    long w0 = check_pattern(c->recv, size, shard_seed(key, (uint64_t)c->done, 0));
    long w1 = check_pattern(c->recv + size, size, shard_seed(key, (uint64_t)c->done, 1));
    if (r != ncclSuccess || w0 >= 0 || w1 >= 0) {
      c->errors++;
      snprintf(c->why, sizeof(c->why), "communicator %d, gather %ld of %zu bytes: %s", c->index, c->done + 1, size,
               r != ncclSuccess ? "ncclAllGather returned an error" : "wrong bytes in the rows");
    }
  }
  return NULL;
}

static void run_both(comm_load* c) {
  pthread_t th[2];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, run, &c[i]);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
}

int step_load(int seconds) {
  comm_load c[2];
  memset(c, 0, sizeof(c));
  for (int i = 0; i < 2; i++) {
    char tag[32];
    snprintf(tag, sizeof(tag), "load-uid-%d", i);
    c[i].index = i;
    c[i].send = malloc(load_max_bytes());
    c[i].recv = malloc(2 * load_max_bytes());
    ncclResult_t r = make_comm(tag, &c[i].comm);
    if (r != ncclSuccess) {
      out_line("load", "\"gathers\":0,\"bytes\":0,\"errors\":1,\"seconds\":0,\"why\":\"communicator %d: init returned %d\"", i,
               (int)r);
      return 0;
    }
  }
  /* Both ranks must make the same gathers: rank 0 times a short run and decides for both. */
  c[0].rounds = c[1].rounds = WARM_ROUNDS;
  uint64_t t0 = now_ns();
  run_both(c);
  double per_round = (double)(now_ns() - t0) / WARM_ROUNDS;
  long rounds = (long)((double)seconds * 1e9 / (per_round > 0 ? per_round : 1)), peer_rounds = 0;
  if (rounds < 1) rounds = 1;
  if (exchange("load-rounds", &rounds, &peer_rounds, sizeof(rounds)) != 0) return -1;
  if (R.rank == 1) rounds = peer_rounds;
  t0 = now_ns();
  for (int i = 0; i < 2; i++) c[i].rounds = c[i].errors ? 0 : rounds;
  run_both(c);
  double secs = (double)(now_ns() - t0) / 1e9;
  long errors = c[0].errors + c[1].errors;
  char quoted[450];
  out_line("load", "\"gathers\":%ld,\"bytes\":%llu,\"errors\":%ld,\"seconds\":%.2f,\"rounds\":%ld,\"why\":%s",
           c[0].gathers + c[1].gathers, c[0].bytes + c[1].bytes, errors, secs, WARM_ROUNDS + rounds,
           json_quote(quoted, sizeof(quoted), errors ? (c[0].errors ? c[0].why : c[1].why) : ""));
  for (int i = 0; i < 2; i++) {
    ncclCommDestroy(c[i].comm);
    free(c[i].send);
    free(c[i].recv);
  }
  return 0;
}
