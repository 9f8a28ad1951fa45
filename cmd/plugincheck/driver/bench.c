/* step bench:FABRIC:TARGET: the intercepted gather's host-side round trip (the stand-in of
 * its kernel, the real proxy, the real fabric) at each of the floor's sizes, beside the
 * fabric's own floor measured first between the same two processes (floor.h). FABRIC is tcp
 * (TARGET: the interface) or verbs (TARGET: HCA:PORT:GID). Each size prints one line. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include "floor.h"
#include "rank.h"

size_t bench_max_bytes(void) { return floor_sizes[FLOOR_SIZES - 1]; }

int agreed_rounds(uint64_t warm_ns, int most) {
  const uint64_t budget_ns = 500000000ull, per = warm_ns / FLOOR_WARM_ROUNDS;
  int32_t mine = most, peer = 0;
  if (per > 0 && budget_ns / per < (uint64_t)most) mine = (int32_t)(budget_ns / per);
  if (mine < FLOOR_MIN_ROUNDS) mine = FLOOR_MIN_ROUNDS;
  if (exchange("rounds", &mine, &peer, sizeof(mine)) != 0) return -1;
  return R.rank == 0 ? mine : peer;
}

int floor_fail(char* why, size_t n, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, n, fmt, ap);
  va_end(ap);
  return -1;
}

int step_bench(ncclComm_t comm, const char* spec, uint8_t* send, uint8_t* recv) {
  char fabric[16] = "", target[128] = "";
  if (sscanf(spec, "%15[^:]:%127s", fabric, target) != 2 || (strcmp(fabric, "tcp") != 0 && strcmp(fabric, "verbs") != 0)) {
    fprintf(stderr, "[rank %d] bench:%s: want bench:tcp:INTERFACE or bench:verbs:HCA:PORT:GID\n", R.rank, spec);
    return -1;
  }
  floor_result fl;
  int have_floor = (strcmp(fabric, "tcp") == 0 ? floor_tcp(target, &fl) : floor_verbs(target, &fl)) == 0;
  for (int i = 0; i < FLOOR_SIZES; i++) {
    const size_t size = floor_sizes[i];
    /* Every gather carries the same shards: the last one's rows are checked. */
    fill_pattern(send, size, shard_seed(7, size, R.rank));
    int result = ncclSuccess;
    uint64_t t0 = now_ns();
    for (int k = 0; k < FLOOR_WARM_ROUNDS && result == ncclSuccess; k++)
      result = ncclAllGather(send, recv, size, ncclUint8, comm, RANK_STREAM);
    int rounds = agreed_rounds(now_ns() - t0, floor_rounds[i]);
    if (rounds < 0) return -1;
    t0 = now_ns();
    for (int k = 0; k < rounds && result == ncclSuccess; k++) {
      if (k == rounds - 1) memset(recv, 0, 2 * size);
      result = ncclAllGather(send, recv, size, ncclUint8, comm, RANK_STREAM);
    }
    double us = (double)(now_ns() - t0) / rounds / 1e3;
    int exact = check_pattern(recv, size, shard_seed(7, size, 0)) < 0 && check_pattern(recv + size, size, shard_seed(7, size, 1)) < 0;
    char how[400], quoted[900], floor_rounds_of[32] = "";
    if (have_floor) snprintf(floor_rounds_of, sizeof(floor_rounds_of), "%d rounds of ", fl.rounds[i]);
    snprintf(how, sizeof(how), "%d gathers after %d to warm up, the caller's time of each; floor: %s%s", rounds,
             FLOOR_WARM_ROUNDS, floor_rounds_of, fl.how[0] ? fl.how : "not measured");
    out_line("bench", "\"bytes\":%zu,\"gathers\":%d,\"result\":%d,\"rows\":\"%s\",\"us\":%.4f,\"floor_us\":%.4f,\"how\":%s",
             size, FLOOR_WARM_ROUNDS + rounds, result, exact ? "exact" : "wrong", us, have_floor ? fl.round_us[i] : 0.0,
             json_quote(quoted, sizeof(quoted), how));
  }
  return 0;
}
