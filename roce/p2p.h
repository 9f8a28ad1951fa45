/* The p2p message protocol NCCL's net runs on. Two forms, by what the lane offers:
 *
 * Receiver-driven (verbs), like NCCL's IB transport: irecv writes a clear-to-send (CTS)
 * entry per buffer into the sender's FIFO with a WRITE_IMM. isend waits for the CTS of its
 * slot, matches its tag, writes the payload straight into the receiver's buffer, then
 * writes the size into the receiver's completion records with a WRITE_IMM that names slot
 * and entry.
 *
 * Two-sided (tcp, lanes with post_recv): isend posts the tagged message at once; irecv
 * posts its buffers to the local lane, which places each message into the receive it
 * belongs to as it reads it. One write and one read a message, as NCCL's socket
 * transport, where the receiver-driven form costs a second of each on a TCP lane.
 *
 * Either way nothing is written into a receiver's buffer before its irecv was posted. */
#ifndef RG_P2P_H
#define RG_P2P_H

#include "fabric/fabric.h"
#include "request.h"

#define RG_P2P_SLOTS 256    /* CTS FIFO depth: outstanding irecvs per comm */
_Static_assert(RG_P2P_SLOTS <= RG_LANE_RECVS, "a two-sided lane takes every outstanding irecv");
#define RG_P2P_MAX_RECVS 8  /* buffers per irecv (NCCL's maxRecvs) */
#define RG_P2P_SEND_REQS 256
#define RG_P2P_FLUSH_REQS 32

/* Immediate values: the class in the top nibble. */
#define RG_IMM_CLASS(imm) ((imm) >> 28)
#define RG_IMM_CTS 1u
#define RG_IMM_DATA 2u
#define RG_IMM_GATHER 3u

typedef struct rg_cts_entry {
  uint64_t addr;
  uint64_t size;
  uint32_t rkey;
  int32_t tag;
  uint32_t nreqs;
  uint32_t reserved;
  uint64_t id; /* irecv sequence number, for diagnostics */
  uint64_t pad[3];
} rg_cts_entry;
_Static_assert(sizeof(rg_cts_entry) == 64, "CTS entries are 64 bytes");

#define RG_P2P_FIFO_BYTES (sizeof(rg_cts_entry) * RG_P2P_SLOTS * RG_P2P_MAX_RECVS)
#define RG_P2P_CMPL_BYTES (sizeof(uint64_t) * RG_P2P_SLOTS * RG_P2P_MAX_RECVS)

typedef struct rg_p2p_send {
  rg_link* link;
  rg_lane* lane;
  rg_cts_entry* fifo; /* written by the receiver; registered as fifo_mr */
  uint8_t cts_ready[RG_P2P_SLOTS];
  uint64_t head; /* the irecv id whose entries the next sends match */
  uint8_t matched[RG_P2P_MAX_RECVS];
  int nmatched;
  uint64_t peer_cmpl_addr;
  uint32_t peer_cmpl_rkey;
  rg_request reqs[RG_P2P_SEND_REQS];
  int free_reqs[RG_P2P_SEND_REQS];
  int nfree;
  uint64_t sends; /* sequence number of the next isend, for log lines */
  char stray[192]; /* a completion the protocol had no place for: the comm has failed */
  int warned;
  int logged; /* one-time INFO lines already written (bit per event) */
  uint32_t polls;
} rg_p2p_send;

typedef struct rg_p2p_recv {
  rg_link* link;
  rg_lane* lane;
  rg_cts_entry* cts; /* staging for CTS writes; registered as cts_mr */
  const rg_mr* cts_mr;
  uint64_t* cmpl; /* sizes written by the sender; registered */
  uint64_t peer_fifo_addr;
  uint32_t peer_fifo_rkey;
  uint64_t head; /* id of the next irecv */
  rg_request reqs[RG_P2P_SLOTS]; /* reqs[id % RG_P2P_SLOTS] */
  rg_request flush_reqs[RG_P2P_FLUSH_REQS];
  uint64_t flushes;
  char stray[192]; /* a completion the protocol had no place for: the comm has failed */
  int warned;
  int logged;
  uint32_t polls;
} rg_p2p_recv;

/* Hot path. Results are ncclResult_t values; *request is NULL when the caller must retry. */
int rg_p2p_isend(rg_p2p_send* s, void* data, uint64_t size, int tag, const rg_mr* mr, void** request);
int rg_p2p_irecv(rg_p2p_recv* r, int n, void** data, const uint64_t* sizes, const int* tags, const rg_mr* const* mrs,
                 void** request);
/* NCCL's GPUDirect flush; *request stays NULL (done) when the link needs none. */
int rg_p2p_iflush(rg_p2p_recv* r, int n, void** data, const int* sizes, const rg_mr* const* mrs, void** request);
int rg_p2p_test(rg_request* req, int* done, uint64_t* sizes);

void rg_p2p_send_init(rg_p2p_send* s);
void rg_p2p_recv_init(rg_p2p_recv* r);
/* Requests still outstanding, for close and leak checks. */
int rg_p2p_send_outstanding(const rg_p2p_send* s);
int rg_p2p_recv_outstanding(const rg_p2p_recv* r);

#endif
