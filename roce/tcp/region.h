/* Internal to the tcp fabric: registered regions as a lane looks them up. */
#ifndef RG_TCP_REGION_H
#define RG_TCP_REGION_H

#include "tcp.h"

struct rg_tcp_region {
  uint64_t addr;
  uint64_t len;
  uint32_t key;
  atomic_int refs; /* writes being placed into it right now */
};

enum { RG_TCP_BAD_KEY = 1, RG_TCP_OUT_OF_BOUNDS = 2 };

/* Finds the region a write names and pins it until release; NULL with *why set if the
 * key is unknown or [addr, addr+len) is not inside it. */
rg_tcp_region* rg_tcp_region_acquire(rg_tcp_dev* dev, uint32_t key, uint64_t addr, uint64_t len, int* why);
void rg_tcp_region_release(rg_tcp_region* reg);

#endif
