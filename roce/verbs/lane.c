/* A verbs lane: one RC queue pair with its own completion queue. The engine only writes
 * (RDMA writes, never with immediate), so no receive is ever posted or completed.
 *
 * One thread drives a lane at a time (the engine's proxy), so there are no locks.
 * Send-queue slots are retired only by signaled completions, so every sig_every-th work
 * request is signaled internally; those completions, and the liveness probe's, are
 * filtered out of what the caller sees. Every request in flight is remembered (its remote
 * address, key and length), so that a failed one is named in the lane's error. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ibv.h"

#define POLL_BATCH 16
/* The receive queue's entries: the least a queue pair has, as none is ever posted. */
#define RECV_DEPTH 1
/* An unsignaled request's wr_id: this bit and its place in the posted ring. A failed request
 * completes with its wr_id, signaled or not. */
#define UNSIGNALED_BIT (1ull << 63)

enum { SIG_USER = 1, SIG_INTERNAL = 2, SIG_PROBE = 3 };

/* A signaled work request in flight. Its completion retires its own slot and those of
 * the unsignaled requests posted before it. */
typedef struct sig_entry {
  uint64_t wr_id; /* the caller's id, for SIG_USER */
  uint64_t post;  /* its place in the posted ring */
  uint32_t retire;
  uint32_t kind;
} sig_entry;

/* What a request in flight wrote where, for the error that names a failed one. */
typedef struct posted_req {
  uint64_t remote;
  uint32_t rkey;
  uint32_t len;
  int probe;
} posted_req;

struct rg_vlane {
  struct ibv_qp* qp;
  struct ibv_cq* scq;
  int owned; /* destroy qp and CQ with the lane */
  int hca;
  char hca_name[64];
  char peer[64];
  uint32_t sq_depth, sig_every;

  uint32_t sq_used;    /* send slots not yet retired */
  uint32_t unsignaled; /* requests posted since the last signaled one */
  sig_entry* sig;      /* ring of sq_depth: signaled requests in flight, in post order */
  uint64_t sig_head, sig_tail;
  rg_cqe* done; /* ring of sq_depth: the caller's completions reaped by check() */
  posted_req* posted; /* ring of sq_depth: every request in flight, by post number */
  uint64_t posts;     /* requests posted so far */
  uint64_t done_head, done_tail;

  uint64_t timeout_ns;
  uint64_t last_progress_ns; /* the last completion of any kind */
  int started;
  uint64_t probe_addr;
  uint32_t probe_rkey;
  int probe_inflight;
  uint64_t probe_posted_ns;
  uint64_t probe_value; /* copied inline at post */
  uint64_t full_since_ns; /* when check() first found the send queue full, 0 if not */

  int dead;
  char why[512];
};

static void lane_fail(rg_vlane* l, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static void lane_fail(rg_vlane* l, const char* fmt, ...) {
  if (l->dead) return; /* keep the first cause */
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(l->why, sizeof(l->why), fmt, ap);
  va_end(ap);
  l->dead = 1;
}

static const char* status_hint(enum ibv_wc_status s) {
  switch (s) {
  case IBV_WC_RETRY_EXC_ERR:
    return ": the peer stopped answering (link down, cable cut, or its process died)";
  case IBV_WC_RNR_RETRY_EXC_ERR:
    return ": the peer had no receive posted";
  case IBV_WC_REM_ACCESS_ERR:
    return ": the peer refused the key or the address range";
  case IBV_WC_LOC_PROT_ERR:
    return ": a local buffer lies outside its registration";
  case IBV_WC_LOC_QP_OP_ERR:
    return ": it could not be sent (is this port down?)";
  case IBV_WC_WR_FLUSH_ERR:
    return ": the queue pair had already failed";
  default:
    return "";
  }
}

/* The post number of the request a completion belongs to, or UINT64_MAX when its wr_id is
 * none this lane gave. At most sq_depth requests are in flight: a number in the last sq_depth
 * posts still has its slot in the ring. */
static uint64_t post_of(const rg_vlane* l, uint64_t wr_id) {
  uint64_t post = UINT64_MAX;
  if (wr_id & UNSIGNALED_BIT)
    post = wr_id & ~UNSIGNALED_BIT;
  else if (wr_id >= l->sig_head && wr_id < l->sig_tail)
    post = l->sig[wr_id % l->sq_depth].post;
  return post < l->posts && l->posts - post <= l->sq_depth ? post : UINT64_MAX;
}

static void fail_wc(rg_vlane* l, const struct ibv_wc* wc) {
  const uint64_t post = post_of(l, wc->wr_id);
  const posted_req* r = post == UINT64_MAX ? NULL : &l->posted[post % l->sq_depth];
  char req[128] = "";
  if (r != NULL && wc->status != IBV_WC_WR_FLUSH_ERR)
    snprintf(req, sizeof(req), " (the request: a write of %u byte%s to 0x%llx with rkey 0x%x)", r->len,
             r->len == 1 ? "" : "s", (unsigned long long)r->remote, r->rkey);
  lane_fail(l, "%s %s over %s (qp 0x%x) failed: %s (status %d, vendor error 0x%x)%s%s",
            r != NULL && r->probe ? "liveness probe to" : "RDMA request to", l->peer, l->hca_name, l->qp->qp_num,
            rg_ibv_wc_status_str(wc->status), (int)wc->status, wc->vendor_err, status_hint(wc->status), req);
}

/* Remembers a request about to be posted; returns its post number. */
static uint64_t remember(rg_vlane* l, uint64_t remote, uint32_t rkey, uint32_t len, int probe) {
  const uint64_t post = l->posts++;
  l->posted[post % l->sq_depth] = (posted_req){.remote = remote, .rkey = rkey, .len = len, .probe = probe};
  return post;
}

static uint32_t room(const rg_vlane* l) {
  return l->sq_depth - l->sq_used - (uint32_t)(l->done_tail - l->done_head);
}

static int covers(const rg_mr* mr, int hca, const void* p, uint64_t len) {
  if (mr == NULL || hca >= mr->nhcas) return 0;
  uint64_t a = (uint64_t)(uintptr_t)p;
  return a >= mr->addr && a - mr->addr <= mr->len && len <= mr->len - (a - mr->addr);
}

/* Takes every send completion: retires slots, keeps the caller's, drops internal ones. */
static int reap_send(rg_vlane* l) {
  struct ibv_wc wc[POLL_BATCH];
  for (;;) {
    int n = ibv_poll_cq(l->scq, POLL_BATCH, wc);
    if (n < 0) {
      lane_fail(l, "polling the send completions of the lane to %s over %s failed (%d)", l->peer, l->hca_name, n);
      return -1;
    }
    if (n == 0) return 0;
    for (int i = 0; i < n; i++) {
      int in_order = l->sig_head != l->sig_tail && wc[i].wr_id == l->sig_head;
      if (wc[i].status != IBV_WC_SUCCESS) {
        fail_wc(l, &wc[i]);
        return -1;
      }
      if (!in_order) {
        lane_fail(l, "send completion with id %llu from the lane to %s over %s, expected %llu",
                  (unsigned long long)wc[i].wr_id, l->peer, l->hca_name, (unsigned long long)l->sig_head);
        return -1;
      }
      sig_entry* e = &l->sig[l->sig_head++ % l->sq_depth];
      l->sq_used -= e->retire;
      if (e->kind == SIG_USER)
        l->done[l->done_tail++ % l->sq_depth] = (rg_cqe){.wr_id = e->wr_id};
      else if (e->kind == SIG_PROBE)
        l->probe_inflight = 0;
    }
    l->last_progress_ns = rg_now_ns();
    l->full_since_ns = 0;
    if (n < POLL_BATCH) return 0;
  }
}

static int lane_post(void* impl, const rg_wr* wrs, int n) {
  rg_vlane* l = impl;
  if (l->dead) return RG_ERR_DEAD;
  if (n <= 0 || n > RG_VLANE_MAX_POST) return RG_ERR_INVALID;
  if (room(l) < (uint32_t)n) {
    if (reap_send(l) != 0) return RG_ERR_DEAD;
    if (room(l) < (uint32_t)n) return RG_ERR_FULL;
  }
  struct ibv_send_wr sw[RG_VLANE_MAX_POST];
  struct ibv_sge sge[RG_VLANE_MAX_POST];
  sig_entry pend[RG_VLANE_MAX_POST];
  int npend = 0;
  uint32_t run = l->unsignaled;
  for (int i = 0; i < n; i++) {
    const rg_wr* w = &wrs[i];
    struct ibv_send_wr* s = &sw[i];
    memset(s, 0, sizeof(*s));
    s->opcode = IBV_WR_RDMA_WRITE;
    if (w->len > UINT32_MAX) return RG_ERR_INVALID;
    sge[i] = (struct ibv_sge){.addr = (uint64_t)(uintptr_t)w->local, .length = (uint32_t)w->len};
    if (w->flags & RG_WR_INLINE) {
      if (w->len > RG_INLINE_MAX) return RG_ERR_INVALID;
      s->send_flags |= IBV_SEND_INLINE; /* copied at post: no key needed */
    } else if (w->len > 0) {
      if (!covers(w->mr, l->hca, w->local, w->len)) return RG_ERR_INVALID;
      sge[i].lkey = w->mr->lkey[l->hca];
    }
    if (w->len > 0) {
      s->sg_list = &sge[i];
      s->num_sge = 1;
    }
    s->wr.rdma.remote_addr = w->remote;
    s->wr.rdma.rkey = w->rkey;
    const uint64_t post = l->posts + (uint64_t)i;
    int user = (w->flags & RG_WR_SIGNALED) != 0;
    if (user || ++run >= l->sig_every) {
      s->send_flags |= IBV_SEND_SIGNALED;
      s->wr_id = l->sig_tail + (uint64_t)npend;
      pend[npend++] = (sig_entry){.wr_id = w->wr_id, .post = post, .retire = user ? run + 1 : run,
                                  .kind = user ? SIG_USER : SIG_INTERNAL};
      run = 0;
    } else {
      s->wr_id = UNSIGNALED_BIT | post;
    }
    s->next = i + 1 < n ? &sw[i + 1] : NULL;
  }
  struct ibv_send_wr* bad = NULL;
  int rc = ibv_post_send(l->qp, sw, &bad);
  if (rc != 0) {
    lane_fail(l, "ibv_post_send of %d requests to %s over %s failed: %s (errno %d)", n, l->peer, l->hca_name,
              strerror(rc), rc);
    return RG_ERR_DEAD;
  }
  for (int i = 0; i < n; i++) remember(l, wrs[i].remote, wrs[i].rkey, (uint32_t)wrs[i].len, 0);
  for (int j = 0; j < npend; j++) l->sig[l->sig_tail++ % l->sq_depth] = pend[j];
  l->sq_used += (uint32_t)n;
  l->unsignaled = run;
  return RG_OK;
}

static int lane_poll_send(void* impl, rg_cqe* out, int max) {
  rg_vlane* l = impl;
  if (l->dead) return RG_ERR_DEAD;
  if (reap_send(l) != 0) return RG_ERR_DEAD;
  int n = 0;
  while (n < max && l->done_head != l->done_tail) out[n++] = l->done[l->done_head++ % l->sq_depth];
  return n;
}

/* An 8-byte signaled write into the peer's probe word. RC executes it after every earlier
 * request, so it fails (retries exhausted) when the link or the peer's queue pair is gone. */
static int post_probe(rg_vlane* l, uint64_t now) {
  l->probe_value++;
  struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)&l->probe_value, .length = sizeof(l->probe_value)};
  struct ibv_send_wr wr = {.wr_id = l->sig_tail,
                           .sg_list = &sge,
                           .num_sge = 1,
                           .opcode = IBV_WR_RDMA_WRITE,
                           .send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE};
  wr.wr.rdma.remote_addr = l->probe_addr;
  wr.wr.rdma.rkey = l->probe_rkey;
  struct ibv_send_wr* bad = NULL;
  int rc = ibv_post_send(l->qp, &wr, &bad);
  if (rc == 0) remember(l, l->probe_addr, l->probe_rkey, sizeof(l->probe_value), 1);
  if (rc != 0) {
    lane_fail(l, "posting a liveness probe to %s over %s failed: %s (errno %d)", l->peer, l->hca_name, strerror(rc),
              rc);
    return -1;
  }
  l->sig[l->sig_tail++ % l->sq_depth] = (sig_entry){.post = l->posts - 1, .retire = l->unsignaled + 1, .kind = SIG_PROBE};
  l->unsignaled = 0;
  l->sq_used++;
  l->probe_inflight = 1;
  l->probe_posted_ns = now;
  return 0;
}

static int lane_check(void* impl, uint64_t now) {
  rg_vlane* l = impl;
  if (l->dead) return RG_ERR_DEAD;
  if (!l->started) return RG_OK;
  if (reap_send(l) != 0) return RG_ERR_DEAD;
  /* A probe goes out after a quarter of the timeout without progress and has the other
   * three quarters to complete: a silent peer is found within the timeout of its last sign.
   * It completes after every request posted before it, so while those still complete (a
   * long queue draining on a slow link) the wait counts from the last of them. */
  if (l->probe_inflight) {
    uint64_t since = l->probe_posted_ns > l->last_progress_ns ? l->probe_posted_ns : l->last_progress_ns;
    if (now > since && now - since > l->timeout_ns - l->timeout_ns / 4) {
      lane_fail(l, "the liveness probe to %s over %s has not completed in %llu ms, nor anything else for %llu ms "
                   "(%u requests outstanding)", l->peer, l->hca_name,
                (unsigned long long)((now - l->probe_posted_ns) / 1000000),
                (unsigned long long)((now - since) / 1000000), l->sq_used);
      return RG_ERR_DEAD;
    }
    return RG_OK;
  }
  uint64_t quiet = now > l->last_progress_ns ? now - l->last_progress_ns : 0;
  if (quiet < l->timeout_ns / 4) return RG_OK;
  if (room(l) > 0) return post_probe(l, now) == 0 ? RG_OK : RG_ERR_DEAD;
  /* A full queue holds a signaled request; count from when this wait first saw it. */
  if (l->full_since_ns == 0) l->full_since_ns = now;
  uint64_t since = l->full_since_ns > l->last_progress_ns ? l->full_since_ns : l->last_progress_ns;
  if (now - since > l->timeout_ns) {
    lane_fail(l, "no send completion from %s over %s for %llu ms with the send queue full (%u requests)", l->peer,
              l->hca_name, (unsigned long long)((now - since) / 1000000), l->sq_used);
    return RG_ERR_DEAD;
  }
  return RG_OK;
}

static const char* lane_why(void* impl) {
  const rg_vlane* l = impl;
  return l->dead ? l->why : "the lane is up";
}

const rg_lane_ops rg_vlane_ops = {.post = lane_post, .poll_send = lane_poll_send, .check = lane_check, .why = lane_why};

/* ------------------------------------------------------------------ set-up */

rg_vlane* rg_vlane_wrap(struct ibv_qp* qp, struct ibv_cq* scq, int hca, const char* hca_name, uint32_t sq_depth,
                        uint64_t timeout_ns) {
  rg_vlane* l = calloc(1, sizeof(*l));
  if (l == NULL) return NULL;
  l->sig = calloc(sq_depth, sizeof(*l->sig));
  l->done = calloc(sq_depth, sizeof(*l->done));
  l->posted = calloc(sq_depth, sizeof(*l->posted));
  if (l->sig == NULL || l->done == NULL || l->posted == NULL) {
    free(l->sig);
    free(l->done);
    free(l->posted);
    free(l);
    return NULL;
  }
  l->qp = qp;
  l->scq = scq;
  l->hca = hca;
  snprintf(l->hca_name, sizeof(l->hca_name), "%s", hca_name);
  snprintf(l->peer, sizeof(l->peer), "(not connected)");
  l->sq_depth = sq_depth;
  /* Signaling every quarter queue keeps at least 3/4 of it free once completions are in. */
  l->sig_every = sq_depth / 4 < 64 ? sq_depth / 4 : 64;
  if (l->sig_every == 0) l->sig_every = 1;
  l->timeout_ns = timeout_ns;
  return l;
}

rg_vlane* rg_vlane_create(struct ibv_context* ctx, struct ibv_pd* pd, int hca, const char* hca_name,
                          uint32_t sq_depth, uint64_t timeout_ns, char* err, int errlen) {
  struct ibv_cq* scq = rg_ibv_create_cq(ctx, (int)sq_depth);
  if (scq == NULL) {
    snprintf(err, (size_t)errlen, "ibv_create_cq(%u entries) on %s failed: %s", sq_depth, hca_name, strerror(errno));
    return NULL;
  }
  struct ibv_qp_init_attr ia;
  memset(&ia, 0, sizeof(ia));
  ia.send_cq = scq;
  ia.recv_cq = scq; /* no receive is ever posted: none ever completes there */
  ia.qp_type = IBV_QPT_RC;
  ia.sq_sig_all = 0;
  ia.cap.max_send_wr = sq_depth;
  ia.cap.max_recv_wr = RECV_DEPTH;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  ia.cap.max_inline_data = RG_INLINE_MAX;
  struct ibv_qp* qp = rg_ibv_create_qp(pd, &ia);
  if (qp == NULL) {
    snprintf(err, (size_t)errlen, "ibv_create_qp(RC, %u send, %d receive, %d inline bytes) on %s failed: %s",
             sq_depth, RECV_DEPTH, RG_INLINE_MAX, hca_name, strerror(errno));
    rg_ibv_destroy_cq(scq);
    return NULL;
  }
  const char* why = NULL;
  rg_vlane* l = NULL;
  if (ia.cap.max_inline_data < RG_INLINE_MAX) /* create_qp reports what it actually gave */
    why = "too few inline bytes";
  else if ((l = rg_vlane_wrap(qp, scq, hca, hca_name, sq_depth, timeout_ns)) == NULL)
    why = "out of memory";
  if (why != NULL) {
    snprintf(err, (size_t)errlen, "queue pair on %s: %s (inline %u of %d bytes)", hca_name, why,
             ia.cap.max_inline_data, RG_INLINE_MAX);
    rg_ibv_destroy_qp(qp);
    rg_ibv_destroy_cq(scq);
    return NULL;
  }
  l->owned = 1;
  return l;
}

void rg_vlane_destroy(rg_vlane* l) {
  if (l == NULL) return;
  if (l->owned) {
    rg_ibv_destroy_qp(l->qp); /* before its CQ, which it references */
    rg_ibv_destroy_cq(l->scq);
  }
  free(l->sig);
  free(l->done);
  free(l->posted);
  free(l);
}

struct ibv_qp* rg_vlane_qp(rg_vlane* l) { return l->qp; }
uint32_t rg_vlane_qpn(rg_vlane* l) { return l->qp->qp_num; }

void rg_vlane_start(rg_vlane* l, const char* peer, uint64_t probe_addr, uint32_t probe_rkey, uint64_t now_ns) {
  snprintf(l->peer, sizeof(l->peer), "%s", peer);
  l->probe_addr = probe_addr;
  l->probe_rkey = probe_rkey;
  l->last_progress_ns = now_ns;
  l->started = 1;
}
