/* The p2p message protocol (see p2p.h). Runs on NCCL's proxy progress thread. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include "../internal/nlog/nlog.h"
#include "flush.h"
#include "p2p.h"

#define POLL_BATCH 16
/* A waiting request asks the lane for liveness once per this many tests. */
#define CHECK_EVERY 1024

/* The first send, receive and completion of each comm are logged once (NCCL_DEBUG=INFO,
 * subsystem NET): enough to see where a stuck job stopped, nothing in steady state. */
#define LOG_FIRST(comm, bit, ...)                   \
  do {                                              \
    if (!((comm)->logged & (bit))) {                \
      (comm)->logged |= (bit);                      \
      RG_INFO(NCCL_NET, __VA_ARGS__);               \
    }                                               \
  } while (0)

void rg_p2p_send_init(rg_p2p_send* s) {
  for (int i = 0; i < RG_P2P_SEND_REQS; i++) {
    s->reqs[i].index = i;
    s->reqs[i].comm = s;
    s->free_reqs[i] = RG_P2P_SEND_REQS - 1 - i;
  }
  s->nfree = RG_P2P_SEND_REQS;
}

void rg_p2p_recv_init(rg_p2p_recv* r) {
  for (int i = 0; i < RG_P2P_SLOTS; i++) {
    r->reqs[i].index = i;
    r->reqs[i].comm = r;
  }
  for (int i = 0; i < RG_P2P_FLUSH_REQS; i++) {
    r->flush_reqs[i].index = i;
    r->flush_reqs[i].comm = r;
  }
}

int rg_p2p_send_outstanding(const rg_p2p_send* s) { return RG_P2P_SEND_REQS - s->nfree; }

int rg_p2p_recv_outstanding(const rg_p2p_recv* r) {
  int n = 0;
  for (int i = 0; i < RG_P2P_SLOTS; i++) n += r->reqs[i].kind != RG_REQ_FREE;
  for (int i = 0; i < RG_P2P_FLUSH_REQS; i++) n += r->flush_reqs[i].kind != RG_REQ_FREE;
  return n;
}

/* One WARN per comm: the direction, the peer, the message, what was under way, and why:
 * the completion the protocol had no place for, or else what the lane says. */
static ncclResult_t comm_failed(int* warned, const char* direction, const rg_link* link, rg_lane* lane,
                                const char* stray, const char* what, uint64_t seq) {
  if (!*warned) {
    *warned = 1;
    RG_WARN("%s %s failed at message %llu: %s: %s", direction, link->peer, (unsigned long long)seq, what,
            stray[0] ? stray : rg_why(lane));
  }
  return ncclRemoteError;
}

static ncclResult_t send_failed(rg_p2p_send* s, const char* what, uint64_t seq) {
  return comm_failed(&s->warned, "send to", s->link, s->lane, s->stray, what, seq);
}

static ncclResult_t recv_failed(rg_p2p_recv* r, const char* what, uint64_t seq) {
  return comm_failed(&r->warned, "receive from", r->link, r->lane, r->stray, what, seq);
}

/* Records a completion the protocol has no place for; the comm fails from then on, with it
 * as the cause (the lane itself may be up: a peer or a NIC that delivered it twice). */
static int stray_completion(char* stray, size_t n, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
static int stray_completion(char* stray, size_t n, const char* fmt, ...) {
  if (stray[0] == '\0') {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(stray, n, fmt, ap);
    va_end(ap);
  }
  return RG_ERR_INVALID;
}

/* Drains CTS arrivals into cts_ready. The sender's lane carries nothing else inbound. */
static int send_progress_cts(rg_p2p_send* s) {
  if (s->stray[0]) return RG_ERR_INVALID;
  rg_cqe c[POLL_BATCH];
  int n = rg_poll_recv(s->lane, c, POLL_BATCH);
  if (n < 0) return n;
  for (int i = 0; i < n; i++) {
    if (RG_IMM_CLASS(c[i].imm) != RG_IMM_CTS || c[i].status != 0)
      return stray_completion(s->stray, sizeof(s->stray),
                              "a receive completion with immediate 0x%08x (status %d) where only clear-to-sends arrive",
                              c[i].imm, c[i].status);
    s->cts_ready[c[i].imm & (RG_P2P_SLOTS - 1)] = 1;
  }
  return 0;
}

static int send_progress_completions(rg_p2p_send* s) {
  if (s->stray[0]) return RG_ERR_INVALID;
  rg_cqe c[POLL_BATCH];
  int n = rg_poll_send(s->lane, c, POLL_BATCH);
  if (n < 0) return n;
  for (int i = 0; i < n; i++) {
    if (c[i].status != 0 || c[i].wr_id == 0 || c[i].wr_id > RG_P2P_SEND_REQS)
      return stray_completion(s->stray, sizeof(s->stray), "a send completion with id %llu (status %d) names no send",
                              (unsigned long long)c[i].wr_id, c[i].status);
    s->reqs[c[i].wr_id - 1].done = 1;
  }
  return 0;
}

/* A send that must wait (no clear-to-send yet, no free request, a full queue) asks the
 * lane now and then whether the peer is still there: NCCL retries it without end. */
static ncclResult_t send_retry(rg_p2p_send* s, const char* waiting_for) {
  if (++s->polls % CHECK_EVERY == 0 && rg_check(s->lane, rg_now_ns()) != RG_OK)
    return send_failed(s, waiting_for, s->sends);
  return ncclSuccess;
}

/* Marks send request ri in flight for a message of size bytes. */
static rg_request* start_send(rg_p2p_send* s, int ri, uint64_t size) {
  rg_request* req = &s->reqs[ri];
  s->nfree--;
  req->kind = RG_REQ_SEND;
  req->done = 0;
  req->n = 1;
  req->id = s->sends++;
  req->sizes[0] = size;
  return req;
}

/* Over a lane with two-sided sends the message leaves at once, tagged; the receiver's
 * lane puts it into the receive it belongs to. */
static int isend_two_sided(rg_p2p_send* s, void* data, uint64_t size, int tag, const rg_mr* mr, void** request) {
  if (s->nfree == 0) return send_retry(s, "waiting for a free send request");
  int ri = s->free_reqs[s->nfree - 1];
  rg_wr wr = {.wr_id = (uint64_t)ri + 1, .local = data, .mr = mr, .len = size, .imm = (uint32_t)tag,
              .op = RG_OP_SEND, .flags = RG_WR_SIGNALED};
  int rc = rg_post(s->lane, &wr, 1);
  if (rc == RG_ERR_FULL) return send_retry(s, "waiting for room to post the message");
  if (rc == RG_ERR_INVALID) {
    RG_WARN("send of %llu bytes to %s: the buffer %p is not inside its registration", (unsigned long long)size,
            s->link->peer, data);
    return ncclInvalidArgument;
  }
  if (rc != RG_OK) return send_failed(s, "posting the message", s->sends);
  *request = start_send(s, ri, size);
  LOG_FIRST(s, 1, "first send to %s: %llu bytes, tag %d", s->link->peer, (unsigned long long)size, tag);
  return ncclSuccess;
}

int rg_p2p_isend(rg_p2p_send* s, void* data, uint64_t size, int tag, const rg_mr* mr, void** request) {
  *request = NULL;
  if (rg_has_sends(s->lane)) return isend_two_sided(s, data, size, tag, mr, request);
  if (send_progress_cts(s) != 0) return send_failed(s, "waiting for the receiver's clear-to-send", s->sends);
  uint32_t slot = (uint32_t)(s->head & (RG_P2P_SLOTS - 1));
  if (!s->cts_ready[slot]) return send_retry(s, "waiting for the receiver's clear-to-send");
  if (s->nfree == 0) return send_retry(s, "waiting for a free send request");
  rg_cts_entry* e = &s->fifo[slot * RG_P2P_MAX_RECVS];
  uint32_t nreqs = e[0].nreqs;
  if (nreqs == 0 || nreqs > RG_P2P_MAX_RECVS) {
    RG_WARN("clear-to-send from %s names %u buffers (at most %d)", s->link->peer, nreqs, RG_P2P_MAX_RECVS);
    return ncclRemoteError;
  }
  uint32_t i = 0;
  while (i < nreqs && (s->matched[i] || e[i].tag != tag)) i++;
  if (i == nreqs) return send_retry(s, "waiting for the receive its tag belongs to"); /* NCCL asks again */
  if (size > e[i].size) {
    RG_WARN("send of %llu bytes to %s does not fit the receiver's %llu-byte buffer (tag %d)",
            (unsigned long long)size, s->link->peer, (unsigned long long)e[i].size, tag);
    return ncclInvalidUsage;
  }
  int ri = s->free_reqs[s->nfree - 1];
  uint64_t record = size;
  rg_wr wr[2];
  int nwr = 0;
  if (size > 0) {
    wr[nwr++] = (rg_wr){.local = data, .mr = mr, .len = size, .remote = e[i].addr, .rkey = e[i].rkey,
                        .op = RG_OP_WRITE};
  }
  wr[nwr++] = (rg_wr){.wr_id = (uint64_t)ri + 1,
                      .local = &record,
                      .len = sizeof(record),
                      .remote = s->peer_cmpl_addr + ((uint64_t)slot * RG_P2P_MAX_RECVS + i) * sizeof(uint64_t),
                      .rkey = s->peer_cmpl_rkey,
                      .imm = (RG_IMM_DATA << 28) | (slot << 3) | i,
                      .op = RG_OP_WRITE_IMM,
                      .flags = RG_WR_SIGNALED | RG_WR_INLINE};
  int rc = rg_post(s->lane, wr, nwr);
  if (rc == RG_ERR_FULL) return send_retry(s, "waiting for room to post the write");
  if (rc != RG_OK) return send_failed(s, "posting the write", s->sends);
  rg_request* req = start_send(s, ri, size);
  s->matched[i] = 1;
  if (++s->nmatched == (int)nreqs) {
    memset(s->matched, 0, sizeof(s->matched));
    s->nmatched = 0;
    s->cts_ready[slot] = 0;
    s->head++;
  }
  LOG_FIRST(s, 1, "first send to %s: %llu bytes, tag %d, into a %u-buffer receive", s->link->peer,
            (unsigned long long)size, tag, nreqs);
  *request = req;
  return ncclSuccess;
}

int rg_p2p_irecv(rg_p2p_recv* r, int n, void** data, const uint64_t* sizes, const int* tags, const rg_mr* const* mrs,
                 void** request) {
  *request = NULL;
  if (n < 1 || n > RG_P2P_MAX_RECVS) {
    RG_WARN("irecv of %d buffers from %s: between 1 and %d are supported", n, r->link->peer, RG_P2P_MAX_RECVS);
    return ncclInvalidArgument;
  }
  uint32_t slot = (uint32_t)(r->head & (RG_P2P_SLOTS - 1));
  rg_request* req = &r->reqs[slot];
  if (req->kind != RG_REQ_FREE) return ncclSuccess; /* RG_P2P_SLOTS receives outstanding */
  for (int i = 0; i < n; i++)
    if (sizes[i] > 0 && mrs[i] == NULL) {
      RG_WARN("irecv buffer %d from %s (%llu bytes) has no registration", i, r->link->peer,
              (unsigned long long)sizes[i]);
      return ncclInvalidArgument;
    }
  int rc;
  if (rg_has_sends(r->lane)) { /* the lane places the sends itself: nothing crosses the wire */
    rg_recv_wr rw = {.wr_id = slot, .n = n};
    for (int i = 0; i < n; i++) {
      rw.addr[i] = data[i];
      rw.size[i] = sizes[i];
      rw.tag[i] = (uint32_t)tags[i];
      rw.mr[i] = mrs[i];
    }
    rc = rg_post_recv(r->lane, &rw);
  } else {
    rg_cts_entry* e = &r->cts[slot * RG_P2P_MAX_RECVS];
    int hca = r->lane->hca;
    for (int i = 0; i < n; i++)
      e[i] = (rg_cts_entry){.addr = (uint64_t)(uintptr_t)data[i],
                            .size = sizes[i],
                            .rkey = mrs[i] ? mrs[i]->rkey[hca] : 0,
                            .tag = tags[i],
                            .nreqs = (uint32_t)n,
                            .id = r->head};
    rg_wr wr = {.local = e,
                .mr = r->cts_mr,
                .len = sizeof(rg_cts_entry) * (uint64_t)n,
                .remote = r->peer_fifo_addr + (uint64_t)slot * RG_P2P_MAX_RECVS * sizeof(rg_cts_entry),
                .rkey = r->peer_fifo_rkey,
                .imm = (RG_IMM_CTS << 28) | slot,
                .op = RG_OP_WRITE_IMM};
    rc = rg_post(r->lane, &wr, 1);
  }
  if (rc == RG_ERR_FULL) return ncclSuccess;
  if (rc == RG_ERR_INVALID) {
    RG_WARN("irecv from %s: a buffer is not inside its registration", r->link->peer);
    return ncclInvalidArgument;
  }
  if (rc != RG_OK) return recv_failed(r, "posting the receive", r->head);
  req->kind = RG_REQ_RECV;
  req->done = 0;
  req->n = n;
  req->waiting = n;
  req->id = r->head++;
  for (int i = 0; i < n; i++) req->sizes[i] = 0;
  LOG_FIRST(r, 1, "first receive from %s posted: %d buffer(s), %llu bytes in the first, tag %d", r->link->peer, n,
            (unsigned long long)sizes[0], tags[0]);
  *request = req;
  return ncclSuccess;
}

/* A completion that names a receive slot but fits no receive in flight there. */
static int stray_data(rg_p2p_recv* r, const rg_cqe* c, uint32_t slot, uint32_t entry) {
  const rg_request* q = &r->reqs[slot];
  char what[80];
  if (rg_has_sends(r->lane))
    snprintf(what, sizeof(what), "a message of %llu bytes", (unsigned long long)c->len);
  else
    snprintf(what, sizeof(what), "a write with immediate 0x%08x (%llu bytes)", c->imm, (unsigned long long)c->len);
  if (q->kind == RG_REQ_RECV)
    return stray_completion(r->stray, sizeof(r->stray), "%s filled buffer %u of message %llu, which has %d", what, entry,
                            (unsigned long long)q->id, q->n);
  if (r->head <= slot)
    return stray_completion(r->stray, sizeof(r->stray), "%s completed receive slot %u, where no receive was ever posted",
                            what, slot);
  return stray_completion(r->stray, sizeof(r->stray),
                          "%s completed receive slot %u buffer %u, where no receive is in flight: its last receive, "
                          "message %llu, had already completed", what, slot, entry, (unsigned long long)q->id);
}

static int recv_progress(rg_p2p_recv* r) {
  if (r->stray[0]) return RG_ERR_INVALID;
  rg_cqe c[POLL_BATCH];
  int n = rg_poll_recv(r->lane, c, POLL_BATCH);
  if (n < 0) return n;
  int two_sided = rg_has_sends(r->lane);
  for (int i = 0; i < n; i++) {
    uint32_t imm = c[i].imm, slot, entry;
    if (c[i].status != 0)
      return stray_completion(r->stray, sizeof(r->stray), "a receive completed with status %d", c[i].status);
    if (two_sided) { /* the receive's slot, and the buffer the send filled */
      if (c[i].wr_id >= RG_P2P_SLOTS)
        return stray_completion(r->stray, sizeof(r->stray), "a message completed receive %llu of a comm's %d",
                                (unsigned long long)c[i].wr_id, RG_P2P_SLOTS);
      slot = (uint32_t)c[i].wr_id, entry = imm;
    } else {
      if (RG_IMM_CLASS(imm) != RG_IMM_DATA)
        return stray_completion(r->stray, sizeof(r->stray),
                                "a receive completion with immediate 0x%08x where only data completions arrive", imm);
      slot = (imm >> 3) & (RG_P2P_SLOTS - 1), entry = imm & 7;
    }
    rg_request* q = &r->reqs[slot];
    if (q->kind != RG_REQ_RECV || entry >= (uint32_t)q->n) return stray_data(r, &c[i], slot, entry);
    q->sizes[entry] = two_sided ? c[i].len : r->cmpl[slot * RG_P2P_MAX_RECVS + entry];
    if (--q->waiting == 0) q->done = 1;
  }
  return 0;
}

int rg_p2p_iflush(rg_p2p_recv* r, int n, void** data, const int* sizes, const rg_mr* const* mrs, void** request) {
  *request = NULL;
  rg_link* link = r->link;
  if (link->flush.ops == NULL) return ncclSuccess;
  int last = -1;
  for (int i = 0; i < n; i++)
    if (sizes[i] > 0) last = i;
  if (last < 0) return ncclSuccess;
  if (mrs[last] == NULL) {
    RG_WARN("flush of a buffer from %s that has no registration", link->peer);
    return ncclInvalidArgument;
  }
  int fi = rg_flush_free_slot(r->flush_reqs, RG_P2P_FLUSH_REQS);
  if (fi == RG_P2P_FLUSH_REQS) return ncclSuccess; /* all flush requests in flight: retry */
  int rc = rg_flush_post(link, fi, data[last], mrs[last]);
  if (rc == RG_ERR_FULL) return ncclSuccess;
  if (rc != RG_OK) return recv_failed(r, "posting the flush", r->flushes);
  rg_request* req = &r->flush_reqs[fi];
  req->kind = RG_REQ_FLUSH;
  req->done = 0;
  req->id = r->flushes++;
  *request = req;
  return ncclSuccess;
}

static ncclResult_t test_flush(rg_request* req, int* done) {
  rg_p2p_recv* r = req->comm;
  if (!req->done && rg_flush_reap(r->link, r->flush_reqs, RG_P2P_FLUSH_REQS) != 0)
    return recv_failed(r, "flushing", req->id);
  if (!req->done) return ncclSuccess;
  *done = 1;
  req->kind = RG_REQ_FREE;
  return ncclSuccess;
}

static ncclResult_t test_send(rg_request* req, int* done, uint64_t* sizes) {
  rg_p2p_send* s = req->comm;
  if (!req->done) {
    int rc = send_progress_completions(s);
    if (rc == 0 && !rg_has_sends(s->lane)) rc = send_progress_cts(s);
    if (rc != 0 && !req->done) return send_failed(s, "waiting for the write to complete", req->id);
    if (!req->done && ++s->polls % CHECK_EVERY == 0 && rg_check(s->lane, rg_now_ns()) != RG_OK) {
      send_progress_completions(s); /* completions that came before the failure still count */
      if (!req->done) return send_failed(s, "waiting for the write to complete", req->id);
    }
  }
  if (!req->done) return ncclSuccess;
  *done = 1;
  if (sizes) sizes[0] = req->sizes[0];
  LOG_FIRST(s, 2, "first send to %s complete", s->link->peer);
  req->kind = RG_REQ_FREE;
  s->free_reqs[s->nfree++] = req->index;
  return ncclSuccess;
}

static ncclResult_t test_recv(rg_request* req, int* done, uint64_t* sizes) {
  rg_p2p_recv* r = req->comm;
  if (!req->done) {
    if (recv_progress(r) != 0 && !req->done) return recv_failed(r, "waiting for data", req->id);
    if (!req->done && ++r->polls % CHECK_EVERY == 0 && rg_check(r->lane, rg_now_ns()) != RG_OK) {
      recv_progress(r); /* data that arrived before the failure still counts */
      if (!req->done) return recv_failed(r, "waiting for data", req->id);
    }
  }
  if (!req->done) return ncclSuccess;
  *done = 1;
  if (sizes)
    for (int i = 0; i < req->n; i++) sizes[i] = req->sizes[i];
  LOG_FIRST(r, 2, "first receive from %s complete: %llu bytes", r->link->peer, (unsigned long long)req->sizes[0]);
  req->kind = RG_REQ_FREE;
  return ncclSuccess;
}

int rg_p2p_test(rg_request* req, int* done, uint64_t* sizes) {
  *done = 0;
  switch (req->kind) {
  case RG_REQ_SEND:
    return test_send(req, done, sizes);
  case RG_REQ_RECV:
    return test_recv(req, done, sizes);
  case RG_REQ_FLUSH:
    return test_flush(req, done);
  default:
    RG_WARN("test called on a request that is not in flight (kind %d)", req->kind);
    return ncclInvalidUsage;
  }
}
