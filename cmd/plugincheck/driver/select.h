/* NCCL's two rules for turning the cost table a tuner edited into an algorithm and a
 * protocol. Each returns the entry's index (algo * numProto + proto), or -1 for none. */
#ifndef RG_SELECT_H
#define RG_SELECT_H

/* NCCL 2.22 to 2.30 (topoGetAlgoInfo): negative entries (its "ignore", -1) skipped, the
 * smallest of the rest; a tie goes to the lowest index. */
int nccl_pick_skipping_negatives(const float* after, int n);

/* NCCL 2.31 (ncclTuningSelectBestTuning): the entries NCCL offered (non-negative in
 * before, the table it handed the tuner), each at its cost in after, the smallest with no
 * test of its sign; a tie goes to the highest index. */
int nccl_pick_plain_minimum(const float* before, const float* after, int n);

#endif
