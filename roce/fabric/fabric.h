/* The one-sided fabric the one-shot engine runs on, as seen from the hot path.
 *
 * A link joins this rank to one peer and has one or more lanes (one per HCA for verbs,
 * one TCP connection for tcp). Every lane offers the same contract:
 *  - writes posted on one lane are placed in the peer's memory in post order;
 *  - a write of one aligned 8-byte word is placed by a single store, and a reader that
 *    sees it with an acquire load also sees every byte of every write posted before it on
 *    that lane (tcp: a release store after the earlier bytes; verbs: the RC queue pair
 *    places in order, without relaxed ordering);
 *  - a SIGNALED work request yields exactly one send completion; others yield none;
 *  - a dead peer or a cut link makes post and poll return RG_ERR_DEAD, and why() says why.
 * Lane functions never block and never allocate. */
#ifndef RG_FABRIC_H
#define RG_FABRIC_H

#include <stddef.h>
#include <stdint.h>

#define RG_MAX_HCAS 4
#define RG_MAX_LANES 4

/* A registered region of host memory. Keys are per local HCA index (tcp uses index 0). */
typedef struct rg_mr {
  uint64_t addr;
  uint64_t len;
  int nhcas;
  uint32_t lkey[RG_MAX_HCAS];
  uint32_t rkey[RG_MAX_HCAS];
} rg_mr;

enum rg_wr_flag { RG_WR_SIGNALED = 1, RG_WR_INLINE = 2 };

/* Longest payload a lane copies at post time for RG_WR_INLINE. */
#define RG_INLINE_MAX 64

/* An RDMA write, the one operation the engine needs. */
typedef struct rg_wr {
  uint64_t wr_id;
  const void* local; /* source of the write */
  const rg_mr* mr;   /* covers local; may be NULL for RG_WR_INLINE */
  uint64_t len;
  uint64_t remote; /* address in the peer's registered memory */
  uint32_t rkey;   /* the peer's key for this lane */
  uint8_t flags;
} rg_wr;

/* A signaled write's completion: it succeeded (a failed one kills the lane). */
typedef struct rg_cqe {
  uint64_t wr_id; /* the work request's id */
} rg_cqe;

enum rg_err {
  RG_OK = 0,
  RG_ERR_DEAD = -1,    /* the lane is gone: peer dead, link cut, or closed */
  RG_ERR_FULL = -2,    /* no room to post now; try again after polling */
  RG_ERR_INVALID = -3, /* the work request is malformed */
};

typedef struct rg_lane_ops {
  int (*post)(void* impl, const rg_wr* wrs, int n);
  /* Also moves the lane's receiving side: tcp reads the peer's frames and places them here. */
  int (*poll_send)(void* impl, rg_cqe* out, int max);
  /* Called while a caller waits on the lane; backends without their own liveness
   * check (verbs) probe the peer here. Returns 0 or RG_ERR_DEAD. */
  int (*check)(void* impl, uint64_t now_ns);
  const char* (*why)(void* impl);
} rg_lane_ops;

typedef struct rg_lane {
  const rg_lane_ops* ops;
  void* impl;
  int peer_hca; /* the peer's HCA index on the far end of this lane: selects its rkey */
} rg_lane;

typedef struct rg_link {
  int nlanes;
  rg_lane lane[RG_MAX_LANES];
} rg_link;

static inline int rg_post(rg_lane* l, const rg_wr* w, int n) { return l->ops->post(l->impl, w, n); }
static inline int rg_poll_send(rg_lane* l, rg_cqe* c, int max) { return l->ops->poll_send(l->impl, c, max); }
static inline int rg_check(rg_lane* l, uint64_t now) { return l->ops->check(l->impl, now); }
static inline const char* rg_why(rg_lane* l) { return l->ops->why(l->impl); }

uint64_t rg_now_ns(void);

#endif
