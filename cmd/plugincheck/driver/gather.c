/* The gather suite: acts as NCCL does for a two-rank AllGather. It forms the collNet
 * group, asks the tuner, then runs each gather through collNet iallgather (NCCL's
 * registered-buffer call or its staging windows) or through the p2p net, and checks
 * every byte and that both ranks took the same path. */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "rank.h"
#include "select.h"

enum path { PATH_NCCL = 0, PATH_ONESHOT = 1 };

/* The chunk NCCL picks for these staged gathers, and the step its buffer holds. */
#define NCCL_CHUNK ((size_t)32 << 10)
#define NCCL_STEP_BYTES ((size_t)512 << 10)

static const ncclCollNet_v12_t* CN;
static void* coll;
/* The iallgather calls this rank made and the window bytes they moved, for the stats. */
static long long iag_calls;
static unsigned long long iag_bytes;

static int coll_test(void* req, int* done, int* size) { return CN->test(req, done, size); }
static int net_test(void* req, int* done, int* sizes) { return R.net->test(req, done, sizes); }

/* NCCL's registered-buffer call: the whole gather in one window. */
static int oneshot_direct(uint8_t* result, const uint8_t* shard, size_t S, int in_place) {
  void *rmh = NULL, *smh = NULL;
  if (CN->regMr(coll, result, 2 * S, NCCL_PTR_HOST, &rmh) != ncclSuccess) return -1;
  const uint8_t* send = in_place ? result + (size_t)R.rank * S : shard;
  if (in_place) {
    memcpy(result + (size_t)R.rank * S, shard, S);
    smh = rmh;
  } else if (CN->regMr(coll, (void*)shard, S, NCCL_PTR_HOST, &smh) != ncclSuccess) {
    return -1;
  }
  ncclNetSGE_v12_t part = {.mhandle = rmh, .address = result, .size = 2 * S};
  void* req = NULL;
  int rc = 0;
  uint64_t start = now_ns();
  while (req == NULL && rc == 0) {
    rc = CN->iallgather(coll, (void*)send, 1, &part, S, 0, 2 * S, smh, &req);
    if (now_ns() - start > (uint64_t)R.timeout_s * 1000000000ull) rc = -1;
  }
  if (rc == 0) iag_calls++, iag_bytes += 2 * S;
  if (rc == 0) rc = test_until_done("iallgather", req, NULL, coll_test);
  if (!in_place) CN->deregMr(coll, smh);
  CN->deregMr(coll, rmh);
  return rc;
}

/* NCCL's staging path: windows of `chunk` bytes of the global result through a staging
 * region, up to 8 in flight, this rank's part of each window packed into a send slot. */
static int oneshot_staged(uint8_t* result, const uint8_t* shard, size_t S, size_t chunk) {
  enum { STEPS = 8 };
  uint8_t* region = malloc(2 * STEPS * chunk);
  void* mh = NULL;
  if (CN->regMr(coll, region, 2 * STEPS * chunk, NCCL_PTR_HOST, &mh) != ncclSuccess) return -1;
  /* NCCL registers the region once per connector and channel; a second reference must work. */
  void* mh2 = NULL;
  if (CN->regMr(coll, region, 2 * STEPS * chunk, NCCL_PTR_HOST, &mh2) != ncclSuccess) return -1;
  size_t total = 2 * S, nwin = (total + chunk - 1) / chunk;
  void* reqs[STEPS] = {0};
  size_t issued = 0, completed = 0;
  int rc = 0;
  while (completed < nwin && rc == 0) {
    if (issued < nwin && issued - completed < STEPS) {
      size_t w = issued, slot = w % STEPS, off = w * chunk, wb = total - off < chunk ? total - off : chunk;
      uint8_t* send = region + slot * chunk;
      uint8_t* recv = region + (STEPS + slot) * chunk;
      size_t mb = (size_t)R.rank * S, me = mb + S;
      size_t lo = mb > off ? mb : off, hi = me < off + wb ? me : off + wb;
      if (hi > lo) memcpy(send, shard + (lo - mb), hi - lo);
      ncclNetSGE_v12_t part = {.mhandle = mh, .address = recv, .size = wb};
      rc = CN->iallgather(coll, send, 1, &part, S, off, wb, mh, &reqs[slot]);
      if (rc == 0 && reqs[slot] != NULL) issued++, iag_calls++, iag_bytes += wb;
    }
    if (completed < issued) {
      size_t w = completed, slot = w % STEPS, off = w * chunk, wb = total - off < chunk ? total - off : chunk;
      int done = 0;
      rc = CN->test(reqs[slot], &done, NULL);
      if (rc == 0 && done) {
        memcpy(result + off, region + (STEPS + slot) * chunk, wb);
        completed++;
      }
    }
  }
  CN->deregMr(coll, mh2);
  CN->deregMr(coll, mh);
  free(region);
  return rc;
}

/* NCCL's own algorithm for two ranks over the p2p net: each rank sends its shard. */
static int via_p2p(conn_pair* cp, uint8_t* result, const uint8_t* shard, size_t S) {
  void *smh = NULL, *rmh = NULL;
  uint8_t* peer = result + (size_t)(1 - R.rank) * S;
  if (R.net->regMr(cp->send, (void*)shard, S ? S : 1, NCCL_PTR_HOST, &smh) != ncclSuccess ||
      R.net->regMr(cp->recv, peer, S ? S : 1, NCCL_PTR_HOST, &rmh) != ncclSuccess)
    return -1;
  void *sreq = NULL, *rreq = NULL;
  void* data[1] = {peer};
  size_t sizes[1] = {S};
  int tags[1] = {0};
  void* mh[1] = {rmh};
  int rc = 0;
  while (rreq == NULL && rc == 0) rc = R.net->irecv(cp->recv, 1, data, sizes, tags, mh, NULL, &rreq);
  while (sreq == NULL && rc == 0) rc = R.net->isend(cp->send, (void*)shard, S, 0, smh, NULL, &sreq);
  if (rc == 0) rc = test_until_done("isend", sreq, NULL, net_test);
  if (rc == 0) rc = test_until_done("irecv", rreq, NULL, net_test);
  memcpy(result + (size_t)R.rank * S, shard, S);
  R.net->deregMr(cp->send, smh);
  R.net->deregMr(cp->recv, rmh);
  return rc;
}

/* NCCL's cost table as it looks to the tuner: its own algorithms offered, CollNet offered
 * only when the group connected, and CollNet Direct dropped when no_nvswitch says the
 * topology has no NVSwitch (NCCL 2.24 to 2.30). The tuner edits it; NCCL takes the cheapest
 * entry by its release's rule, and both rules must agree. Where Direct was dropped, only
 * 2.30's rule applies: NCCL 2.31 does not drop it with NCCL_COLLNET_ENABLE=1.
 * Returns the path, or -1 with why set. */
static int choose_path(void* tctx, const ncclTuner_v6_t* T, size_t total, int no_nvswitch, int* nch, char* why,
                       size_t whylen) {
  float before[7 * 3], table[7 * 3];
  for (int a = 0; a < 7; a++)
    for (int p = 0; p < 3; p++) {
      int collnet = a == NCCL_ALGO_COLLNET_DIRECT || a == NCCL_ALGO_COLLNET_CHAIN;
      int nvls = a == NCCL_ALGO_NVLS || a == NCCL_ALGO_NVLS_TREE;
      int dropped = a == NCCL_ALGO_COLLNET_DIRECT && no_nvswitch;
      before[a * 3 + p] =
          nvls || dropped || (collnet && coll == NULL) ? NCCL_ALGO_PROTO_IGNORE : 100.0f + (float)(a * 3 + p);
      table[a * 3 + p] = before[a * 3 + p];
    }
  *nch = 0;
  float* tp = table;
  if (T->getCollInfo(tctx, ncclFuncAllGather, total, 1, (float**)tp, 7, 3, 0, nch) != ncclSuccess) {
    snprintf(why, whylen, "the tuner's getCollInfo failed");
    return -1;
  }
  int best = nccl_pick_skipping_negatives(table, 21);
  int by231 = no_nvswitch ? best : nccl_pick_plain_minimum(before, table, 21);
  if (best < 0 || best != by231) {
    snprintf(why, whylen, "from the tuner's table NCCL 2.30's rule picks algo %d / proto %d, NCCL 2.31's algo %d / proto %d",
             best / 3, best % 3, by231 / 3, by231 % 3);
    return -1;
  }
  return best / 3 == NCCL_ALGO_COLLNET_DIRECT ? PATH_ONESHOT : PATH_NCCL;
}

int suite_gather(void) {
  CN = R.p.coll12;
  const ncclTuner_v6_t* T = R.p.tuner6;
  if (CN == NULL || T == NULL) {
    case_result("gather/tables", 0, "the library lacks ncclCollNetPlugin_v12 or ncclTunerPlugin_v6");
    return 1;
  }
  void* cctx = NULL;
  if (CN->init(&cctx, R.comm_id, driver_logger) != ncclSuccess) {
    case_result("gather/init", 0, "collNet init failed");
    return 1;
  }
  /* As NCCL forms the group: listen, all-gather the handles, connect once, close the listener. */
  uint8_t handles[2][NCCL_NET_HANDLE_MAXSIZE];
  void* listen = NULL;
  if (CN->listen(cctx, 0, handles[R.rank], &listen) != ncclSuccess ||
      exchange("coll-handles", handles[R.rank], handles[1 - R.rank], NCCL_NET_HANDLE_MAXSIZE) != 0) {
    case_result("gather/listen", 0, "collNet listen failed");
    return 1;
  }
  void* hp[2] = {handles[0], handles[1]};
  int rc = CN->connect(hp, 2, R.rank, listen, &coll);
  CN->closeListen(listen);
  uint8_t on = rc == ncclSuccess && coll != NULL, peer_on = 2;
  exchange("coll-on", &on, &peer_on, 1);
  case_result("gather/group-agreement", on == peer_on, "connect returned %d; one-shot path %s here, %s on the peer", rc,
              on ? "on" : "off", peer_on ? "on" : "off");

  void* tctx = NULL;
  ncclNvlDomainInfo_v6_t nvl = {2, 1, 1};
  ncclTunerConstants_v6_t* constants = calloc(1, sizeof(*constants));
  /* RG_SELFTEST_NNODES=1 plays both ranks on one node, as NCCL would report it. */
  const char* nn = getenv("RG_SELFTEST_NNODES");
  size_t nnodes = nn != NULL && strcmp(nn, "1") == 0 ? 1 : 2;
  if (T->init(&tctx, R.comm_id, 2, nnodes, driver_logger, &nvl, constants) != ncclSuccess) {
    case_result("gather/tuner-init", 0, "tuner init failed");
    return 1;
  }
  conn_pair cp;
  if (connect_pair("gather-p2p", &cp) != 0) {
    case_result("gather/p2p-connect", 0, "could not connect the p2p comms NCCL would use");
    return 1;
  }

  /* plugincheck says what this scenario must produce: "cap:N" (on, agreed window 0 to N),
   * "window:F:N" (on, agreed window F to N), "off", or "dropped" (on, but CollNet Direct
   * dropped: every gather goes to NCCL). */
  const char* expect = getenv("RG_SELFTEST_EXPECT");
  const char* nvs = getenv("RG_SELFTEST_NO_NVSWITCH");
  int no_nvswitch = nvs != NULL && strcmp(nvs, "1") == 0;
  long long expect_cap = -1, expect_floor = 0;
  if (expect != NULL && strncmp(expect, "cap:", 4) == 0) expect_cap = atoll(expect + 4);
  if (expect != NULL && strncmp(expect, "window:", 7) == 0 &&
      sscanf(expect + 7, "%lld:%lld", &expect_floor, &expect_cap) != 2) {
    case_result("gather/expectation", 0, "RG_SELFTEST_EXPECT=%s is not window:FLOOR:CAP", expect);
    return 1;
  }
  /* And how the tuner must schedule a one-shot gather: "CHANNELS:CHUNK", CHUNK 0 leaving
   * NCCL's chunk (the default: one channel, NCCL's chunk). */
  const char* tuning = getenv("RG_SELFTEST_EXPECT_TUNING");
  int expect_channels = 1;
  long long expect_chunk = 0;
  if (tuning != NULL && sscanf(tuning, "%d:%lld", &expect_channels, &expect_chunk) != 2) {
    case_result("gather/expectation", 0, "RG_SELFTEST_EXPECT_TUNING=%s is not CHANNELS:CHUNK", tuning);
    return 1;
  }
  if (expect != NULL) {
    int want_on = expect_cap > 0 || strcmp(expect, "dropped") == 0;
    case_result("gather/expected-outcome", on == want_on, "expected the path %s, it is %s", want_on ? "on" : "off",
                on ? "on" : "off");
  }
  size_t sizes[32];
  int nsizes = 0;
  for (size_t s = 16; s <= (512 << 10); s *= 2) sizes[nsizes++] = s;
  sizes[nsizes++] = (512 << 10) + 16;
  sizes[nsizes++] = 100;
  if (expect_floor > 0) { /* both edges of the window, where they are not there already */
    long long edges[] = {expect_floor - 1, expect_floor, expect_floor + 1, expect_cap, expect_cap + 1};
    for (size_t e = 0; e < sizeof(edges) / sizeof(edges[0]); e++) {
      int seen = edges[e] <= 0;
      for (int i = 0; i < nsizes && !seen; i++) seen = sizes[i] == (size_t)edges[e];
      if (!seen) sizes[nsizes++] = (size_t)edges[e];
    }
  }
  int oneshot_cases = 0, nccl_cases = 0;
  unsigned long long oneshot_bytes = 0, nccl_bytes = 0;
  for (int i = 0; i < nsizes; i++) {
    for (int seed = 1; seed <= 3; seed++) {
      size_t S = sizes[i];
      char name[64];
      snprintf(name, sizeof(name), "gather/%zuB/seed%d", S, seed);
      int nch = 0;
      char why[160] = "";
      int path = choose_path(tctx, T, 2 * S, no_nvswitch, &nch, why, sizeof(why));
      uint8_t mine = (uint8_t)path, peers = 0xff;
      exchange(name, &mine, &peers, 1);
      if (path < 0) {
        case_result(name, 0, "%s", why);
        continue;
      }
      if (peers != mine) {
        case_result(name, 0, "the ranks took different paths (this rank %d, the peer %d)", path, peers);
        continue;
      }
      uint8_t* shard = malloc(S);
      uint8_t* result = malloc(2 * S);
      fill_pattern(shard, S, (uint64_t)seed * 1000003 + S * 2 + (uint64_t)R.rank);
      memset(result, 0xEE, 2 * S);
      const char* how;
      int r;
      size_t chunk = 0, want_chunk = 0;
      if (path == PATH_ONESHOT) {
        oneshot_cases++;
        oneshot_bytes += 2 * S;
        if (seed == 1) how = "oneshot-direct", r = oneshot_direct(result, shard, S, 0);
        else if (seed == 2) {
          /* NCCL's staging windows: its chunk (32 KiB here), which tuner v6 may replace;
           * NCCL clamps that to its buffer's step (512 KiB) and rounds it to 512 bytes. */
          chunk = NCCL_CHUNK;
          if (T->getChunkSize(tctx, ncclFuncAllGather, 2 * S, NCCL_ALGO_COLLNET_DIRECT, NCCL_PROTO_SIMPLE, nch, &chunk) !=
              ncclSuccess)
            chunk = 0;
          if (chunk > NCCL_STEP_BYTES) chunk = NCCL_STEP_BYTES;
          chunk = chunk / 512 * 512;
          want_chunk = expect_chunk > 0 ? (size_t)expect_chunk : NCCL_CHUNK;
          if (want_chunk > NCCL_STEP_BYTES) want_chunk = NCCL_STEP_BYTES;
          how = "oneshot-staged", r = chunk > 0 ? oneshot_staged(result, shard, S, chunk) : -1;
        } else how = "oneshot-inplace", r = oneshot_direct(result, shard, S, 1);
      } else {
        nccl_cases++;
        nccl_bytes += 2 * S;
        how = "nccl-p2p", r = via_p2p(&cp, result, shard, S);
      }
      long bad0 = check_pattern(result, S, (uint64_t)seed * 1000003 + S * 2);
      long bad1 = check_pattern(result + S, S, (uint64_t)seed * 1000003 + S * 2 + 1);
      int want = expect == NULL ? path
                 : expect_cap > 0 && (long long)S >= expect_floor && (long long)S <= expect_cap ? PATH_ONESHOT
                                                                                                 : PATH_NCCL;
      int ok = r == 0 && bad0 < 0 && bad1 < 0 && (path != PATH_ONESHOT || nch == expect_channels) &&
               chunk == want_chunk && path == want;
      char rowbad[96] = "";
      if (bad1 >= 0 || bad0 >= 0) {
        long at = bad1 >= 0 ? bad1 : bad0;
        const uint8_t* row = result + (bad1 >= 0 ? S : 0);
        snprintf(rowbad, sizeof(rowbad), " (first at byte %ld of %zu: 0x%02x%s)", at, S, row[at],
                 row[at] == 0xEE ? ", never written" : "");
      }
      char sched[96] = "";
      if (path == PATH_ONESHOT) snprintf(sched, sizeof(sched), ", %d channel(s)", nch);
      if (chunk > 0) snprintf(sched + strlen(sched), sizeof(sched) - strlen(sched), ", chunk %zu", chunk);
      case_result(name, ok, "path %s%s%s%s%s%s%s%s", how, sched, r != 0 ? ", the collective failed" : "",
                  bad0 >= 0 ? ", rank 0's row is wrong" : "", bad1 >= 0 ? ", rank 1's row is wrong" : "", rowbad,
                  path != want ? ", but this scenario expects the other path" : "",
                  path == PATH_ONESHOT && nch != expect_channels ? ", but not on the channels it expects"
                  : chunk != want_chunk                          ? ", but not in the chunk it expects"
                                                                 : "");
      free(shard);
      free(result);
    }
  }
  printf("NOTE gather paths: %d gathers by the one-shot path, %d by NCCL's p2p\n", oneshot_cases, nccl_cases);
  printf("NOTE gather totals: tuner oneshot=%d oneshot_bytes=%llu nccl=%d nccl_bytes=%llu; iallgather calls=%lld bytes=%llu\n",
         oneshot_cases, oneshot_bytes, nccl_cases, nccl_bytes, iag_calls, iag_bytes);
  fflush(stdout);
  /* RG_SELFTEST_EXIT ends the process right after its last gather, as jobs do that never
   * finalize NCCL: "_exit" (no atexit handler, no destructor runs) or "sigterm"; or, with
   * "finalize", goes on to close and finalize once both ranks are done. */
  const char* how_exit = getenv("RG_SELFTEST_EXIT");
  if (how_exit != NULL) {
    barrier("exit"); /* the peer's last gather is done too */
    if (strcmp(how_exit, "finalize") != 0) {
      printf("NOTE leaving by %s, without finalize\n", how_exit);
      fflush(stdout);
      if (strcmp(how_exit, "sigterm") == 0) kill(getpid(), SIGTERM);
      _exit(0);
    }
  }
  close_pair(&cp);
  T->finalize(tctx);
  free(constants);
  if (coll != NULL) CN->closeColl(coll);
  CN->finalize(cctx);
  return 0;
}
