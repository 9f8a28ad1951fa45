/* Process-wide counters written at finalize (ROCE_GATHER_STATS): the tuner's decisions
 * (plugin/tuner.c) and the one-shot calls (gather.c). Updated with relaxed atomics from
 * the hot path; read by Go. */
#ifndef RG_STATS_H
#define RG_STATS_H

#include <stdatomic.h>
#include <stdint.h>

/* Latency histogram: bucket i holds calls of [2^(i/4), 2^((i+1)/4)) nanoseconds. */
#define RG_LAT_BUCKETS 160

typedef struct rg_stats {
  /* Tuner decisions for two-rank AllGathers. */
  atomic_uint_fast64_t tuner_oneshot, tuner_oneshot_bytes;
  atomic_uint_fast64_t tuner_nccl, tuner_nccl_bytes;
  atomic_uint_fast64_t tuner_nccl_ignored; /* within the cap, but NCCL offered no CollNet Direct */
  atomic_uint_fast64_t tuner_oneshot_unoffered; /* one-shot onto that entry (ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH) */
  /* One-shot gather calls (iallgather), as executed, graph replays included. */
  atomic_uint_fast64_t gathers, gather_bytes, gathers_rendezvous, gathers_eager, gather_errors;
  atomic_uint_fast64_t gathers_kernel; /* eager calls the gather kernel placed */
  atomic_uint_fast64_t gather_lat[RG_LAT_BUCKETS];
} rg_stats;

extern rg_stats rg_global_stats;

/* The counters as plain numbers, for readers that cannot see atomics (cgo). */
typedef struct rg_stats_snapshot {
  uint64_t tuner_oneshot, tuner_oneshot_bytes, tuner_nccl, tuner_nccl_bytes, tuner_nccl_ignored;
  uint64_t tuner_oneshot_unoffered;
  uint64_t gathers, gather_bytes, gathers_rendezvous, gathers_eager, gather_errors, gathers_kernel;
  uint64_t gather_lat[RG_LAT_BUCKETS];
} rg_stats_snapshot;

void rg_stats_read(rg_stats_snapshot* out);
void rg_stats_latency(uint64_t ns);

#endif
