/* The timeline of sampled intercepted collectives (ROCE_GATHER_TRACE): for every call an
 * engine samples, the time at each step its proxy sees and the kernel's own clock, written
 * into a file mapped shared, so that it is complete however the process ends.
 *
 * The file (little-endian): a 64-byte rg_trace_header, then `capacity` records of
 * RG_TRACE_RECORD_BYTES, a ring: record number i (from 0) lives in slot i % capacity and
 * holds index i + 1 once begun. Host stamps are CLOCK_MONOTONIC nanoseconds (rg_now_ns), 0
 * for a step the call never reached. docs/roce-gather.md, "Stats and timeline", has what each
 * one means; trace.go reads the file.
 *
 * Off, it costs the hot path one branch on a NULL pointer at each place that stamps. */
#ifndef RG_TRACE_H
#define RG_TRACE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define RG_TRACE_MAGIC 0x3145434152544752ull /* "RGTRACE1" */
#define RG_TRACE_VERSION 4
#define RG_TRACE_RECORD_BYTES 112

/* The steps of one call as its proxy sees them. */
enum rg_stamp {
  RG_T_OS_DOORBELL, /* the kernel's first doorbell: its first chunk is staged */
  RG_T_OS_POSTED,   /* the last chunk and its flag are posted to the peer */
  RG_T_OS_PEER,     /* the peer's last chunk is in place, as its flags show */
  RG_T_OS_ROWS,     /* the kernel's report: its output is written */
  RG_T_N
};

/* The collective a record is of: kernels/oneshot.h's enum rg_os_collective (version 4 on;
 * version 3 had 0 and 1). */
enum rg_trace_coll { RG_TRACE_ALLGATHER = 1, RG_TRACE_ALLREDUCE = 2 };

typedef struct rg_trace_header {
  uint64_t magic;
  uint32_t version;
  uint32_t record_bytes;
  uint64_t capacity; /* records the ring holds */
  _Atomic uint64_t begun; /* records begun so far; the newest min(begun, capacity) are in the ring */
  uint64_t every;    /* an engine samples the calls whose sequence number is a multiple of it */
  uint64_t pid;
  uint32_t stamps; /* RG_T_N */
  uint32_t reserved[3];
} rg_trace_header;
_Static_assert(sizeof(rg_trace_header) == 64, "the header is 64 bytes");

typedef struct rg_trace_record {
  uint64_t index;   /* record number + 1; 0: never begun */
  uint64_t comm_id; /* the communicator, as this rank's process addresses it */
  uint64_t seq;     /* the call's sequence number on its communicator, from 1 */
  uint64_t bytes_per_rank;
  uint32_t rank, coll, lanes; /* coll: enum rg_trace_coll */
  uint32_t reserved;          /* 0; keeps t 8-byte aligned */
  uint64_t t[RG_T_N];
  /* The kernel by its own clock (%globaltimer on a GPU, which both ranks share on one; the
   * host stand-in's is CLOCK_MONOTONIC): its start, its first doorbell, the finishing block's
   * last chunk from the peer, and its end. */
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
 * engines set up from then on sample one call in every. Returns 0 or an errno. */
int rg_trace_attach(int fd, uint64_t capacity, uint64_t every, uint64_t pid);
/* Engines set up from then on trace nothing; the file keeps what it holds. */
void rg_trace_detach(void);
size_t rg_trace_bytes(uint64_t capacity);
/* Claims the next record of the ring and returns it zeroed, its index set. */
rg_trace_record* rg_trace_claim(rg_trace* t, uint64_t* index);

#endif
