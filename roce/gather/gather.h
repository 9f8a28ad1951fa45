/* The one-shot gather protocol behind collNet iallgather (docs/roce-gather.md).
 *
 * NCCL issues the k-th iallgather of a group with identical window geometry on both
 * ranks, so call k on one rank pairs with call k on the other by sequence number alone.
 * Each call moves this rank's part of the window to the peer in one striped write per
 * lane, places the same part into this rank's own row, and completes once the peer's part
 * is in place too. Two modes:
 *  - rendezvous: the receiver first writes a ready token (window address and keys) for
 *    call k; the sender then writes straight into the receiver's rows (zero copy);
 *  - eager: the sender writes at once into plugin-owned landing slots of the receiver,
 *    then the slot's arrival word per lane; the receiver copies the slot into the rows
 *    once every arrival word names the call (on the GPU, the gather kernel launched at
 *    iallgather time waits for them); credits return the slots.
 * Nothing is placed into this rank's rows before the peer's part has fully arrived. */
#ifndef RG_GATHER_H
#define RG_GATHER_H

#include "../../include/cuda_subset.h"
#include "../../kernels/place.h"
#include "../fabric/fabric.h"
#include "../request.h"

#define RG_GATHER_DEPTH 16 /* calls in flight per group; a power of two */
#define RG_GATHER_FLUSH_REQS 8
/* After the landing slots: one arrival word per slot and lane, which an eager sender
 * writes with the call's sequence number once its stripe is in place. */
#define RG_ARRIVAL_BYTES ((uint64_t)RG_GATHER_DEPTH * RG_MAX_LANES * sizeof(uint64_t))
/* After those, local only: the gather kernel's words per slot (kernels/place.h). */
#define RG_PLACE_STATUS_BYTES ((uint64_t)RG_GATHER_DEPTH * RG_PLACE_WORDS * sizeof(uint32_t))

/* Gather immediates: class RG_IMM_GATHER in the top nibble, kind below it, 24-bit seq. */
#define RG_GIMM(kind, seq) ((3u << 28) | ((uint32_t)(kind) << 24) | ((uint32_t)(seq) & 0xffffffu))
enum rg_gimm { RG_GIMM_READY = 1, RG_GIMM_DATA = 2, RG_GIMM_EAGER = 3, RG_GIMM_CREDIT = 4, RG_GIMM_PROBE = 5,
               RG_GIMM_PROBE_ACK = 6 };

enum rg_gather_mode { RG_MODE_RENDEZVOUS = 1, RG_MODE_EAGER = 2 };

typedef struct rg_sge {
  void* mhandle;
  void* address;
  uint64_t size;
} rg_sge;

/* What a receiver tells the sender for one rendezvous call. */
typedef struct rg_ready_token {
  uint64_t seq;
  uint64_t addr; /* the receiver's window */
  uint64_t size;
  uint32_t rkey[RG_MAX_HCAS];
  uint64_t pad;
} rg_ready_token;
_Static_assert(sizeof(rg_ready_token) <= RG_INLINE_MAX, "a ready token goes inline");

/* The region a peer writes ready tokens into. */
typedef struct rg_gather_ctrl {
  rg_ready_token ready[RG_GATHER_DEPTH];
} rg_gather_ctrl;

typedef struct rg_gather_call {
  rg_request req;
  uint64_t seq;
  int mode;
  int token_sent;     /* rendezvous: our ready token is posted */
  int posted;         /* this rank's part has been posted to the peer */
  uint32_t lanes_posted; /* bit per lane whose stripe is posted, so a full queue resumes there */
  int finished;       /* complete; stays set until the slot is reused */
  int writes_pending; /* signaled writes not yet complete */
  int landed;         /* both parts are in this rank's rows: they are placed together */
  int copying;        /* an asynchronous CUDA copy is in flight */
  int launched;       /* the gather kernel places this call (eager, CUDA memory) */
  int go_set;         /* every lane's write completed: the kernel may copy */
  int error;
  uint64_t bytes;          /* window bytes, for stats */
  uint64_t my_off, my_len; /* this rank's part, as offsets into the window */
  uint64_t peer_off, peer_len;
  const uint8_t* send;
  const rg_mr* send_mr;
  uint8_t* recv;
  const rg_mr* recv_mr;
  int cuda; /* send or recv is CUDA memory */
  int send_cuda, recv_cuda;
  uint64_t start_ns;
  CUevent copy_done;
} rg_gather_call;

typedef struct rg_gather_comm {
  rg_link* link;
  int rank; /* 0 or 1 */
  int mode; /* agreed ROCE_GATHER_MODE: 0 auto, or RG_MODE_* */
  uint64_t eager_max; /* auto mode: windows up to this size go eager */
  uint64_t slot_bytes;
  uint64_t timeout_ns;

  rg_gather_ctrl* ctrl; /* written by the peer */
  uint8_t* landing;     /* [RG_GATHER_DEPTH][slot_bytes], written by the peer */
  volatile uint64_t* arrival;       /* [RG_GATHER_DEPTH][RG_MAX_LANES], after the slots, written by the peer */
  volatile uint32_t* place_status;  /* [RG_GATHER_DEPTH][RG_PLACE_WORDS], after the arrival words */
  int landing_mapped;               /* the landing region is pinned and mapped for the GPU */
  uint64_t peer_ctrl_addr, peer_landing_addr, peer_arrival_addr;
  uint32_t peer_ctrl_rkey[RG_MAX_HCAS], peer_landing_rkey[RG_MAX_HCAS];

  rg_gather_call calls[RG_GATHER_DEPTH]; /* calls[seq % DEPTH] */
  uint64_t next_seq;                     /* sequence number of the next call, from 1 */
  uint64_t ready_seq[RG_GATHER_DEPTH];   /* newest ready token's 24-bit seq per slot; RG_SEQ_NONE before */
  uint64_t arrived_seq[RG_GATHER_DEPTH]; /* the 24-bit seq whose arrivals are counted; RG_SEQ_NONE before */
  int arrived[RG_GATHER_DEPTH];          /* lanes that delivered that seq */
  uint64_t peer_consumed;                /* newest seq the peer has freed the landing slot of */
  uint64_t consumed;                     /* newest seq this rank freed, all earlier included */
  uint64_t credit_sent;
  int probe_seen, probe_acked;

  rg_request flush_reqs[RG_GATHER_FLUSH_REQS];
  uint64_t flushes;

  CUstream stream; /* for CUDA copies; NULL until first needed */
  CUcontext cuda_ctx;
  rg_place_kernel place;
  int place_state; /* 1 loaded at connect; 0 or -1 not (eager copies then use cuMemcpyAsync) */
  int warned;
  int logged;
  uint32_t polls;

  uint64_t comm_id;            /* NCCL's communicator id, for the records */
} rg_gather_comm;

void rg_gather_init(rg_gather_comm* g);
/* Cancels gather kernels still waiting, then releases the stream, events and module. */
void rg_gather_fini(rg_gather_comm* g);

int rg_gather_iallgather(void* collComm, void* sendData, int nRecvParts, const rg_sge* recvParts,
                         uint64_t bytesPerRank, uint64_t windowOffset, uint64_t windowBytes, void* sendMhandle,
                         void** request);
int rg_gather_iflush(void* collComm, void* data, int size, void* mhandle, void** request);
int rg_gather_test(rg_request* req, int* done, uint64_t* sizes);

/* The live check at connect: each side proves it hears the peer and is heard. Blocks up
 * to timeout_ns; returns 0 when both directions work, else writes why into err. */
int rg_gather_probe(rg_gather_comm* g, uint64_t timeout_ns, char* err, int errlen);
int rg_gather_outstanding(const rg_gather_comm* g);
/* Where the calling thread has a CUDA context and the fabric takes CUDA memory: creates the
 * stream and events and loads the gather kernel, before any collective can wait on them.
 * Returns -1 with err set when the stream or events cannot be made; a kernel that does not
 * load is a WARN, and eager copies then use cuMemcpyAsync. use_kernel 0 (ROCE_GATHER_PLACEMENT=copy)
 * loads no kernel: every placement uses cuMemcpyAsync. */
int rg_gather_cuda_prepare(rg_gather_comm* g, int use_kernel, char* err, int errlen);

/* The per-call mode both ranks derive from the same inputs. */
int rg_gather_call_mode(const rg_gather_comm* g, uint64_t windowBytes, uint64_t part0, uint64_t part1);

#endif
