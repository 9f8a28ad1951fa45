/* The intercepted one-shot gather's shared layout (docs/roce-gather.md, "The intercepted
 * gather"): the region both ranks' kernels, proxies and NICs touch, the kernel's arguments,
 * and the rules both ranks derive from a gather's size alone. Plain C that nvcc, clang's
 * CUDA mode and gcc all read: the kernel (oneshot.cu), its host stand-in
 * (roce/gather/oneshot_host.c) and the proxy (roce/gather/oneshot.c) include it.
 *
 * One region a rank, in pinned host memory registered with the fabric:
 *   [ctrl: rg_os_ctrl][send slot 0][send slot 1][recv slot 0][recv slot 1]
 * A gather of sequence number seq (from 1) uses the slots of parity seq & 1. The kernel
 * stages each chunk of its shard into the send slot and rings that chunk's doorbell
 * (ready[parity][chunk] = seq); the proxy writes the chunk into the peer's receive slot,
 * then, on the same lane, the peer's flag of that lane (a level: seq << 16 | chunks
 * delivered); the peer's kernel waits for the level and copies the chunk out. Two slots
 * suffice: a rank starts gather seq + 2 only after its gather seq + 1 has the peer's data,
 * which the peer sent only after it finished gather seq. */
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
#define RG_OS_MAX_CHUNKS 16      /* chunks a gather is cut into, at most */
#define RG_OS_MAX_BLOCKS 16      /* the kernel's grid, at most: one block a chunk */
#define RG_OS_SLOT_ALIGN 4096    /* slots and chunks start on pages */
#define RG_OS_CHUNK_SHIFT 16     /* a flag's level: seq << 16 | chunks delivered */

/* Outcomes a gather reports (rg_os_report.status). */
enum rg_os_status {
  RG_OS_OK = 0,
  RG_OS_TIMED_OUT = 1, /* the peer's data did not arrive within the deadline */
  RG_OS_ABORTED = 2,   /* the host raised the abort word: abort, destroy or an error found by the proxy */
};

/* What the kernel tells the host about the gather of one parity, written by the block
 * that finishes it; seq is stored last, so a reader that sees seq sees the rest. */
typedef struct rg_os_report {
  volatile rg_u64 seq;     /* the gather these fields describe */
  volatile rg_u64 bytes;   /* bytes a rank; written before ready[parity][0] */
  volatile rg_u64 chunk;   /* chunk size; written with bytes */
  volatile rg_u64 status;  /* enum rg_os_status */
  volatile rg_u64 t_start;   /* the kernel's clock (%globaltimer, or CLOCK_MONOTONIC in the stand-in) */
  volatile rg_u64 t_staged;  /* the first chunk's doorbell rang */
  volatile rg_u64 t_arrived; /* the finishing block saw the last of its chunks from the peer */
  volatile rg_u64 t_end;
  /* Since the engine started, the gathers that wrote their rows and their bytes a rank: a
   * reader that missed reports still counts every gather. */
  volatile rg_u64 total_gathers;
  volatile rg_u64 total_bytes;
  rg_u64 pad[RG_OS_LINE / 8 - 10];
} rg_os_report;

typedef struct rg_os_line {
  volatile rg_u64 word;
  rg_u64 pad[RG_OS_LINE / 8 - 1];
} rg_os_line;

typedef struct rg_os_ctrl {
  /* Written by the peer's proxy through the fabric. */
  rg_os_line flag[RG_OS_MAX_LANES]; /* per lane: the level of the newest chunk delivered */
  rg_os_line probe;                 /* the live check's word */
  /* Written by this rank's kernel, read by its proxy. */
  volatile rg_u64 ready[2][RG_OS_MAX_CHUNKS]; /* the doorbell of each chunk: the seq staged */
  rg_os_report report[2];
  /* Written by this rank's host, read by its kernel. */
  rg_os_line abort; /* nonzero: every wait ends now, and no row is written */
} rg_os_ctrl;

/* Device memory of one engine: the sequence and the grid's meeting point. */
typedef struct rg_os_dev {
  rg_u64 seq;     /* the last gather finished; the next one is seq + 1 */
  rg_u32 arrived; /* blocks done with the current gather */
  rg_u32 failed;  /* the first failure a block saw, as enum rg_os_status */
  rg_u64 t_start;
  rg_u64 t_staged;
  rg_u64 total_gathers; /* rg_os_report's */
  rg_u64 total_bytes;
  rg_u64 pad[2];
} rg_os_dev;

/* One launch's arguments, passed by value as the kernel's single parameter. */
typedef struct rg_os_args {
  const unsigned char* send; /* this rank's shard */
  unsigned char* recv;       /* both rows: rank 0's, then rank 1's */
  rg_u64 bytes;              /* bytes a rank, nonzero */
  rg_u64 chunk;              /* rg_os_chunk_bytes(bytes, min_chunk) */
  rg_u32 nchunks;
  rg_u32 rank; /* 0 or 1 */
  rg_u32 lanes;
  rg_u32 pad;
  unsigned char* send_slots;       /* as the kernel addresses them: [2][slot_bytes] */
  const unsigned char* recv_slots; /* [2][slot_bytes] */
  rg_u64 slot_bytes;
  rg_os_ctrl* ctrl;
  rg_os_dev* dev;
  unsigned char* scratch; /* device memory of slot_bytes: chunks wait here until all have arrived */
  rg_u64 timeout_ns;      /* longest wait for the peer */
} rg_os_args;

/* The chunk size of a gather of bytes a rank: whole pages, at least min_chunk, and few
 * enough that a gather has at most RG_OS_MAX_CHUNKS. Both ranks compute it from the same
 * agreed min_chunk, so chunk c means the same bytes on both. */
RG_OS_HD static inline rg_u64 rg_os_chunk_bytes(rg_u64 bytes, rg_u64 min_chunk) {
  rg_u64 c = (bytes + RG_OS_MAX_CHUNKS - 1) / RG_OS_MAX_CHUNKS;
  c = (c + RG_OS_SLOT_ALIGN - 1) / RG_OS_SLOT_ALIGN * RG_OS_SLOT_ALIGN;
  return c < min_chunk ? min_chunk : c;
}

RG_OS_HD static inline rg_u32 rg_os_nchunks(rg_u64 bytes, rg_u64 chunk) { return (rg_u32)((bytes + chunk - 1) / chunk); }

/* The flag level that says chunks [0, n) of gather seq have arrived on a lane. */
RG_OS_HD static inline rg_u64 rg_os_level(rg_u64 seq, rg_u64 n) { return seq << RG_OS_CHUNK_SHIFT | n; }

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
