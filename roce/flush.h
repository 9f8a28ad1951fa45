/* NCCL's flush on a link, shared by the p2p receive and the gather: a 1-byte RDMA read of
 * the received buffer through the NIC into the link's flush byte, which orders the GPU's
 * view after the NIC's writes. Each comm keeps its own array of flush requests; a read's
 * wr_id is its request's index + 1. */
#ifndef RG_FLUSH_H
#define RG_FLUSH_H

#include "fabric/fabric.h"
#include "request.h"

/* The index of a free request among reqs[0..n), or n when every one is in flight. */
static inline int rg_flush_free_slot(const rg_request* reqs, int n) {
  int i = 0;
  while (i < n && reqs[i].kind != RG_REQ_FREE) i++;
  return i;
}

/* Posts the read of addr (registered as mr) for request slot. Returns rg_post's result:
 * RG_ERR_FULL means the lane is full and NCCL retries. */
static inline int rg_flush_post(rg_link* link, int slot, const void* addr, const rg_mr* mr) {
  rg_wr wr = {.wr_id = (uint64_t)slot + 1,
              .local = link->flush_dst,
              .mr = link->flush_dst_mr,
              .len = 1,
              .remote = (uint64_t)(uintptr_t)addr,
              .rkey = mr->rkey[link->flush.hca],
              .op = RG_OP_READ,
              .flags = RG_WR_SIGNALED};
  return rg_post(&link->flush, &wr, 1);
}

/* Marks done the requests of reqs[0..n) whose reads have completed. Returns 0, or -1 when
 * the lane failed, a read failed, or a completion names no request. */
static inline int rg_flush_reap(rg_link* link, rg_request* reqs, int n) {
  rg_cqe c[16];
  int got = rg_poll_send(&link->flush, c, 16);
  if (got < 0) return -1;
  for (int i = 0; i < got; i++) {
    if (c[i].status != 0 || c[i].wr_id == 0 || c[i].wr_id > (uint64_t)n) return -1;
    reqs[c[i].wr_id - 1].done = 1;
  }
  return 0;
}

#endif
