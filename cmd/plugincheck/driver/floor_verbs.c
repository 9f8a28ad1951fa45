/* The verbs floor: raw RDMA writes between the two ranks on the first port of the device the
 * library's verbs fabric opens, with the GID it routes with (plugincheck bench takes both
 * from the library's own choice), with nothing of the library in between. One RC queue pair a rank; each
 * round both ranks write the round's message into the other's landing buffer and poll the
 * last byte of their own (perftest's ib_write_lat polls the same way). libibverbs is opened
 * at run time by the library's own code (roce/verbs/ibv.c), so the program still runs on
 * hosts without rdma-core. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "floor.h"
#include "ibv.h" /* roce/verbs: the library's own loader and wrappers of the verbs */
#include "rank.h"

/* What a rank tells the other. */
typedef struct floor_peer {
  uint32_t ok; /* 0: this rank could not set up, why says so */
  uint32_t qpn, psn, rkey;
  uint64_t addr; /* the landing buffer */
  uint16_t lid;
  uint8_t mtu;
  uint8_t gid[16];
  char why[120];
} floor_peer;

typedef struct floor_state {
  struct ibv_context* ctx;
  struct ibv_pd* pd;
  struct ibv_cq* cq;
  struct ibv_qp* qp;
  struct ibv_mr *smr, *rmr;
  uint8_t *sbuf, *rbuf;
  uint8_t port;
  int gid_index;
  struct ibv_port_attr pa;
  char hca[64];
} floor_state;

enum { DEPTH = 64, INLINE = 64 };
#define PHASE_NS 30000000000ull /* longest wait for the peer in one round trip */

static int setup(floor_state* s, const char* dev, char* why, size_t n) {
  if (rg_ibv_load() != 0)
    return floor_fail(why, n, "%s", rg_ibv_error());
  unsigned port = 0;
  int gid = -1;
  if (sscanf(dev, "%63[^:]:%u:%d", s->hca, &port, &gid) != 3)
    return floor_fail(why, n, "%s is not HCA:PORT:GID", dev);
  s->port = (uint8_t)port;
  int ndev = 0;
  struct ibv_device** list = rg_ibv_get_devices(&ndev);
  if (list == NULL)
    return floor_fail(why, n, "ibv_get_device_list failed: %s", strerror(errno));
  for (int i = 0; i < ndev && s->ctx == NULL; i++)
    if (strcmp(rg_ibv_device_name(list[i]), s->hca) == 0) s->ctx = rg_ibv_open(list[i]);
  rg_ibv_free_devices(list);
  if (s->ctx == NULL)
    return floor_fail(why, n, "no RDMA device %s could be opened", s->hca);
  if (rg_ibv_query_port(s->ctx, s->port, &s->pa) != 0)
    return floor_fail(why, n, "ibv_query_port(%s, %u) failed", s->hca, s->port);
  /* RoCE routes with the GID; InfiniBand by LID. */
  s->gid_index = s->pa.link_layer == IBV_LINK_LAYER_ETHERNET ? gid : -1;
  size_t len = floor_sizes[FLOOR_SIZES - 1];
  s->sbuf = aligned_alloc(4096, len);
  s->rbuf = aligned_alloc(4096, len);
  if (s->sbuf == NULL || s->rbuf == NULL)
    return floor_fail(why, n, "allocating two buffers of %zu bytes", len);
  memset(s->sbuf, 0, len);
  memset(s->rbuf, 0, len);
  int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  if ((s->pd = rg_ibv_alloc_pd(s->ctx)) == NULL ||
      (s->smr = rg_ibv_reg_mr(s->pd, (uint64_t)(uintptr_t)s->sbuf, len, access)) == NULL ||
      (s->rmr = rg_ibv_reg_mr(s->pd, (uint64_t)(uintptr_t)s->rbuf, len, access)) == NULL)
    return floor_fail(why, n, "protection domain or registration on %s failed: %s", s->hca, strerror(errno));
  if ((s->cq = rg_ibv_create_cq(s->ctx, DEPTH)) == NULL)
    return floor_fail(why, n, "ibv_create_cq on %s failed: %s", s->hca, strerror(errno));
  struct ibv_qp_init_attr ia = {.send_cq = s->cq, .recv_cq = s->cq, .qp_type = IBV_QPT_RC,
                                .cap = {.max_send_wr = DEPTH, .max_recv_wr = 1, .max_send_sge = 1,
                                        .max_recv_sge = 1, .max_inline_data = INLINE}};
  if ((s->qp = rg_ibv_create_qp(s->pd, &ia)) == NULL)
    return floor_fail(why, n, "ibv_create_qp on %s failed: %s", s->hca, strerror(errno));
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = s->port, .qp_access_flags = IBV_ACCESS_REMOTE_WRITE};
  if (rg_ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0)
    return floor_fail(why, n, "moving the queue pair on %s to INIT failed", s->hca);
  return 0;
}

static int connect_qp(floor_state* s, const floor_peer* me, const floor_peer* peer, char* why, size_t n) {
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTR, .path_mtu = me->mtu < peer->mtu ? me->mtu : peer->mtu,
                          .dest_qp_num = peer->qpn, .rq_psn = peer->psn, .max_dest_rd_atomic = 1,
                          .min_rnr_timer = 12};
  a.ah_attr.port_num = s->port;
  a.ah_attr.dlid = peer->lid;
  if (s->pa.link_layer == IBV_LINK_LAYER_ETHERNET) {
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, peer->gid, 16);
    a.ah_attr.grh.sgid_index = (uint8_t)s->gid_index;
    a.ah_attr.grh.hop_limit = 64;
  }
  int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
             IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  if (rg_ibv_modify_qp(s->qp, &a, mask) != 0)
    return floor_fail(why, n, "moving the queue pair on %s to RTR failed", s->hca);
  struct ibv_qp_attr r = {.qp_state = IBV_QPS_RTS, .sq_psn = me->psn, .timeout = 14, .retry_cnt = 6,
                          .rnr_retry = 7, .max_rd_atomic = 1};
  mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  if (rg_ibv_modify_qp(s->qp, &r, mask) != 0)
    return floor_fail(why, n, "moving the queue pair on %s to RTS failed", s->hca);
  return 0;
}

/* Takes the send completions there are; -1 on an error completion. */
static int reap(floor_state* s, int* outstanding, char* why, size_t n) {
  struct ibv_wc wc[16];
  int k = ibv_poll_cq(s->cq, 16, wc);
  for (int i = 0; i < k; i++)
    if (wc[i].status != IBV_WC_SUCCESS)
      return floor_fail(why, n, "an RDMA write on %s failed: %s", s->hca, rg_ibv_wc_status_str(wc[i].status));
  if (k < 0)
    return floor_fail(why, n, "polling the completion queue of %s failed", s->hca);
  *outstanding -= k;
  return 0;
}

static int write_to_peer(floor_state* s, const floor_peer* peer, size_t off, size_t len, int* outstanding) {
  struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)(s->sbuf + off), .length = (uint32_t)len, .lkey = s->smr->lkey};
  struct ibv_send_wr wr = {.sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
                           .send_flags = IBV_SEND_SIGNALED | (len <= INLINE ? IBV_SEND_INLINE : 0)};
  wr.wr.rdma.remote_addr = peer->addr + off;
  wr.wr.rdma.rkey = peer->rkey;
  struct ibv_send_wr* bad = NULL;
  if (ibv_post_send(s->qp, &wr, &bad) != 0) return -1;
  (*outstanding)++;
  return 0;
}

/* The round tags a landing buffer's last byte carries: 1 to 255, again and again. */
static uint8_t next_tag(uint8_t t) { return t == 255 ? 1 : (uint8_t)(t + 1); }

/* Rounds of size bytes each way: each rank writes its message (its last byte the round's tag)
 * and waits until its own landing buffer's last byte shows the peer's message of that round.
 * The peer may already have written the next round's there (it saw this rank's message
 * first): either tag ends the wait. FLOOR_WARM_ROUNDS, then as many as agreed_rounds gives,
 * timed. */
static int one_round(floor_state* s, const floor_peer* peer, size_t size, uint8_t tag, int* outstanding, char* why,
                     size_t n) {
  volatile uint8_t* last = s->rbuf + size - 1;
  uint64_t deadline = now_ns() + PHASE_NS; /* a round, not the whole run: emulated hosts are slow */
  s->sbuf[size - 1] = tag;
  while (*outstanding >= DEPTH / 2)
    if (reap(s, outstanding, why, n) != 0) return -1;
  if (write_to_peer(s, peer, 0, size, outstanding) != 0) return floor_fail(why, n, "ibv_post_send on %s failed", s->hca);
  while (*last != tag && *last != next_tag(tag)) {
    if (reap(s, outstanding, why, n) != 0) return -1;
    if (now_ns() > deadline) return floor_fail(why, n, "no %zu-byte write from the peer within 30 s", size);
  }
  return 0;
}

static int exchange_rounds(floor_state* s, const floor_peer* peer, size_t size, int most, double* round_us, int* rounds,
                           char* why, size_t n) {
  int outstanding = 0, rc = 0;
  s->rbuf[size - 1] = 0;
  if (barrier("floor-verbs-size") != 0) return floor_fail(why, n, "the peer did not reach the %zu-byte rounds", size);
  uint8_t tag = 0;
  uint64_t t0 = now_ns();
  for (int i = 0; i < FLOOR_WARM_ROUNDS && rc == 0; i++) rc = one_round(s, peer, size, tag = next_tag(tag), &outstanding, why, n);
  /* Both ranks reach the agreement, whatever failed, so neither waits for nothing. */
  *rounds = agreed_rounds(now_ns() - t0, most);
  if (*rounds < 0 && rc == 0) rc = floor_fail(why, n, "the ranks could not agree the %zu-byte rounds", size);
  t0 = now_ns();
  for (int i = 0; i < *rounds && rc == 0; i++) rc = one_round(s, peer, size, tag = next_tag(tag), &outstanding, why, n);
  if (rc != 0) return -1;
  *round_us = (double)(now_ns() - t0) / *rounds / 1e3;
  uint64_t deadline = now_ns() + PHASE_NS;
  while (outstanding > 0) {
    if (reap(s, &outstanding, why, n) != 0) return -1;
    if (now_ns() > deadline) return floor_fail(why, n, "the last %zu-byte writes did not complete within 30 s", size);
  }
  /* The peer's last write may still be landing: the next size starts from a barrier. */
  return 0;
}

static void teardown(floor_state* s) {
  if (s->qp) rg_ibv_destroy_qp(s->qp);
  if (s->cq) rg_ibv_destroy_cq(s->cq);
  if (s->smr) rg_ibv_dereg_mr(s->smr);
  if (s->rmr) rg_ibv_dereg_mr(s->rmr);
  if (s->pd) rg_ibv_dealloc_pd(s->pd);
  if (s->ctx) rg_ibv_close(s->ctx);
  free(s->sbuf);
  free(s->rbuf);
}

int floor_verbs(const char* dev, floor_result* out) {
  memset(out, 0, sizeof(*out));
  floor_state s;
  memset(&s, 0, sizeof(s));
  floor_peer me, peer;
  memset(&me, 0, sizeof(me));
  char why[sizeof(me.why)] = "";
  /* Both ranks reach every exchange, whatever failed: the peer must not wait for nothing. */
  me.ok = setup(&s, dev, me.why, sizeof(me.why)) == 0;
  if (me.ok) {
    me.qpn = s.qp->qp_num;
    me.psn = (uint32_t)(now_ns() & 0xffffff);
    me.rkey = s.rmr->rkey;
    me.addr = (uint64_t)(uintptr_t)s.rbuf;
    me.lid = s.pa.lid;
    me.mtu = (uint8_t)s.pa.active_mtu;
    if (s.gid_index >= 0) rg_ibv_query_gid(s.ctx, s.port, s.gid_index, me.gid);
  }
  int rc = -1;
  if (exchange("floor-verbs", &me, &peer, sizeof(peer)) != 0) {
    snprintf(out->how, sizeof(out->how), "verbs floor: the exchange with the peer failed");
  } else if (!me.ok || !peer.ok) {
    snprintf(out->how, sizeof(out->how), "verbs floor not measured: %s%s", me.ok ? "the peer: " : "",
             me.ok ? peer.why : me.why);
  } else {
    peer.why[sizeof(peer.why) - 1] = '\0';
    int ok = connect_qp(&s, &me, &peer, why, sizeof(why)) == 0;
    uint32_t both[2] = {(uint32_t)ok, 0};
    ok = exchange("floor-verbs-rts", &both[0], &both[1], sizeof(uint32_t)) == 0 && ok && both[1];
    for (int i = 0; i < FLOOR_SIZES && ok; i++)
      ok = exchange_rounds(&s, &peer, floor_sizes[i], floor_rounds[i], &out->round_us[i], &out->rounds[i], why,
                           sizeof(why)) == 0;
    int32_t done[2] = {ok, 0};
    if (exchange("floor-verbs-done", &done[0], &done[1], sizeof(int32_t)) != 0 || !done[1]) {
      if (ok) snprintf(why, sizeof(why), "the peer's side failed");
      ok = 0;
    }
    unsigned mtu = 128u << (me.mtu < peer.mtu ? me.mtu : peer.mtu);
    if (ok) {
      snprintf(out->how, sizeof(out->how), "RDMA writes on %s:%u %s %d, one RC queue pair, path MTU %u, "
               "both ways at once, last-byte polling", s.hca, s.port, s.gid_index >= 0 ? "GID" : "LID",
               s.gid_index >= 0 ? s.gid_index : (int)s.pa.lid, mtu);
      rc = 0;
    } else {
      snprintf(out->how, sizeof(out->how), "verbs floor failed: %s", why);
    }
  }
  teardown(&s);
  return rc;
}
