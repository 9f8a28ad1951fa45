#ifndef RG_PLUGIN_TUNER_H
#define RG_PLUGIN_TUNER_H

#include <stddef.h>
#include <stdint.h>

/* What one communicator's tuner knows, copied from its collNet group at tuner init
 * (NCCL connects collNet before it initialises the tuner). */
typedef struct rg_tuner {
  uint64_t comm_id;
  size_t nranks, nnodes;
  int group_on;
  /* The window both ranks agreed, bytes a rank: one-shot when floor <= nBytes / 2 <= cap. */
  uint64_t agreed_floor, agreed_cap;
  /* Both ranks allow CollNet Direct where NCCL dropped it, and every node holds one rank,
   * so Direct has no intra-node peers that would need an NVSwitch. */
  int direct_without_nvswitch;
  /* How a one-shot gather is scheduled, as both ranks agreed: nChannels, and the chunk
   * size tuner v6 returns (0 leaves NCCL's). */
  int oneshot_channels;
  uint64_t oneshot_chunk;
  int warned_not_offered, warned_unoffered_used;
} rg_tuner;

/* The cost that keeps NCCL off an entry it offered, on every release. Never negative:
 * NCCL 2.31 takes the plain minimum of what it offered, so a negative cost (its own
 * "ignore", -1) would win there. Above NCCL 2.31's opt-in-only cost (FLT_MAX / 2) and
 * every real estimate, and below FLT_MAX, where NCCL 2.29 and later start their search:
 * the entry loses to every other one NCCL offered and is still a finite cost. NCCL 2.22 to
 * 2.28 start at an hour (3.6e9 us) and never take it. */
#define RG_TUNER_COST_NOT_THIS 3.0e38f

enum {
  RG_TUNE_NOT_OURS = 0,         /* not a two-rank AllGather: untouched */
  RG_TUNE_ONESHOT = 1,          /* steered to CollNet Direct / Simple, on the agreed channels */
  RG_TUNE_NCCL = 2,             /* left to NCCL's own algorithms: offered CollNet entries priced out */
  RG_TUNE_NCCL_NOT_OFFERED = 3, /* within the window, but NCCL marked CollNet Direct ignored: handled as RG_TUNE_NCCL */
  RG_TUNE_ONESHOT_UNOFFERED = 4, /* steered like RG_TUNE_ONESHOT onto the entry NCCL marked ignored */
};

/* Whether a two-rank AllGather of nBytes in all lies in the group's agreed window. */
int rg_tuner_in_window(const rg_tuner* t, size_t nBytes);

int rg_tuner_policy(const rg_tuner* t, int collType, size_t nBytes, float** table, int numAlgo, int numProto,
                    int* nChannels);

/* Tuner v6 (NCCL 2.30): the chunk size of a one-shot gather, where the group agreed one.
 * Returns 1 if it changed it. */
int rg_tuner_chunk_policy(const rg_tuner* t, int collType, size_t nBytes, int algo, int proto, size_t* chunkSize);

#endif
