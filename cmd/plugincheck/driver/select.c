/* NCCL's selection rules, for checking that a tuner's table means the same under both. */
#include "select.h"
#include <float.h>

int nccl_pick_skipping_negatives(const float* after, int n) {
  int best = -1;
  float cost = FLT_MAX; /* where NCCL 2.29 and 2.30 start; 2.22 to 2.28 start at 3.6e9 us */
  for (int i = 0; i < n; i++)
    if (after[i] >= 0.0f && after[i] < cost) best = i, cost = after[i];
  return best;
}

int nccl_pick_plain_minimum(const float* before, const float* after, int n) {
  int best = -1;
  float cost = FLT_MAX;
  /* NCCL lists its valid tunings by pushing each at the front: the highest index comes first. */
  for (int i = n - 1; i >= 0; i--)
    if (before[i] >= 0.0f && after[i] < cost) best = i, cost = after[i];
  return best;
}
