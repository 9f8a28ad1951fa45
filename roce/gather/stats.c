#include "stats.h"

rg_stats rg_global_stats;

static int bucket_of(uint64_t ns) {
  if (ns == 0) return 0;
  int log2 = 63 - __builtin_clzll(ns);
  /* Two bits below the leading one give quarter-octave resolution. */
  int frac = log2 >= 2 ? (int)((ns >> (log2 - 2)) & 3) : 0;
  int b = log2 * 4 + frac;
  return b < RG_LAT_BUCKETS ? b : RG_LAT_BUCKETS - 1;
}

void rg_stats_latency(uint64_t ns) {
  atomic_fetch_add_explicit(&rg_global_stats.gather_lat[bucket_of(ns)], 1, memory_order_relaxed);
}

void rg_stats_read(rg_stats_snapshot* out) {
  rg_stats* g = &rg_global_stats;
  out->tuner_oneshot = atomic_load(&g->tuner_oneshot);
  out->tuner_oneshot_bytes = atomic_load(&g->tuner_oneshot_bytes);
  out->tuner_nccl = atomic_load(&g->tuner_nccl);
  out->tuner_nccl_bytes = atomic_load(&g->tuner_nccl_bytes);
  out->tuner_nccl_ignored = atomic_load(&g->tuner_nccl_ignored);
  out->tuner_oneshot_unoffered = atomic_load(&g->tuner_oneshot_unoffered);
  out->gathers = atomic_load(&g->gathers);
  out->gather_bytes = atomic_load(&g->gather_bytes);
  out->gathers_rendezvous = atomic_load(&g->gathers_rendezvous);
  out->gathers_eager = atomic_load(&g->gathers_eager);
  out->gather_errors = atomic_load(&g->gather_errors);
  out->gathers_kernel = atomic_load(&g->gathers_kernel);
  for (int i = 0; i < RG_LAT_BUCKETS; i++) out->gather_lat[i] = atomic_load(&g->gather_lat[i]);
}
