/* The timeline of sampled gathers (ROCE_GATHER_TRACE): for every call a group samples,
 * the time at each step the plugin sees, written into a file mapped shared, so that it
 * is complete however the process ends.
 *
 * The file (little-endian): a 64-byte rg_trace_header, then `capacity` records of
 * RG_TRACE_RECORD_BYTES, a ring: record number i (from 0) lives in slot i % capacity and
 * holds index i + 1 once begun. Stamps are CLOCK_MONOTONIC nanoseconds (rg_now_ns), 0 for
 * a step the call never reached. A stamp is taken when the plugin notices the step: in
 * iallgather, in test, or when either polls the fabric. docs/roce-gather.md, "Timeline",
 * has what each one means; trace.go reads the file.
 *
 * Off, it costs the hot path one branch on a NULL pointer at each place that stamps. */
#ifndef RG_TRACE_H
#define RG_TRACE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define RG_TRACE_MAGIC 0x3145434152544752ull /* "RGTRACE1" */
#define RG_TRACE_VERSION 2
#define RG_TRACE_RECORD_BYTES 256

enum rg_stamp {
  RG_T_IALLGATHER,  /* NCCL called iallgather: the call began */
  RG_T_RETURNED,    /* iallgather returned the request to NCCL */
  RG_T_TOKEN_SENT,  /* rendezvous: this rank's ready token was posted */
  RG_T_TOKEN_SEEN,  /* rendezvous: the peer's ready token for this call was seen */
  RG_T_POSTED,      /* this rank's part was posted on every lane */
  RG_T_WRITES_DONE, /* every lane reported this rank's write complete */
  RG_T_PEER_SEEN,   /* the peer's part was seen complete on every lane */
  RG_T_LAUNCHED,    /* the gather kernel was launched (eager, GPU memory) */
  RG_T_GO,          /* the kernel's go word was set */
  RG_T_PLACED,      /* both parts are in this rank's rows */
  RG_T_DONE,        /* the plugin found the call complete */
  RG_T_FIRST_TEST,  /* NCCL's first test of the request */
  RG_T_REPORTED,    /* NCCL's test that found the call done, as it reports it */
  RG_T_NEXT,        /* NCCL's next iallgather on the group, after the report */
  /* The intercepted gather (mode RG_TRACE_MODE_INTERCEPTED), as its proxy sees it. */
  RG_T_OS_DOORBELL, /* the kernel's first doorbell: its first chunk is staged */
  RG_T_OS_POSTED,   /* the last chunk and its flag are posted to the peer */
  RG_T_OS_PEER,     /* the peer's last chunk is in place, as its flags show */
  RG_T_OS_ROWS,     /* the kernel's report: both rows are written */
  RG_T_N
};

#define RG_TRACE_MODE_INTERCEPTED 3

enum rg_trace_flag { RG_TRACE_CUDA = 1, RG_TRACE_KERNEL = 2, RG_TRACE_FAILED = 4 };

typedef struct rg_trace_header {
  uint64_t magic;
  uint32_t version;
  uint32_t record_bytes;
  uint64_t capacity; /* records the ring holds */
  _Atomic uint64_t begun; /* records begun so far; the newest min(begun, capacity) are in the ring */
  uint64_t every;    /* a group samples the calls whose sequence number is a multiple of it */
  uint64_t pid;
  uint32_t stamps; /* RG_T_N */
  uint32_t reserved[3];
} rg_trace_header;
_Static_assert(sizeof(rg_trace_header) == 64, "the header is 64 bytes");

typedef struct rg_trace_record {
  uint64_t index;   /* record number + 1; 0: never begun */
  uint64_t comm_id; /* NCCL's communicator id, the same on both ranks */
  uint64_t seq;     /* the call's sequence number in its group, from 1 */
  uint64_t window_offset, window_bytes, bytes_per_rank;
  uint32_t rank, mode, lanes, flags; /* mode: 1 rendezvous, 2 eager; flags: enum rg_trace_flag */
  uint64_t test_calls;     /* NCCL's tests of the request, the reporting one included */
  uint64_t max_test_gap_ns; /* the longest wait between two of them (or return and the first) */
  uint64_t t[RG_T_N];
  /* The intercepted gather's kernel by its own clock (%globaltimer, which both ranks share
   * on one GPU): its start, its first doorbell, the finishing block's last chunk from the
   * peer, and its end. */
  uint64_t k_start, k_staged, k_arrived, k_end;
} rg_trace_record;
_Static_assert(sizeof(rg_trace_record) == RG_TRACE_RECORD_BYTES, "records are RG_TRACE_RECORD_BYTES");

/* The trace file this process writes, or NULL. */
typedef struct rg_trace {
  rg_trace_header* hdr;
  rg_trace_record* rec;
  uint64_t capacity, every;
} rg_trace;

rg_trace* rg_trace_current(void);
/* Maps a file of rg_trace_bytes(capacity) bytes (zeroed) shared and starts the ring;
 * groups connected from then on sample one call in every. Returns 0 or an errno. */
int rg_trace_attach(int fd, uint64_t capacity, uint64_t every, uint64_t pid);
/* Groups connected from then on trace nothing; the file keeps what it holds. */
void rg_trace_detach(void);
size_t rg_trace_bytes(uint64_t capacity);
/* Claims the next record of the ring and returns it zeroed, its index set. */
rg_trace_record* rg_trace_claim(rg_trace* t, uint64_t* index);

#endif
