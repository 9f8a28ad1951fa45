/* The intercepted one-shot collectives' shared layout (docs/roce-gather.md, "The intercepted
 * gather"): the region both ranks' kernels, proxies and NICs touch, the kernel's arguments,
 * and the rules both ranks derive from a call's size alone. Plain C that nvcc, clang's CUDA
 * mode and gcc all read: the kernel (oneshot.cu), its host stand-in
 * (roce/gather/oneshot_host.c) and the proxy (roce/gather/oneshot.c) include it.
 *
 * One region a rank, in pinned host memory registered with the fabric:
 *   [ctrl: rg_os_ctrl][send slot 0][send slot 1][recv slot 0][recv slot 1]
 * A call of sequence number seq (from 1) uses the slots, flags and announcements of parity
 * seq & 1. The kernel writes its announcement (what the call is), stages each chunk of its
 * shard into the send slot and rings that chunk's doorbell (ready[parity][chunk] = seq).
 * The proxy writes, on each lane in this order: with chunk 0 on lane 0, the announcement
 * into the peer's announce[parity]; the lane's stripe of the chunk into the peer's receive
 * slot; the peer's flag[parity][lane], a level: seq << 16 | chunks delivered. A lane places
 * writes in post order, so the flag is the one word whose store publishes the rest: the
 * peer's kernel reads the announcement and the data only after its acquire load of the
 * flag showed seq, and accepts only its own seq (a later one is an error). Two parities
 * suffice: a rank starts call seq + 2 only after its call seq + 1 has the peer's data,
 * which the peer sent only after it finished call seq. */
#ifndef RG_KERNELS_ONESHOT_H
#define RG_KERNELS_ONESHOT_H

#if defined(__CUDA__) || defined(__CUDACC__)
typedef unsigned long long rg_u64;
typedef unsigned int rg_u32;
#define RG_OS_HD __attribute__((host)) __attribute__((device))
#else
#include <stdint.h>
typedef uint64_t rg_u64;
typedef uint32_t rg_u32;
#define RG_OS_HD
#endif

#define RG_OS_LINE 128           /* words written from different sides never share a line */
#define RG_OS_MAX_LANES 4        /* the fabric's RG_MAX_LANES */
#define RG_OS_MAX_CHUNKS 16      /* chunks a call is cut into, at most */
#define RG_OS_MAX_THREADS 512    /* a block's threads, at most: the kernel's launch bound */
#define RG_OS_MAX_BLOCKS 16      /* the kernel's grid, at most: one block a chunk */
#define RG_OS_SLOT_ALIGN 4096    /* slots and chunks start on pages */
#define RG_OS_CHUNK_SHIFT 16     /* a flag's level: seq << 16 | chunks delivered */

/* Outcomes a call reports (rg_os_report.status, rg_os_failure.status). */
enum rg_os_status {
  RG_OS_OK = 0,
  RG_OS_TIMED_OUT = 1,   /* the peer's data did not arrive within the deadline */
  RG_OS_ABORTED = 2,     /* the host raised the abort word (abort, destroy, an error), or an earlier call failed */
  RG_OS_MISMATCH = 3,    /* the peer's announcement is not this call's: another size, chunking, collective or a later sequence */
  RG_OS_PEER_CLOSED = 4, /* the peer's closing word says it stopped before this call */
  RG_OS_OVERLAP = 5,     /* another launch of this engine ran on the device at the same time */
};

/* The collectives an announcement names (rg_os_coll). */
enum rg_os_collective { RG_OS_ALLGATHER = 1, RG_OS_ALLREDUCE = 2 };

/* An announcement's collective word: the collective, and for a reduction its op and datatype. */
RG_OS_HD static inline rg_u64 rg_os_coll(rg_u32 collective, rg_u32 op, rg_u32 datatype) {
  return (rg_u64)collective | (rg_u64)(op & 0xff) << 8 | (rg_u64)(datatype & 0xff) << 16;
}

RG_OS_HD static inline rg_u32 rg_os_coll_kind(rg_u64 coll) { return (rg_u32)(coll & 0xff); }
RG_OS_HD static inline rg_u32 rg_os_coll_op(rg_u64 coll) { return (rg_u32)(coll >> 8 & 0xff); }
RG_OS_HD static inline rg_u32 rg_os_coll_dtype(rg_u64 coll) { return (rg_u32)(coll >> 16 & 0xff); }

/* What a rank announces for a call, exactly: both ranks' must be equal. */
typedef struct rg_os_announce {
  rg_u64 seq;
  rg_u64 bytes;   /* bytes a rank (a gather's shard, an all-reduce's whole buffer) */
  rg_u64 chunk;   /* chunk size */
  rg_u64 nchunks;
  rg_u64 coll;    /* rg_os_coll */
  rg_u64 call;    /* the host's number for the call (a graph's replays carry the captured call's) */
} rg_os_announce;

typedef struct rg_os_announce_line {
  rg_os_announce a;
  rg_u64 pad[RG_OS_LINE / 8 - sizeof(rg_os_announce) / 8];
} rg_os_announce_line;

/* The first failed call of an engine, kept by the kernel and repeated in every later report,
 * so that a reader that missed the report of that call still learns why. */
typedef struct rg_os_failure {
  rg_u64 status;       /* enum rg_os_status; RG_OS_OK while none failed */
  rg_os_announce mine; /* the failed call, as this rank announced it */
  rg_os_announce peer; /* what the peer announced, where the failure is a mismatch */
} rg_os_failure;

/* Reads an announcement, or a failure, that another side writes (oneshot_body.h stores them)
 * into plain memory: the kernel's, the stand-in's and the proxy's reads. */
RG_OS_HD static inline void rg_os_load_announce(const volatile rg_os_announce* src, rg_os_announce* out) {
  out->seq = src->seq;
  out->bytes = src->bytes;
  out->chunk = src->chunk;
  out->nchunks = src->nchunks;
  out->coll = src->coll;
  out->call = src->call;
}

RG_OS_HD static inline void rg_os_load_failure(const volatile rg_os_failure* src, rg_os_failure* out) {
  rg_os_load_announce(&src->mine, &out->mine);
  rg_os_load_announce(&src->peer, &out->peer);
  out->status = src->status;
}

/* What the kernel tells the host about the call of one parity, written by the block that
 * finishes it; seq is stored last (a release), so a reader that sees seq sees the rest. */
typedef struct rg_os_report {
  volatile rg_u64 seq;       /* the call these fields describe */
  volatile rg_u64 status;    /* enum rg_os_status */
  volatile rg_u64 t_start;   /* the kernel's clock (%globaltimer, or CLOCK_MONOTONIC in the stand-in) */
  volatile rg_u64 t_staged;  /* the first chunk's doorbell rang */
  volatile rg_u64 t_arrived; /* the finishing block saw the last of its chunks from the peer */
  volatile rg_u64 t_end;
  /* Since the engine started, the calls that wrote their output and their bytes a rank, per
   * collective: a reader that missed reports still counts every call. */
  volatile rg_u64 total_gathers;
  volatile rg_u64 total_bytes;
  volatile rg_u64 total_allreduces;
  volatile rg_u64 total_allreduce_bytes;
  volatile rg_u64 coll;  /* rg_os_coll of the call these fields describe */
  rg_os_failure failure; /* the engine's first failed call */
  rg_u64 pad[(2 * RG_OS_LINE - 11 * 8 - sizeof(rg_os_failure)) / 8];
} rg_os_report;

typedef struct rg_os_line {
  volatile rg_u64 word;
  rg_u64 pad[RG_OS_LINE / 8 - 1];
} rg_os_line;

/* The closing word's reasons (its low byte; the last sequence sent whole is above it). */
enum rg_os_closed { RG_OS_CLOSED_ABORT = 1, RG_OS_CLOSED_DESTROY = 2, RG_OS_CLOSED_FAILED = 3 };
#define RG_OS_CLOSED_SHIFT 8

typedef struct rg_os_ctrl {
  /* Written by the peer's proxy through the fabric. */
  rg_os_line flag[2][RG_OS_MAX_LANES];  /* per parity and lane: the level of the newest chunk delivered */
  rg_os_announce_line announce[2];      /* per parity: the peer's announcement, on lane 0 before chunk 0 */
  rg_os_line closed; /* nonzero: the peer stopped: (last seq whose data it sent whole) << 8 | enum rg_os_closed */
  rg_os_line probe;  /* the live check's word */
  /* Written by this rank's kernel, read by its proxy. */
  rg_os_announce_line mine[2];                /* this rank's announcement, written before the first doorbell */
  volatile rg_u64 ready[2][RG_OS_MAX_CHUNKS]; /* the doorbell of each chunk: the seq staged */
  rg_os_line running; /* the seq of the launch that holds the engine (close waits until it reported) */
  rg_os_line overlap; /* nonzero: a launch found another launch of this engine running */
  rg_os_report report[2];
  /* Written by this rank's host, read by its kernel. */
  rg_os_line abort; /* nonzero: no doorbell rings and every wait ends now, with no row written */
} rg_os_ctrl;

/* The device-side gate: the launch that holds the engine (its id, low bits), and the bit a
 * launch that found it held sets; every launch after that fails. */
#define RG_OS_GATE_POISON (1ull << 63)
#define RG_OS_GATE_OWNER (~RG_OS_GATE_POISON)

/* Device memory of one engine: the sequence, the gate and the grid's meeting point. */
typedef struct rg_os_dev {
  rg_u64 seq;     /* the last call finished; the next one is seq + 1 */
  rg_u64 gate;    /* RG_OS_GATE_*: changed with atomics only */
  rg_u32 arrived; /* blocks done with the current call */
  rg_u32 failed;  /* the first failure a block saw, as enum rg_os_status */
  rg_u64 t_start;
  rg_u64 t_staged;
  rg_u64 total_gathers; /* rg_os_report's */
  rg_u64 total_bytes;
  rg_u64 total_allreduces;
  rg_u64 total_allreduce_bytes;
  rg_os_announce peer_seen; /* the peer's announcement a block found wrong */
  rg_os_failure failure;    /* the engine's first failed call */
} rg_os_dev;

/* One launch's arguments, passed by value as the kernel's single parameter. */
typedef struct rg_os_args {
  const unsigned char* send; /* this rank's shard (an all-reduce: its operand) */
  unsigned char* recv;       /* both rows: rank 0's, then rank 1's (an all-reduce: op(x0, x1), bytes of it) */
  rg_u64 bytes;              /* bytes a rank, nonzero */
  rg_u64 chunk;              /* rg_os_chunk_bytes(bytes, min_chunk) */
  rg_u32 nchunks;
  rg_u32 rank; /* 0 or 1 */
  rg_u32 lanes;
  rg_u32 pad;
  rg_u64 coll;      /* rg_os_coll of the call: the collective, and an all-reduce's op and datatype */
  rg_u64 call;      /* the host's number for the call, announced */
  rg_u64 launch_id; /* the stand-in's id of this launch (the kernel uses %gridid) */
  unsigned char* send_slots;       /* as the kernel addresses them: [2][slot_bytes] */
  const unsigned char* recv_slots; /* [2][slot_bytes] */
  rg_u64 slot_bytes;
  rg_os_ctrl* ctrl;
  rg_os_dev* dev;
  unsigned char* scratch; /* device memory of slot_bytes: chunks wait here until all have arrived */
  rg_u64 timeout_ns;      /* longest wait for the peer */
} rg_os_args;

/* The chunk size of a call of bytes a rank: whole pages, at least min_chunk, and few
 * enough that a call has at most RG_OS_MAX_CHUNKS. Both ranks compute it from the same
 * agreed min_chunk, so chunk c means the same bytes on both. */
RG_OS_HD static inline rg_u64 rg_os_chunk_bytes(rg_u64 bytes, rg_u64 min_chunk) {
  rg_u64 c = (bytes + RG_OS_MAX_CHUNKS - 1) / RG_OS_MAX_CHUNKS;
  c = (c + RG_OS_SLOT_ALIGN - 1) / RG_OS_SLOT_ALIGN * RG_OS_SLOT_ALIGN;
  return c < min_chunk ? min_chunk : c;
}

RG_OS_HD static inline rg_u32 rg_os_nchunks(rg_u64 bytes, rg_u64 chunk) { return (rg_u32)((bytes + chunk - 1) / chunk); }

/* The flag level that says chunks [0, n) of call seq have arrived on a lane. */
RG_OS_HD static inline rg_u64 rg_os_level(rg_u64 seq, rg_u64 n) { return seq << RG_OS_CHUNK_SHIFT | n; }
RG_OS_HD static inline rg_u64 rg_os_level_seq(rg_u64 level) { return level >> RG_OS_CHUNK_SHIFT; }
RG_OS_HD static inline rg_u64 rg_os_level_chunks(rg_u64 level) { return level & ((1ull << RG_OS_CHUNK_SHIFT) - 1); }

/* Whether two announcements name the same call. */
RG_OS_HD static inline int rg_os_same_call(const rg_os_announce* x, const rg_os_announce* y) {
  return x->seq == y->seq && x->bytes == y->bytes && x->chunk == y->chunk && x->nchunks == y->nchunks &&
         x->coll == y->coll && x->call == y->call;
}

/* Lane l's part of a chunk of n bytes: whole 16-byte units, the first lanes one more. */
RG_OS_HD static inline void rg_os_stripe(rg_u64 n, rg_u32 lanes, rg_u32 l, rg_u64* off, rg_u64* len) {
  rg_u64 units = (n + 15) / 16, per = units / lanes, extra = units % lanes;
  rg_u64 first = l * per + (l < extra ? l : extra);
  rg_u64 count = per + (l < extra ? 1 : 0);
  rg_u64 b = first * 16, e = (first + count) * 16;
  if (b > n) b = n;
  if (e > n) e = n;
  *off = b;
  *len = e - b;
}

#endif
