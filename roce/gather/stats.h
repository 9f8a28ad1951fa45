/* Process-wide counters (ROCE_GATHER_STATS): the intercepted calls (plugin/oneshot.c,
 * oneshot.c) and the calls that reached the interceptor's wrappers (plugin/intercept.c),
 * updated with atomics from the hot path and read by Go.
 *
 * Where ROCE_GATHER_STATS names a file, the file is a JSON document mapped shared into
 * the process (plugin/stats.go), with every counter's value in a slot of fixed width.
 * rg_stats_add shows the new value in its slot at once, with plain stores into the
 * mapping: no system call, no lock. The page cache holds the file, so it is complete
 * however the process ends, _exit and crashes included. */
#ifndef RG_STATS_H
#define RG_STATS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* Latency histogram: bucket i holds calls of [2^(i/4), 2^((i+1)/4)) nanoseconds. */
#define RG_LAT_BUCKETS 160

/* A value's slot in the stats file: any uint64_t in decimal, right-aligned after spaces,
 * at an offset that is a multiple of RG_STAT_ALIGN (stored a word at a time). */
#define RG_STAT_WIDTH 24
#define RG_STAT_ALIGN 8

enum rg_stat {
  /* The intercepted gather (plugin/oneshot.c, oneshot.c). */
  RG_STAT_OS_LAUNCHES,       /* ncclAllGather calls the one-shot path took (a captured call counts once) */
  RG_STAT_OS_LAUNCH_BYTES,
  RG_STAT_OS_FORWARDED,      /* ncclAllGather calls of communicators the interceptor knows, handed to NCCL */
  RG_STAT_OS_FORWARDED_BYTES,
  RG_STAT_OS_GATHERS,        /* one-shot gathers the kernel finished, graph replays included */
  RG_STAT_OS_BYTES,
  RG_STAT_OS_ERRORS,
  RG_STAT_OS_NAPS, /* times the proxy went to sleep after being idle */
  RG_STAT_OS_WOKE, /* times it found a gather in flight right after a nap */
  /* The intercepted all-reduce, as the gather's (an all-reduce's bytes: its buffer's). */
  RG_STAT_AR_LAUNCHES,
  RG_STAT_AR_LAUNCH_BYTES,
  RG_STAT_AR_FORWARDED, /* ncclAllReduce calls of communicators the interceptor knows, handed to NCCL */
  RG_STAT_AR_FORWARDED_BYTES,
  RG_STAT_AR_ALLREDUCES, /* one-shot all-reduces the kernel finished, graph replays included */
  RG_STAT_AR_BYTES,
  RG_STAT_AR_ERRORS,
  /* Calls that reached each of the interceptor's wrappers, in plugin/intercept.h's order. */
  RG_STAT_CALL_ALLGATHER,
  RG_STAT_CALL_COMM_INIT_RANK,
  RG_STAT_CALL_COMM_INIT_RANK_CONFIG,
  RG_STAT_CALL_COMM_INIT_ALL,
  RG_STAT_CALL_COMM_SPLIT,
  RG_STAT_CALL_COMM_FINALIZE,
  RG_STAT_CALL_COMM_DESTROY,
  RG_STAT_CALL_COMM_ABORT,
  RG_STAT_CALL_COMM_GET_ASYNC_ERROR,
  RG_STAT_CALL_GROUP_START,
  RG_STAT_CALL_GROUP_END,
  RG_STAT_CALL_ALL_REDUCE,
  RG_STATS_N
};

/* Adds d to counter s and shows its new value in the stats file, if one is attached. */
void rg_stats_add(enum rg_stat s, uint64_t d);
/* The kernel time of an intercepted gather (allreduce 0), start to rows written, or of an
 * all-reduce (1), start to its output written. */
void rg_stats_latency(int allreduce, uint64_t ns);

/* The counters as plain numbers, for readers that cannot see atomics (cgo). */
typedef struct rg_stats_snapshot {
  uint64_t v[RG_STATS_N];
  uint64_t os_lat[RG_LAT_BUCKETS];
  uint64_t ar_lat[RG_LAT_BUCKETS];
} rg_stats_snapshot;

void rg_stats_read(rg_stats_snapshot* out);

/* Maps len bytes of fd shared and shows every counter in it from now on: slot[s] is the
 * offset of counter s's slot. Returns 0, or an errno. Call with no counter being added
 * (while no communicator is live); it replaces a file attached before. */
int rg_stats_attach(int fd, size_t len, const uint32_t slot[RG_STATS_N]);
/* Stops showing counters in the file and unmaps it. */
void rg_stats_detach(void);
/* Writes text, right-aligned in a slot of RG_STAT_WIDTH bytes at offset at (one writer:
 * the Go side, for the values it derives). */
void rg_stats_show_text(uint32_t at, const char* text);

#endif
