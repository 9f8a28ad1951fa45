/* The one-shot gather protocol (see gather.h). Runs on NCCL's proxy progress thread. */
#include <stdio.h>
#include <string.h>
#include <time.h>
#include "../../internal/cudadrv/cudadrv.h"
#include "../../internal/nlog/nlog.h"
#include "../flush.h"
#include "../p2p.h" /* the immediate classes every link shares */
#include "gather.h"
#include "stats.h"

#define POLL_BATCH 32
#define CHECK_EVERY 256
#define SEQ_MASK 0xffffffu
#define STRIPE_ALIGN 64
/* No 24-bit seq equals it, so a slot never used matches no call. */
#define RG_SEQ_NONE UINT64_MAX
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

void rg_gather_init(rg_gather_comm* g) {
  g->next_seq = 1;
  for (int i = 0; i < RG_GATHER_DEPTH; i++) {
    g->ready_seq[i] = RG_SEQ_NONE;
    g->arrived_seq[i] = RG_SEQ_NONE;
    g->calls[i].req.index = i;
    g->calls[i].req.comm = g;
  }
  for (int i = 0; i < RG_GATHER_FLUSH_REQS; i++) {
    g->flush_reqs[i].index = i;
    g->flush_reqs[i].comm = g;
  }
}

static void cancel_kernels(rg_gather_comm* g) {
  for (int i = 0; i < RG_GATHER_DEPTH; i++) g->place_status[RG_PLACE_WORDS * i + RG_PLACE_CANCEL] = 1;
}

void rg_gather_fini(rg_gather_comm* g) {
  const rg_cuda_api* cu = rg_cuda();
  if (cu == NULL || g->stream == NULL) return;
  cancel_kernels(g); /* kernels still waiting end now */
  cu->cuCtxSetCurrent(g->cuda_ctx);
  cu->cuStreamSynchronize(g->stream);
  for (int i = 0; i < RG_GATHER_DEPTH; i++)
    if (g->calls[i].copy_done) cu->cuEventDestroy(g->calls[i].copy_done);
  if (g->place_state == 1) rg_place_unload(&g->place);
  cu->cuStreamDestroy(g->stream);
  g->stream = NULL;
}

int rg_gather_outstanding(const rg_gather_comm* g) {
  int n = 0;
  for (int i = 0; i < RG_GATHER_DEPTH; i++) n += g->calls[i].req.kind != RG_REQ_FREE;
  return n;
}

int rg_gather_call_mode(const rg_gather_comm* g, uint64_t windowBytes, uint64_t part0, uint64_t part1) {
  uint64_t biggest = part0 > part1 ? part0 : part1;
  if (biggest > g->slot_bytes || g->mode == RG_MODE_RENDEZVOUS) return RG_MODE_RENDEZVOUS;
  if (g->mode == RG_MODE_EAGER) return RG_MODE_EAGER;
  return windowBytes <= g->eager_max ? RG_MODE_EAGER : RG_MODE_RENDEZVOUS;
}

/* The part of window [off, off+wb) that rank r contributes, as an offset into the window. */
static void part_of(int r, uint64_t bpr, uint64_t off, uint64_t wb, uint64_t* poff, uint64_t* plen) {
  uint64_t b = (uint64_t)r * bpr, e = b + bpr;
  uint64_t lo = b > off ? b : off, hi = e < off + wb ? e : off + wb;
  *poff = hi > lo ? lo - off : 0;
  *plen = hi > lo ? hi - lo : 0;
}

static ncclResult_t fail(rg_gather_comm* g, rg_gather_call* c, const char* what) {
  if (c != NULL) c->error = 1;
  /* The group is finished: every gather kernel still queued or waiting gives up, and the
   * rows of the calls it served stay untouched. */
  cancel_kernels(g);
  rg_stats_add(RG_STAT_GATHER_ERRORS, 1);
  if (!g->warned) {
    g->warned = 1;
    const char* why = "";
    for (int l = 0; l < g->link->nlanes && why[0] == '\0'; l++) why = rg_why(&g->link->lane[l]);
    RG_WARN("one-shot gather with %s failed at call %llu: %s%s%s", g->link->peer,
            (unsigned long long)(c ? c->seq : g->next_seq), what, why[0] ? ": " : "", why);
  }
  return ncclRemoteError;
}

static int ensure_stream(rg_gather_comm* g) {
  const rg_cuda_api* cu = rg_cuda();
  if (cu == NULL) return -1;
  if (g->stream != NULL) return 0;
  if (cu->cuCtxGetCurrent(&g->cuda_ctx) != CUDA_SUCCESS || g->cuda_ctx == NULL) return -1;
  return cu->cuStreamCreate(&g->stream, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS ? 0 : -1;
}

int rg_gather_cuda_prepare(rg_gather_comm* g, int use_kernel, char* err, int errlen) {
  const rg_cuda_api* cu = rg_cuda();
  CUcontext ctx = NULL;
  if (cu == NULL || cu->cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || ctx == NULL) return 0; /* no GPU here */
  if (ensure_stream(g) != 0) {
    snprintf(err, errlen, "cannot create a CUDA stream for the gather copies");
    return -1;
  }
  for (int i = 0; i < RG_GATHER_DEPTH; i++)
    if (g->calls[i].copy_done == NULL &&
        cu->cuEventCreate(&g->calls[i].copy_done, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) {
      snprintf(err, errlen, "cannot create the CUDA events of the gather copies");
      return -1;
    }
  if (!use_kernel) {
    g->place_state = 0;
    return 0;
  }
  if (!g->landing_mapped) {
    g->place_state = -1;
    RG_WARN("the landing region could not be pinned for the GPU; eager gathers on GPU memory copy with "
            "cuMemcpyAsync instead of the gather kernel");
    return 0;
  }
  char why[200];
  if (rg_place_load(&g->place, why, sizeof(why)) != 0) {
    g->place_state = -1;
    RG_WARN("gather kernel unavailable (%s); eager gathers on GPU memory copy with cuMemcpyAsync instead", why);
    return 0;
  }
  /* One empty placement now makes the driver finish loading the module (it may defer that
   * to the first launch), so no launch during a collective has to load anything. */
  volatile uint32_t* status = &g->place_status[0];
  status[RG_PLACE_STATUS] = RG_PLACE_PENDING;
  status[RG_PLACE_CANCEL] = 0;
  status[RG_PLACE_GO] = 1;
  rg_place_args a = {.arrival = g->arrival, .lanes = 0, .status = status, .timeout_ns = 1000000000ull};
  CUresult r = rg_place_launch(&g->place, g->stream, &a);
  if (r == CUDA_SUCCESS) r = cu->cuStreamSynchronize(g->stream);
  if (r != CUDA_SUCCESS || status[RG_PLACE_STATUS] != RG_PLACE_DONE) {
    rg_place_unload(&g->place);
    g->place_state = -1;
    RG_WARN("gather kernel failed its first launch (%s, status %u); eager gathers on GPU memory copy with "
            "cuMemcpyAsync instead", rg_cuda_strerror(r), status[RG_PLACE_STATUS]);
    return 0;
  }
  g->place_state = 1;
  return 0;
}

/* Records what one received completion says. */
static int dispatch(rg_gather_comm* g, const rg_cqe* c) {
  if (c->status != 0 || RG_IMM_CLASS(c->imm) != RG_IMM_GATHER) return -1;
  uint32_t kind = (c->imm >> 24) & 0xf, seq24 = c->imm & SEQ_MASK;
  uint32_t slot = seq24 & (RG_GATHER_DEPTH - 1);
  switch (kind) {
  case RG_GIMM_READY:
    g->ready_seq[slot] = seq24;
    break;
  case RG_GIMM_DATA:
  case RG_GIMM_EAGER:
    if (g->arrived_seq[slot] != seq24) {
      g->arrived_seq[slot] = seq24;
      g->arrived[slot] = 0;
    }
    g->arrived[slot]++;
    break;
  case RG_GIMM_CREDIT: {
    /* Credits name a 24-bit seq; widen it against our own call count. */
    uint64_t wide = (g->next_seq & ~(uint64_t)SEQ_MASK) | seq24;
    if (wide >= g->next_seq) wide -= (uint64_t)SEQ_MASK + 1;
    if (wide > g->peer_consumed) g->peer_consumed = wide;
    break;
  }
  case RG_GIMM_PROBE:
    g->probe_seen++;
    break;
  case RG_GIMM_PROBE_ACK:
    g->probe_acked++;
    break;
  default:
    return -1;
  }
  return 0;
}

/* Takes every completion one lane holds: RG_ERR_DEAD once it failed and holds no more. */
static int drain_lane(rg_gather_comm* g, rg_lane* lane) {
  rg_cqe c[POLL_BATCH];
  int n, failed = 0;
  do {
    n = rg_poll_recv(lane, c, POLL_BATCH);
    for (int i = 0; i < n; i++)
      if (dispatch(g, &c[i]) != 0) return RG_ERR_INVALID;
  } while (n == POLL_BATCH);
  failed |= n < 0;
  do {
    n = rg_poll_send(lane, c, POLL_BATCH);
    for (int i = 0; i < n; i++) {
      if (c[i].status != 0 || c[i].wr_id == 0 || c[i].wr_id > RG_GATHER_DEPTH) return RG_ERR_INVALID;
      g->calls[c[i].wr_id - 1].writes_pending--;
    }
  } while (n == POLL_BATCH);
  failed |= n < 0;
  return failed ? RG_ERR_DEAD : 0;
}

/* Takes every completion the lanes hold. A lane that failed is drained of both its
 * queues, and only then reported: the peer may close right after its last call, and the
 * closing frame can be read in the same poll that delivers the peer's last part. */
static int poll_all(rg_gather_comm* g) {
  int failed = 0;
  for (int l = 0; l < g->link->nlanes; l++) {
    rg_lane* lane = &g->link->lane[l];
    int rc = drain_lane(g, lane);
    /* The send poll may have read the frames before the failure: their completions wait
     * in the receive queue, and a second pass takes them (a dead lane reads no more). */
    if (rc == RG_ERR_DEAD) rc = drain_lane(g, lane);
    if (rc == RG_ERR_INVALID) return rc;
    failed |= rc != 0;
  }
  return failed ? RG_ERR_DEAD : 0;
}

/* Posts this rank's part, striped over the lanes, each stripe followed by a
 * zero-length WRITE_IMM that tells the peer this lane's share is in place. */
static int post_part(rg_gather_comm* g, rg_gather_call* c, uint64_t remote, const uint32_t* rkeys) {
  uint32_t kind = c->mode == RG_MODE_EAGER ? RG_GIMM_EAGER : RG_GIMM_DATA;
  int nl = g->link->nlanes;
  uint64_t per = (c->my_len + (uint64_t)nl - 1) / (uint64_t)nl;
  per = (per + STRIPE_ALIGN - 1) / STRIPE_ALIGN * STRIPE_ALIGN;
  for (int l = 0; l < nl; l++) {
    if (c->lanes_posted & (1u << l)) continue;
    rg_lane* lane = &g->link->lane[l];
    uint64_t b = (uint64_t)l * per, e = b + per;
    if (b > c->my_len) b = c->my_len;
    if (e > c->my_len) e = c->my_len;
    rg_wr wr[3];
    int n = 0, credit = 0;
    if (e > b)
      wr[n++] = (rg_wr){.local = c->send + b, .mr = c->send_mr, .len = e - b, .remote = remote + b,
                        .rkey = rkeys[lane->peer_hca], .op = RG_OP_WRITE};
    wr[n] = (rg_wr){.wr_id = (uint64_t)c->req.index + 1, .imm = RG_GIMM(kind, c->seq), .op = RG_OP_WRITE_IMM,
                    .flags = RG_WR_SIGNALED};
    if (c->mode == RG_MODE_EAGER) { /* the arrival word rides on the notice, after the stripe */
      uint64_t slot = c->seq & (RG_GATHER_DEPTH - 1);
      wr[n].local = &c->seq;
      wr[n].len = sizeof(c->seq);
      wr[n].remote = g->peer_arrival_addr + (slot * RG_MAX_LANES + (uint64_t)l) * sizeof(uint64_t);
      wr[n].rkey = g->peer_landing_rkey[lane->peer_hca];
      wr[n].flags |= RG_WR_INLINE;
    }
    n++;
    if (l == 0 && g->mode != RG_MODE_RENDEZVOUS && g->credit_sent != g->consumed) {
      /* Returned landing slots ride with this rank's part: no post of their own between a
       * call's completion and NCCL hearing of it. */
      wr[n++] = (rg_wr){.imm = RG_GIMM(RG_GIMM_CREDIT, g->consumed), .op = RG_OP_WRITE_IMM};
      credit = 1;
    }
    int rc = rg_post(lane, wr, n);
    if (rc != RG_OK) return rc; /* RG_ERR_FULL: the retry starts at this lane */
    if (credit) g->credit_sent = g->consumed;
    c->lanes_posted |= 1u << l;
    c->writes_pending++;
  }
  return RG_OK;
}

/* Whether every lane's arrival word of the call's landing slot names the call. */
static int arrival_complete(const rg_gather_comm* g, const rg_gather_call* c) {
  uint64_t slot = c->seq & (RG_GATHER_DEPTH - 1);
  for (int l = 0; l < g->link->nlanes; l++)
    if (g->arrival[slot * RG_MAX_LANES + (uint64_t)l] != c->seq) return 0;
  return 1;
}

/* Both copies into this rank's rows happen only after the peer's part arrived, so a
 * failed exchange leaves the rows untouched. Returns -2 when the arrival words disagree. */
static int place_rows(rg_gather_comm* g, rg_gather_call* c) {
  uint32_t slot = (uint32_t)(c->seq & (RG_GATHER_DEPTH - 1));
  const uint8_t* landing = g->landing + (uint64_t)slot * g->slot_bytes;
  int own_in_place = c->send == c->recv + c->my_off;
  if (c->mode == RG_MODE_EAGER && !arrival_complete(g, c)) return -2;
  if (!c->cuda) {
    if (c->mode == RG_MODE_EAGER && c->peer_len) memcpy(c->recv + c->peer_off, landing, c->peer_len);
    if (!own_in_place && c->my_len) memcpy(c->recv + c->my_off, c->send, c->my_len);
    c->landed = 1;
    return 0;
  }
  const rg_cuda_api* cu = rg_cuda();
  if (ensure_stream(g) != 0) return -1;
  if (c->copy_done == NULL && cu->cuEventCreate(&c->copy_done, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) return -1;
  if (c->mode == RG_MODE_EAGER && c->peer_len &&
      cu->cuMemcpyAsync((CUdeviceptr)(uintptr_t)(c->recv + c->peer_off), (CUdeviceptr)(uintptr_t)landing,
                        c->peer_len, g->stream) != CUDA_SUCCESS)
    return -1;
  if (!own_in_place && c->my_len &&
      cu->cuMemcpyAsync((CUdeviceptr)(uintptr_t)(c->recv + c->my_off), (CUdeviceptr)(uintptr_t)c->send, c->my_len,
                        g->stream) != CUDA_SUCCESS)
    return -1;
  if (cu->cuEventRecord(c->copy_done, g->stream) != CUDA_SUCCESS) return -1;
  c->copying = 1;
  return 0;
}

/* The gather kernel places eager calls whose buffers are both CUDA memory, where it was
 * loaded at connect: loading it later, with NCCL's kernel waiting on this thread, hangs. */
static int uses_kernel(const rg_gather_comm* g, const rg_gather_call* c) {
  return c->mode == RG_MODE_EAGER && c->send_cuda && c->recv_cuda && g->place_state == 1;
}

/* Launches the gather kernel before the peer's part arrives. Returns 0, or -1 on error. */
static int launch_place(rg_gather_comm* g, rg_gather_call* c) {
  uint64_t slot = c->seq & (RG_GATHER_DEPTH - 1);
  volatile uint32_t* status = &g->place_status[RG_PLACE_WORDS * slot];
  status[RG_PLACE_STATUS] = RG_PLACE_PENDING;
  status[RG_PLACE_CANCEL] = 0;
  status[RG_PLACE_GO] = 0;
  rg_place_args a = {.arrival = &g->arrival[slot * RG_MAX_LANES], .lanes = g->link->nlanes, .seq = c->seq,
                     .landing = g->landing + slot * g->slot_bytes, .peer_row = c->recv + c->peer_off,
                     .peer_len = c->peer_len, .own_src = c->send, .own_row = c->recv + c->my_off,
                     .own_len = c->my_len, .status = status,
                     .timeout_ns = g->timeout_ns + 1000000000ull}; /* the host's own timeout reports first */
  if (rg_place_launch(&g->place, g->stream, &a) != CUDA_SUCCESS) return -1;
  c->launched = 1; /* from here a failure must cancel it */
  if (rg_cuda()->cuEventRecord(c->copy_done, g->stream) != CUDA_SUCCESS) return -1;
  c->copying = 1;
  return 0;
}

static int post_ready_token(rg_gather_comm* g, rg_gather_call* c) {
  uint32_t slot = (uint32_t)(c->seq & (RG_GATHER_DEPTH - 1));
  rg_ready_token t = {.seq = c->seq, .addr = (uint64_t)(uintptr_t)c->recv, .size = c->bytes};
  for (int h = 0; h < RG_MAX_HCAS && c->recv_mr != NULL; h++) t.rkey[h] = c->recv_mr->rkey[h];
  rg_wr wr = {.local = &t, .len = sizeof(t), .remote = g->peer_ctrl_addr + slot * sizeof(rg_ready_token),
              .rkey = g->peer_ctrl_rkey[g->link->lane[0].peer_hca], .imm = RG_GIMM(RG_GIMM_READY, c->seq),
              .op = RG_OP_WRITE_IMM, .flags = RG_WR_INLINE};
  return rg_post(&g->link->lane[0], &wr, 1);
}

static ncclResult_t advance(rg_gather_comm* g, rg_gather_call* c) {
  uint32_t slot = (uint32_t)(c->seq & (RG_GATHER_DEPTH - 1));
  uint32_t seq24 = (uint32_t)(c->seq & SEQ_MASK);
  if (!c->launched && uses_kernel(g, c) && launch_place(g, c) != 0)
    return fail(g, c, "launching the gather kernel");
  if (c->mode == RG_MODE_RENDEZVOUS && !c->token_sent) {
    int rc = post_ready_token(g, c);
    if (rc == RG_ERR_FULL) return ncclSuccess;
    if (rc != RG_OK) return fail(g, c, "posting the ready token");
    c->token_sent = 1;
  }
  if (!c->posted) {
    if (c->mode == RG_MODE_RENDEZVOUS && g->ready_seq[slot] == seq24) {
      rg_ready_token t = g->ctrl->ready[slot];
      if (t.seq != c->seq || t.size < c->my_off + c->my_len)
        return fail(g, c, "the peer's ready token does not match this call");
      int rc = post_part(g, c, t.addr + c->my_off, t.rkey);
      if (rc == RG_ERR_FULL) return ncclSuccess;
      if (rc != RG_OK) return fail(g, c, "posting the write");
      c->posted = 1;
    } else if (c->mode == RG_MODE_EAGER && c->seq <= g->peer_consumed + RG_GATHER_DEPTH) {
      int rc = post_part(g, c, g->peer_landing_addr + (uint64_t)slot * g->slot_bytes, g->peer_landing_rkey);
      if (rc == RG_ERR_FULL) return ncclSuccess;
      if (rc != RG_OK) return fail(g, c, "posting the write");
      c->posted = 1;
    }
  }
  int all_arrived = g->arrived_seq[slot] == seq24 && g->arrived[slot] == g->link->nlanes;
  if (c->launched && !c->go_set && all_arrived) {
    /* Every lane's write has completed, so its bytes are in place: the kernel may copy. */
    if (!arrival_complete(g, c)) return fail(g, c, "the landing slot's arrival words do not name this call");
    g->place_status[RG_PLACE_WORDS * slot + RG_PLACE_GO] = 1;
    c->go_set = 1;
  }
  if (!c->landed && !c->copying && !c->launched && all_arrived) {
    int rc = place_rows(g, c);
    if (rc == -2) return fail(g, c, "the landing slot's arrival words do not name this call");
    if (rc != 0) return fail(g, c, "copying into the rows on the GPU");
  }
  if (c->copying) {
    CUresult r = rg_cuda()->cuEventQuery(c->copy_done);
    if (r == CUDA_ERROR_NOT_READY) return ncclSuccess;
    if (r != CUDA_SUCCESS) return fail(g, c, c->launched ? "running the gather kernel" : "copying into the rows on the GPU");
    c->copying = 0;
    if (c->launched) {
      uint32_t st = g->place_status[RG_PLACE_WORDS * slot + RG_PLACE_STATUS];
      if (st != RG_PLACE_DONE)
        return fail(g, c, st == RG_PLACE_TIMED_OUT ? "the gather kernel saw no arrival within its timeout"
                          : st == RG_PLACE_CANCELLED ? "the gather kernel was cancelled"
                                                     : "the gather kernel ended without a verdict");
      rg_stats_add(RG_STAT_GATHERS_KERNEL, 1);
    }
    c->landed = 1;
  }
  return ncclSuccess;
}

static const char* waiting_for(const rg_gather_comm* g, const rg_gather_call* c) {
  uint32_t slot = (uint32_t)(c->seq & (RG_GATHER_DEPTH - 1));
  if (!c->posted && c->mode == RG_MODE_RENDEZVOUS) return "the peer's ready token did not arrive";
  if (!c->posted) return "the peer did not return a landing slot";
  if (!c->landed && g->arrived_seq[slot] != (c->seq & SEQ_MASK)) return "no data from the peer arrived";
  if (!c->landed) return "the peer's data arrived on some lanes only";
  if (c->writes_pending) return "the peer did not acknowledge this rank's write";
  return "the copy into the rows did not finish";
}

/* A call the link failed under: the WARN says what it still waited for. */
static ncclResult_t fail_link(rg_gather_comm* g, rg_gather_call* c) {
  char what[160];
  snprintf(what, sizeof(what), "the link failed (%s)", waiting_for(g, c));
  return fail(g, c, what);
}

/* Credits normally ride with the next call's part (post_part); they go alone only once half
 * the landing slots wait to be returned, so a peer running ahead never stalls on them. */
static void send_credit(rg_gather_comm* g) {
  if (g->mode == RG_MODE_RENDEZVOUS || g->consumed - g->credit_sent < RG_GATHER_DEPTH / 2) return;
  rg_wr wr = {.imm = RG_GIMM(RG_GIMM_CREDIT, g->consumed), .op = RG_OP_WRITE_IMM};
  if (rg_post(&g->link->lane[0], &wr, 1) == RG_OK) g->credit_sent = g->consumed;
}

static ncclResult_t progress(rg_gather_comm* g) {
  /* A lane that died after delivering everything a call needs still lets that call finish. */
  int link_failed = poll_all(g) != 0;
  for (uint64_t s = g->consumed + 1; s < g->next_seq; s++) {
    rg_gather_call* c = &g->calls[s & (RG_GATHER_DEPTH - 1)];
    if (c->req.kind != RG_REQ_GATHER || c->seq != s || c->req.done) continue;
    ncclResult_t r = advance(g, c);
    if (r != ncclSuccess) return r;
    if (c->posted && c->writes_pending == 0 && c->landed) {
      c->req.done = 1;
      c->finished = 1;
      uint64_t ns = rg_now_ns() - c->start_ns;
      rg_stats_latency(ns);
      rg_stats_add(RG_STAT_GATHERS, 1);
      rg_stats_add(RG_STAT_GATHER_BYTES, c->bytes);
      rg_stats_add(c->mode == RG_MODE_EAGER ? RG_STAT_GATHERS_EAGER : RG_STAT_GATHERS_RENDEZVOUS, 1);
    }
  }
  if (link_failed)
    for (uint64_t s = g->consumed + 1; s < g->next_seq; s++) {
      rg_gather_call* c = &g->calls[s & (RG_GATHER_DEPTH - 1)];
      if (c->req.kind == RG_REQ_GATHER && c->seq == s && !c->finished) return fail_link(g, c);
    }
  /* Landing slots are returned in order: a call is consumed once it and all before are done. */
  while (g->consumed + 1 < g->next_seq) {
    rg_gather_call* c = &g->calls[(g->consumed + 1) & (RG_GATHER_DEPTH - 1)];
    if (c->seq != g->consumed + 1 || !c->finished) break;
    g->consumed++;
  }
  send_credit(g);
  return ncclSuccess;
}

int rg_gather_iallgather(void* collComm, void* sendData, int nRecvParts, const rg_sge* recvParts,
                         uint64_t bytesPerRank, uint64_t windowOffset, uint64_t windowBytes, void* sendMhandle,
                         void** request) {
  rg_gather_comm* g = collComm;
  *request = NULL;
  if (g->warned) return ncclRemoteError; /* the group failed earlier; its WARN said why */
  if (nRecvParts != 1) {
    RG_WARN("iallgather with %d receive parts; this plugin takes exactly 1", nRecvParts);
    return ncclInvalidArgument;
  }
  if (recvParts[0].size < windowBytes || windowOffset + windowBytes > 2 * bytesPerRank) {
    RG_WARN("iallgather window %llu+%llu does not fit %llu bytes a rank or its %llu-byte receive part",
            (unsigned long long)windowOffset, (unsigned long long)windowBytes, (unsigned long long)bytesPerRank,
            (unsigned long long)recvParts[0].size);
    return ncclInvalidArgument;
  }
  rg_gather_call* c = &g->calls[g->next_seq & (RG_GATHER_DEPTH - 1)];
  /* A slot is reused once its call is reported and consumed in order; else NCCL retries. */
  if (c->req.kind != RG_REQ_FREE || (c->seq != 0 && g->consumed < c->seq)) return ncclSuccess;
  uint64_t p0off, p0len, p1off, p1len;
  part_of(0, bytesPerRank, windowOffset, windowBytes, &p0off, &p0len);
  part_of(1, bytesPerRank, windowOffset, windowBytes, &p1off, &p1len);
  const rg_mr* smr = sendMhandle;
  const rg_mr* rmr = recvParts[0].mhandle;
  uint64_t mine = g->rank == 0 ? p0len : p1len;
  if ((mine > 0 && smr == NULL) || (windowBytes > 0 && rmr == NULL)) {
    RG_WARN("iallgather buffers are not registered (send %p, receive %p)", sendMhandle, recvParts[0].mhandle);
    return ncclInvalidArgument;
  }
  CUevent keep = c->copy_done;
  memset((char*)c + sizeof(rg_request), 0, sizeof(*c) - sizeof(rg_request));
  c->copy_done = keep;
  c->seq = g->next_seq;
  c->mode = rg_gather_call_mode(g, windowBytes, p0len, p1len);
  c->bytes = windowBytes;
  c->my_off = g->rank == 0 ? p0off : p1off;
  c->my_len = mine;
  c->peer_off = g->rank == 0 ? p1off : p0off;
  c->peer_len = g->rank == 0 ? p1len : p0len;
  c->send = sendData;
  c->send_mr = smr;
  c->recv = recvParts[0].address;
  c->recv_mr = rmr;
  c->send_cuda = smr && smr->mem == RG_MEM_CUDA;
  c->recv_cuda = rmr && rmr->mem == RG_MEM_CUDA;
  c->cuda = c->send_cuda || c->recv_cuda;
  c->start_ns = rg_now_ns();
  c->req.kind = RG_REQ_GATHER;
  c->req.done = 0;
  c->req.id = c->seq;
  c->req.sizes[0] = windowBytes;
  g->next_seq++;
  if (!(g->logged & 1)) {
    g->logged |= 1;
    RG_INFO(NCCL_NET | NCCL_COLL, "first one-shot gather with %s: window %llu+%llu of %llu bytes, %s mode, %s memory",
            g->link->peer, (unsigned long long)windowOffset, (unsigned long long)windowBytes,
            (unsigned long long)(2 * bytesPerRank), c->mode == RG_MODE_EAGER ? "eager" : "rendezvous",
            c->cuda ? "CUDA" : "host");
  }
  *request = c;
  ncclResult_t r = progress(g);
  return r;
}

static ncclResult_t test_flush(rg_request* req, int* done) {
  rg_gather_comm* g = req->comm;
  if (!req->done && rg_flush_reap(g->link, g->flush_reqs, RG_GATHER_FLUSH_REQS) != 0) return fail(g, NULL, "flushing");
  if (!req->done) return ncclSuccess;
  *done = 1;
  req->kind = RG_REQ_FREE;
  return ncclSuccess;
}

int rg_gather_test(rg_request* req, int* done, uint64_t* sizes) {
  if (req->kind == RG_REQ_GATHER_FLUSH) {
    *done = 0;
    return test_flush(req, done);
  }
  rg_gather_call* c = (rg_gather_call*)req;
  rg_gather_comm* g = req->comm;
  *done = 0;
  if (!req->done && !c->error) {
    ncclResult_t r = progress(g);
    if (r != ncclSuccess && !req->done) return r;
    if (!req->done && ++g->polls % CHECK_EVERY == 0) {
      uint64_t now = rg_now_ns();
      for (int l = 0; l < g->link->nlanes; l++)
        if (rg_check(&g->link->lane[l], now) != RG_OK) {
          progress(g); /* a call the link delivered in full before failing still completes */
          if (!req->done) return fail_link(g, c);
          break;
        }
      if (!req->done && now - c->start_ns > g->timeout_ns) {
        char what[160];
        snprintf(what, sizeof(what), "%s within %llu ms", waiting_for(g, c),
                 (unsigned long long)(g->timeout_ns / 1000000));
        return fail(g, c, what);
      }
    }
  }
  if (c->error) return ncclRemoteError;
  if (!req->done) return ncclSuccess;
  *done = 1;
  if (sizes) sizes[0] = req->sizes[0];
  if (!(g->logged & 2)) {
    g->logged |= 2;
    RG_INFO(NCCL_NET | NCCL_COLL, "first one-shot gather with %s complete after %llu us", g->link->peer,
            (unsigned long long)((rg_now_ns() - c->start_ns) / 1000));
  }
  req->kind = RG_REQ_FREE;
  req->done = 0;
  progress(g); /* returns the landing slot at once; a failure here shows on the next call */
  return ncclSuccess;
}

int rg_gather_iflush(void* collComm, void* data, int size, void* mhandle, void** request) {
  rg_gather_comm* g = collComm;
  *request = NULL;
  rg_link* link = g->link;
  if (link->flush.ops == NULL || size <= 0) return ncclSuccess;
  const rg_mr* mr = mhandle;
  if (mr == NULL) {
    RG_WARN("collNet flush of a buffer that has no registration");
    return ncclInvalidArgument;
  }
  int fi = rg_flush_free_slot(g->flush_reqs, RG_GATHER_FLUSH_REQS);
  if (fi == RG_GATHER_FLUSH_REQS) return ncclSuccess;
  int rc = rg_flush_post(link, fi, data, mr);
  if (rc == RG_ERR_FULL) return ncclSuccess;
  if (rc != RG_OK) return fail(g, NULL, "posting the flush");
  rg_request* req = &g->flush_reqs[fi];
  req->kind = RG_REQ_GATHER_FLUSH;
  req->done = 0;
  req->id = g->flushes++;
  *request = req;
  return ncclSuccess;
}

int rg_gather_probe(rg_gather_comm* g, uint64_t timeout_ns, char* err, int errlen) {
  int nl = g->link->nlanes;
  uint64_t start = rg_now_ns();
  for (int l = 0; l < nl; l++) {
    rg_wr wr = {.imm = RG_GIMM(RG_GIMM_PROBE, 0), .op = RG_OP_WRITE_IMM};
    if (rg_post(&g->link->lane[l], &wr, 1) != RG_OK) {
      snprintf(err, errlen, "sending the probe on lane %d failed: %s", l, rg_why(&g->link->lane[l]));
      return -1;
    }
  }
  int acked_sent = 0;
  while (g->probe_acked < nl) {
    if (poll_all(g) != 0) {
      snprintf(err, errlen, "the link failed during the live check: %s", rg_why(&g->link->lane[0]));
      return -1;
    }
    if (!acked_sent && g->probe_seen == nl) {
      for (int l = 0; l < nl; l++) {
        rg_wr wr = {.imm = RG_GIMM(RG_GIMM_PROBE_ACK, 0), .op = RG_OP_WRITE_IMM};
        if (rg_post(&g->link->lane[l], &wr, 1) != RG_OK) {
          snprintf(err, errlen, "acknowledging the probe on lane %d failed: %s", l, rg_why(&g->link->lane[l]));
          return -1;
        }
      }
      acked_sent = 1;
    }
    if (rg_now_ns() - start > timeout_ns) {
      snprintf(err, errlen, "live check timed out after %llu ms: %s", (unsigned long long)(timeout_ns / 1000000),
               g->probe_seen < nl ? "the peer's probe did not arrive" : "the peer did not acknowledge our probe");
      return -1;
    }
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
  }
  return 0;
}
