/* The one-sided fabric the protocols run on, as seen from the hot path.
 *
 * A link joins this rank to one peer and has one or more lanes (one per HCA for verbs,
 * one TCP connection for tcp). Every lane offers the same verbs-like contract:
 *  - writes posted on one lane are placed in the peer's memory in post order;
 *  - a WRITE_IMM's receive completion is reported only after its bytes and every earlier
 *    write of that lane are in place in the peer's memory;
 *  - a SIGNALED work request yields exactly one send completion; others yield none;
 *  - a dead peer or a cut link makes post and poll return RG_ERR_DEAD, and why() says why.
 * Lanes that offer post_recv (tcp) also carry two-sided sends: an RG_OP_SEND lands in the
 * peer's oldest posted receive, in its first unfilled buffer whose tag is the send's imm,
 * and yields a receive completion naming that receive and buffer. Over TCP this spares
 * the receiver-driven protocol a write and a read per message; verbs has no post_recv.
 * Lane functions never block and never allocate. */
#ifndef RG_FABRIC_H
#define RG_FABRIC_H

#include <stddef.h>
#include <stdint.h>

#define RG_MAX_HCAS 4
#define RG_MAX_LANES 4

enum rg_mem { RG_MEM_HOST = 0, RG_MEM_CUDA = 1 };

/* A registered memory region. Keys are per local HCA index (tcp uses index 0). */
typedef struct rg_mr {
  uint64_t addr;
  uint64_t len;
  int mem; /* enum rg_mem */
  int nhcas;
  uint32_t lkey[RG_MAX_HCAS];
  uint32_t rkey[RG_MAX_HCAS];
  void* impl;
} rg_mr;

enum rg_op { RG_OP_WRITE = 1, RG_OP_WRITE_IMM = 2, RG_OP_READ = 3, RG_OP_SEND = 4 };
enum rg_wr_flag { RG_WR_SIGNALED = 1, RG_WR_INLINE = 2 };

/* Longest payload a lane copies at post time for RG_WR_INLINE. */
#define RG_INLINE_MAX 64

typedef struct rg_wr {
  uint64_t wr_id;
  const void* local; /* source of a write, destination of a read */
  const rg_mr* mr;   /* covers local; may be NULL for RG_WR_INLINE */
  uint64_t len;
  uint64_t remote; /* address in the peer's registered memory */
  uint32_t rkey;   /* the peer's key for this lane */
  uint32_t imm;    /* RG_OP_SEND: the tag */
  uint8_t op;
  uint8_t flags;
} rg_wr;

/* A receive of up to RG_RECV_BUFS buffers for two-sided sends, each taking one send. */
#define RG_RECV_BUFS 8
typedef struct rg_recv_wr {
  uint64_t wr_id;
  int n;
  void* addr[RG_RECV_BUFS];
  uint64_t size[RG_RECV_BUFS];
  uint32_t tag[RG_RECV_BUFS];
  const rg_mr* mr[RG_RECV_BUFS]; /* covers the buffer; may be NULL for size 0 */
} rg_recv_wr;

typedef struct rg_cqe {
  uint64_t wr_id; /* send completions: the work request's id; of a send's receive: the rg_recv_wr's */
  uint64_t len;   /* receive completions: bytes of the write that carried imm, or of the send */
  uint32_t imm;   /* of a send's receive: the index of the buffer it filled */
  int32_t status; /* 0, or an RG_ERR_ code */
} rg_cqe;

enum rg_err {
  RG_OK = 0,
  RG_ERR_DEAD = -1,     /* the lane is gone: peer dead, link cut, or closed */
  RG_ERR_FULL = -2,     /* no room to post now; try again after polling */
  RG_ERR_INVALID = -3,  /* the work request is malformed */
  RG_ERR_ACCESS = -4,   /* the peer refused the write (key or bounds) */
};

typedef struct rg_lane_ops {
  int (*post)(void* impl, const rg_wr* wrs, int n);
  int (*poll_send)(void* impl, rg_cqe* out, int max);
  int (*poll_recv)(void* impl, rg_cqe* out, int max);
  /* Called while a caller waits on the lane; backends without their own liveness
   * check (verbs) probe the peer here. Returns 0 or RG_ERR_DEAD. */
  int (*check)(void* impl, uint64_t now_ns);
  const char* (*why)(void* impl);
  /* Two-sided sends: queues a receive; RG_ERR_FULL when RG_LANE_RECVS are posted. NULL
   * where the lane has no two-sided sends. */
  int (*post_recv)(void* impl, const rg_recv_wr* r);
} rg_lane_ops;

#define RG_LANE_RECVS 256

typedef struct rg_lane {
  const rg_lane_ops* ops;
  void* impl;
  int hca;      /* local HCA index: selects lkey/rkey in rg_mr */
  int peer_hca; /* the peer's HCA index on the far end of this lane */
} rg_lane;

typedef struct rg_link {
  int nlanes;
  rg_lane lane[RG_MAX_LANES];
  /* Verbs with GPUDirect: a lane connected to itself for NCCL's flush (a 1-byte RDMA read
   * of the received GPU buffer into host memory). ops is NULL where no flush is needed. */
  rg_lane flush;
  void* flush_dst;          /* 1 registered host byte the read lands in */
  const rg_mr* flush_dst_mr;
  char peer[64]; /* the peer's address, for log lines */
} rg_link;

static inline int rg_post(rg_lane* l, const rg_wr* w, int n) { return l->ops->post(l->impl, w, n); }
static inline int rg_poll_send(rg_lane* l, rg_cqe* c, int max) { return l->ops->poll_send(l->impl, c, max); }
static inline int rg_poll_recv(rg_lane* l, rg_cqe* c, int max) { return l->ops->poll_recv(l->impl, c, max); }
static inline int rg_check(rg_lane* l, uint64_t now) { return l->ops->check(l->impl, now); }
static inline const char* rg_why(rg_lane* l) { return l->ops->why(l->impl); }
static inline int rg_has_sends(const rg_lane* l) { return l->ops->post_recv != NULL; }
static inline int rg_post_recv(rg_lane* l, const rg_recv_wr* r) { return l->ops->post_recv(l->impl, r); }

uint64_t rg_now_ns(void);

#endif
